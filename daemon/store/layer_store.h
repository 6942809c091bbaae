// LayerStore: layer-version files under the data directory and the commit
// protocol that makes them durable and visible.
//
// Directory layout (owned here):
//   <data_dir>/index/                         RocksDB (index.h)
//   <data_dir>/jobs/<job>/rank-<rank:8>/      one directory per rank
//       L<layer:8>-S<step:16>-G<gen:16>.ckv   committed layer versions (format.h)
//       tmp.<...>                             in-flight writes; removed at start
//   <data_dir>/quarantine/<job>/rank-<rank:8>/  layer files start-up found
//       without a record (or after the rank's last event); never deleted by
//       ckptd, restored to the index by `ckptctl repair` (repair.h)
//
// Commit protocol for one layer version (docs/file-format.md):
//   create tmp (O_EXCL, O_DIRECT) -> fallocate -> write every chunk and reap
//   every completion -> fdatasync -> renameat2(NOREPLACE) -> fsync(rank dir)
//   -> RocksDB sync put of the VersionRecord -> visible.
// A failure at any step fails that version: the temp file is removed, nothing
// becomes visible, the previous version stays, and a failed fdatasync is never
// retried. Kill points mark each step for the crash tests.
//
// The protocol runs in two halves: Write (up to the writes) and Publish
// (the rest), which takes a group of written versions, fdatasyncs them at
// once and makes them visible with one fsync per rank directory and one
// synchronous index batch for the group, each version still in the order
// above. Commit is both for
// one version; the engine's writers call Write and hand the result to a
// Publisher thread (publisher.h), so the disk streams the next version's
// data while the last ones' names and records are made durable.
//
// Thread-safety: thread-safe; Commit and Write may run concurrently for
// different versions (each caller brings its own IoBackend), Publish
// concurrently for different groups.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/unique_fd.h"
#include "daemon/io/file_system.h"
#include "daemon/io/io_backend.h"
#include "daemon/staging/staging_pool.h"
#include "daemon/store/byte_image.h"
#include "daemon/store/format.h"
#include "daemon/store/index.h"

namespace ckpt {

// The chunks of a staging lease (which must outlive the view).
class LeaseImage final : public ByteImage {
 public:
  explicit LeaseImage(const StagingLease& lease) : lease_(lease) {}
  uint64_t size() const override { return lease_.capacity(); }
  void ForEachPiece(uint64_t offset, uint64_t len,
                    const std::function<void(char*, uint64_t)>& fn) const override {
    // The chunks are the pool's writable memory; the lease only lends them.
    lease_.ForEachPiece(offset, len,
                        [&fn](const char* p, uint64_t n) { fn(const_cast<char*>(p), n); });
  }

 private:
  const StagingLease& lease_;
};

// Names of the directory layout above: "rank-<rank:8>" and
// "L<layer:8>-S<step:16>-G<gen:16>.ckv" (the parsers accept exactly that).
std::string RankDirName(uint32_t rank);
bool ParseRankDirName(const std::string& name, uint32_t* rank);
bool ParseFileName(const std::string& name, uint32_t* layer, uint64_t* step);

// What Index::MarkLost records for the version `rec` names, lost for `why`
// now.
store::LostVersion LostRecord(const store::VersionRecord& rec, const std::string& why);

// One layer version in staging, ready to commit. `header` has every tensor's
// metadata and layout offsets (PlanLayout); its checksums are filled in by
// Commit from the staged bytes.
struct StagedVersion {
  VersionKey key;
  uint64_t generation = 0;
  store::LayerFileHeader header;
  VersionLayout layout;
  StagingLease lease;
};

// Where a commit spent its time (for the latency histograms).
// A read of one committed file into a staging lease (LayerStore::PrepareRead).
struct VersionRead {
  UniqueFd fd;
  std::vector<IoSegment> segments;
};

struct CommitTimings {
  double hash_seconds = 0;   // checksums and the header
  double write_seconds = 0;  // data written and every completion reaped
  double sync_seconds = 0;   // fdatasync of the data (its publish group's, at once)
  double total_seconds = 0;  // temp file created .. index record written
};

// A version whose bytes are written to its temp file, not yet fdatasync'ed
// nor visible: what LayerStore::Write hands to LayerStore::Publish, which
// makes it durable and then visible. Its staging lease may be written
// again once this exists (the bytes reached the file).
struct WrittenVersion {
  VersionKey key;
  std::shared_ptr<const UniqueFd> dir;  // the rank directory, held open
  UniqueFd fd;                          // the temp file
  std::string tmp_name;
  store::VersionRecord record;  // complete but committed_unix_ms (set when published)
  CommitTimings timings;        // all but total_seconds, which Publish sets
  absl::Time start;             // when the temp file was created
};

// Checks the first rec.file_bytes() of `image` as the file of `key` named by
// `rec`: the header checksum, the record's header_xxh3, job/rank/layer/step,
// and every tensor's checksum. DATA_LOSS naming what does not match.
absl::StatusOr<DecodedHeader> CheckImage(const VersionKey& key, const store::VersionRecord& rec,
                                         const ByteImage& image);
// CheckImage without the tensors' checksums, for a caller that verifies each
// tensor as it copies it out (HashImageThrough).
absl::StatusOr<DecodedHeader> CheckImageHeader(const VersionKey& key,
                                               const store::VersionRecord& rec,
                                               const ByteImage& image);

// A committed version read back and verified.
struct LoadedVersion {
  DecodedHeader decoded;
  StagingLease lease;
};

// What start-up reconciliation did. Layer files are never deleted there: a
// file the index does not name may be an acknowledged version whose record a
// damaged index lost, so it is moved to <data_dir>/quarantine/ instead (and
// `ckptctl repair` puts it back, repair.h).
struct ReconcileReport {
  uint64_t temp_files_removed = 0;            // tmp.* (never acknowledged)
  uint64_t orphan_files_quarantined = 0;      // layer files without a record
  uint64_t dangling_records_removed = 0;      // records without a (whole) file
  uint64_t uncommitted_versions_removed = 0;  // records after the last event
  // Files moved to quarantine/: the orphans and the files of the versions
  // after the last event.
  uint64_t files_quarantined = 0;
};

class LayerStore {
 public:
  LayerStore(std::string data_dir, FileSystem* fs, Index* index, bool use_direct_io);
  LayerStore(const LayerStore&) = delete;
  LayerStore& operator=(const LayerStore&) = delete;

  // Creates <data_dir>/jobs when missing and fsyncs <data_dir>, so the
  // entries of jobs/ and of the index directory (opened before) are durable.
  absl::Status Init();

  // Free bytes on, and the size of, the file system of the data directory.
  absl::StatusOr<uint64_t> FreeBytes();
  absl::StatusOr<uint64_t> TotalBytes();

  // The commit protocol above. On success returns the record now in the index.
  absl::StatusOr<store::VersionRecord> Commit(StagedVersion* v, IoBackend* io,
                                              CommitTimings* timings = nullptr);
  // Its first half: the temp file created and allocated, the payload written
  // with its checksums computed meanwhile, then the header. On failure the
  // temp file is removed.
  absl::StatusOr<WrittenVersion> Write(StagedVersion* v, IoBackend* io);
  // Its second half, for a group: every version's fdatasync (at once, up to
  // kSyncThreads), then each version's rename (in the group's order), then
  // one fsync of each rank directory the group renamed into, then one
  // synchronous index batch with every record. A writer's fdatasync used to
  // end its Write, where it left the disk idle for that writer while the
  // disk flushed: on a disk whose flushes are slow, ckpt_bench's writers
  // spent a quarter of their time there (docs/throughput.md).
  // Returns one result per version, in the group's order, and fills in each
  // version's timings. A version that fails leaves nothing visible: its temp
  // file, or its file under the final name when the directory fsync or the
  // index write failed, is removed.
  std::vector<absl::StatusOr<store::VersionRecord>> Publish(std::vector<WrittenVersion>* group);
  static constexpr size_t kSyncThreads = 8;

  // Reads the file of `rec`, checks it belongs to `key` and `rec`, verifies
  // every tensor checksum. DATA_LOSS on any mismatch or short file; the lease
  // comes from `pool` (waiting until `deadline`).
  absl::StatusOr<LoadedVersion> Read(const VersionKey& key, const store::VersionRecord& rec,
                                     IoBackend* io, StagingPool* pool, absl::Time deadline);
  // The bytes of `rec`'s file, unchecked, into `lease` (at least
  // rec.file_bytes() long; the caller took it from the pool): Read() without
  // CheckImage, for a caller that checks them elsewhere. DATA_LOSS when the
  // file is missing or its size is not the record's.
  absl::Status ReadUnchecked(const VersionKey& key, const store::VersionRecord& rec, IoBackend* io,
                             const StagingLease& lease);
  // The read of `rec`'s file into `lease`, prepared for a caller that
  // drives it itself (a restore copies out the previous version while it is
  // in flight): the file opened (O_DIRECT when the store writes so) once its
  // size is the record's and `lease` can hold it, and the segments to
  // submit: io->Submit(IoDirection::kRead, read.fd.get(), read.segments),
  // then io->Wait(). DATA_LOSS when the file is missing or of the wrong
  // size; INVALID_ARGUMENT for a short lease.
  absl::StatusOr<VersionRead> PrepareRead(const VersionKey& key, const store::VersionRecord& rec,
                                          const StagingLease& lease);

  // The committed file of `rec`, opened for reading (buffered) after
  // checking its size: what the remote tier uploads. DATA_LOSS when it is
  // missing or of the wrong size.
  absl::StatusOr<UniqueFd> OpenCommitted(const VersionKey& key, const store::VersionRecord& rec);

  // Commits a version whose whole file image comes from elsewhere (the
  // remote tier, on a replacement node): `fill` writes rec.file_bytes()
  // bytes into the temp file and returns how many it wrote; the file is
  // synced, then checked like Read checks it (header checksum, the record's
  // header_xxh3, job/rank/layer/step, every tensor checksum) before it is
  // renamed and its record put. DATA_LOSS when the bytes are not the version
  // `rec` names (nothing is then visible).
  absl::Status Adopt(const VersionKey& key, const store::VersionRecord& rec,
                     const std::function<absl::StatusOr<uint64_t>(int fd)>& fill);

  // Puts an intact copy of a committed version (`rec`, whose file was found
  // damaged or missing) in place: `fill` writes the copy into a temp file,
  // checked as Adopt checks it; only then is the damaged file moved to
  // quarantine/ (logged with `why`) and the copy renamed into its place. The
  // record stays as it is. DATA_LOSS when the copy is not that version, and
  // nothing is changed then.
  absl::Status Replace(const VersionKey& key, const store::VersionRecord& rec,
                       const std::function<absl::StatusOr<uint64_t>(int fd)>& fill,
                       const std::string& why);

  // Cheap check: the file of `rec` exists with the recorded size (DATA_LOSS
  // otherwise). Read() is the deep check.
  absl::Status CheckFile(const VersionKey& key, const store::VersionRecord& rec);

  // Removes a committed version: index record first (sync), then the file,
  // then fsync of the directory.
  absl::Status Remove(const VersionKey& key, const store::VersionRecord& rec);
  // Takes a committed version found damaged out of the history: its record
  // replaced by a LostVersion (sync; Index::MarkLost), then its file, when
  // there is one, moved to <data_dir>/quarantine/ (logged with `why`; never
  // deleted).
  absl::Status QuarantineVersion(const VersionKey& key, const store::VersionRecord& rec,
                                 const std::string& why);
  // Forgets the rank's lost versions (Index::MarkLost) of step >= `from`.
  absl::Status ForgetLost(const std::string& job, uint32_t rank, uint64_t from);

  // How start-up checks the files of the versions the index records.
  enum class ReconcileCheck {
    // After a crash: each recorded file's size (one statx per version).
    kSizes,
    // After a clean stop (Index::CleanStop), when every commit had
    // finished and was synced: each recorded file's name in its directory's
    // listing, no per-version system call. A file that is missing is still
    // found; one whose size changed, or a symbolic link put in its place,
    // is found when it is read (the size and every checksum are checked
    // then, and a link is never followed).
    kNames,
  };
  // Start-up recovery: removes temp files and records whose file is missing
  // or of the wrong size (logged as a bug alarm); removes the records of
  // versions newer than their rank's last event and moves their files, and
  // every layer file no record names, to <data_dir>/quarantine/ (each logged
  // with its path). Layer files are never deleted here.
  // FAILED_PRECONDITION naming the path when the data directory holds a
  // symbolic link where ckptd opens a directory or (kSizes) a recorded file;
  // every such entry is named in the one error (the ranks without one are
  // reconciled all the same), so one start-up shows them all.
  absl::StatusOr<ReconcileReport> Reconcile(ReconcileCheck check = ReconcileCheck::kSizes);

  static std::string FileName(const VersionKey& key, uint64_t generation);
  // Opens (creating when missing) the side file `name` of the rank's
  // directory for appending, such as the drift trace, through the
  // FileSystem: never through a symbolic link (FAILED_PRECONDITION naming
  // the path) and never outside the rank directory.
  absl::StatusOr<UniqueFd> OpenSideFile(const std::string& job, uint32_t rank,
                                        const std::string& name);
  // Appends `data` to a side file from OpenSideFile.
  absl::Status AppendSideFile(int fd, absl::string_view data);
  // After a rank's versions were removed (job deletion): unlinks its side
  // files `side_files` and removes the rank's directory and, once empty, the
  // job's. A directory still holding anything else stays (logged, not an
  // error): ckptd never deletes a file it does not know.
  absl::Status RemoveRankDir(const std::string& job, uint32_t rank,
                             const std::vector<std::string>& side_files);
  // Path of the rank's directory (for messages).
  std::string RankDirPath(const std::string& job, uint32_t rank) const;
  // ckptd keeps an open descriptor of each rank directory it writes to, at
  // most kMaxOpenRankDirs of them. The engine lets a rank's go when its
  // registration ends (a later use opens it again), so what is kept follows
  // the ranks registered, not every rank the node has ever served.
  static constexpr size_t kMaxOpenRankDirs = 1024;
  void ForgetRankDir(const std::string& job, uint32_t rank) ABSL_LOCKS_EXCLUDED(mu_);
  size_t open_rank_dirs() const ABSL_LOCKS_EXCLUDED(mu_);
  // Name of the quarantine directory under the data directory.
  static constexpr char kQuarantineDir[] = "quarantine";
  bool direct_io() const { return use_direct_io_; }

 private:
  // A kept descriptor of a rank directory; it stays open while referenced.
  using DirRef = std::shared_ptr<const UniqueFd>;
  absl::StatusOr<DirRef> RankDir(const std::string& job, uint32_t rank, bool create)
      ABSL_LOCKS_EXCLUDED(dir_mu_, mu_);
  // Closes and removes the temp file `tmp_name` of a version that failed.
  void DropTemp(int dir, UniqueFd* fd, const std::string& tmp_name);
  // Publish's first step: each version's fdatasync, kSyncThreads at once;
  // one status per version, and every version's sync_seconds set.
  std::vector<absl::Status> SyncData(std::vector<WrittenVersion>* group);
  // Adopt's and Replace's first half: `fill` into the new temp file
  // `tmp_name`, synced, closed and checked as the version `rec` names;
  // removed again on failure.
  absl::Status FillChecked(int dir, const VersionKey& key, const store::VersionRecord& rec,
                           const std::function<absl::StatusOr<uint64_t>(int fd)>& fill,
                           const std::string& tmp_name);
  absl::Status ReconcileRank(const std::string& job, uint32_t rank, int dir_fd,
                             ReconcileCheck check, ReconcileReport* report);
  // Reconcile's one error for every problem it met (the first ones listed,
  // each logged): FAILED_PRECONDITION when any needs an operator.
  absl::Status AllProblems(const std::vector<absl::Status>& problems);
  // Moves `name` of the rank directory `dir` to quarantine/<job>/rank-<rank>/
  // (a free name: `name`, else `name`.1, .2, ...), then fsyncs both
  // directories. `why` goes into the log line.
  absl::Status Quarantine(const std::string& job, uint32_t rank, int dir, const std::string& name,
                          std::string_view why);

  const std::string data_dir_;
  FileSystem* const fs_;
  Index* const index_;
  const bool use_direct_io_;
  UniqueFd data_dir_fd_;
  UniqueFd jobs_dir_;

  // Lock order: dir_mu_ -> mu_. dir_mu_ serialises opening (and creating)
  // rank directories with removing them; mu_ guards the kept descriptors.
  absl::Mutex dir_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  mutable absl::Mutex mu_;
  std::map<std::pair<std::string, uint32_t>, DirRef> rank_dirs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ckpt
