// FaultFileSystem and FaultIoBackend: fault-injecting twins of the file
// layer (daemon/io/file_system.h, daemon/io/io_backend.h) for the store's
// crash and fault tests (docs/reliability.md; modelled on
// RocksDB's FaultInjectionTestFS and LevelDB's fault_injection_test.cc).
//
// Both wrap the real implementations: every operation reaches the real file
// system, and a side record keeps what a power loss could take back:
//   - per file: the synced length and the extents written since the last
//     successful DataSync (with the old bytes where a write overwrote synced
//     data);
//   - per directory: the entry operations (create, mkdir, rename, unlink,
//     rmdir) since the last successful SyncDir, in global order. An unlinked
//     file is kept alive through a hard link in the graveyard directory until
//     the unlink is durable, so the unlink can be undone.
//
// Power loss: CrashAfter(n) makes the n-th mutating operation from now the
// crash point. That operation does not happen (a write is torn instead: a
// random sector-aligned subset or prefix of its 4096-byte sectors reaches the
// file), and the twins are frozen: every later call fails with EIO and
// changes nothing, as if the process had died. After the caller has closed
// everything that uses the directory tree (LayerStore, Index), MakeCrashImage
// rewrites the tree in place into what the disk could hold after the power
// loss: unsynced file data dropped (all, none, or a random subset of sectors,
// zeros where nothing older existed), unsynced directory operations forgotten
// (all, none, or all after a random point of each directory's log). The image
// then becomes the new durable state and the twins thaw.
//
// fsyncgate: after a failed DataSync the file's unsynced data is poisoned: a
// later DataSync of it returns OK (as Linux does) without making it durable,
// every crash image drops it, and sync_retries_after_failure() counts the
// retry, which the commit protocol must never do.
//
// Error injection: FailNth / FailOneIn fail calls of one class with an errno
// (EIO, ENOSPC, ...); a failed write may first write a sector-aligned prefix
// (a short write), a failed read may instead corrupt the buffer or truncate
// the transfer (SetReadFault).
//
// Everything random comes from one generator seeded at construction, so a run
// is reproduced by its seed. Not modelled: RocksDB's own files (the index
// opens its directory through RocksDB's Env, not this seam; its writes are
// all sync=true), and reordering below the file system (rows 4 and 5).
//
// Thread-safety: thread-safe (one mutex; calls into the real file system run
// under it, so concurrent callers are serialized).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "daemon/io/file_system.h"
#include "daemon/io/io_backend.h"

namespace ckpt {
namespace testing {

inline constexpr uint64_t kSectorBytes = 4096;

// Operation classes faults are injected by.
enum class FaultClass : int {
  kWrite = 0,  // IoBackend::WriteAll, per segment
  kSync,       // DataSync (fdatasync)
  kDirSync,    // SyncDir (fsync of a directory)
  kRename,     // RenameNoReplace
  kRead,       // IoBackend::ReadAll
  kAllocate,   // Allocate (fallocate)
  kCreate,     // CreateExclusive, and mkdir in MakeDirs / OpenSubdir
  kUnlink,     // Unlink, RemoveDir
  kNumClasses,
};
const char* FaultClassName(FaultClass c);

// What a failing ReadAll does.
enum class ReadFault {
  kError,      // fails with the rule's errno, nothing read
  kCorrupt,    // reads, then flips 1-3 random bits of the buffer; returns OK
  kTruncated,  // transfers a random prefix only; half the time it returns
               // DATA_LOSS (file ends early), half the time OK with the rest
               // of the buffer zeroed (a lying short read)
  kMixed,      // one of the three above, in equal shares
};

// How a write at the crash point is torn.
enum class TearMode {
  kRandomSubset,  // each 4096-byte sector reaches the file with odds 1/2
  kPrefix,        // a random number of leading sectors (possibly none)
  kMixed,         // either, in equal shares
};

// What a crash image keeps of the unsynced state.
struct CrashPolicy {
  enum class Data { kDropAll, kKeepAll, kRandom };
  enum class Dirs { kForgetAll, kKeepAll, kRandomPrefix };
  Data data = Data::kDropAll;
  Dirs dirs = Dirs::kForgetAll;
};
const char* CrashDataName(CrashPolicy::Data d);
const char* CrashDirsName(CrashPolicy::Dirs d);

// A write torn at the crash point.
struct TornWrite {
  std::string path;  // the file's path when the write was torn
  uint64_t offset = 0;
  uint64_t len = 0;
  uint64_t sectors_total = 0;
  uint64_t sectors_written = 0;
};

struct CrashReport {
  uint64_t files_reverted = 0;     // files whose unsynced data was (partly) dropped
  uint64_t sectors_dropped = 0;    // unsynced sectors a crash image took back
  uint64_t sectors_kept = 0;       // unsynced sectors a crash image kept
  uint64_t dir_ops_forgotten = 0;  // unsynced directory operations undone
  uint64_t dir_ops_kept = 0;       // unsynced directory operations kept
  std::vector<TornWrite> torn;     // writes torn at the crash point
};

class FaultIoBackend;

class FaultFileSystem : public FileSystem {
 public:
  // `base` (not owned) does the real work. `graveyard_dir` must exist on the
  // same file system as the files (hard links go there) and outside any
  // directory the code under test lists.
  FaultFileSystem(FileSystem* base, std::string graveyard_dir, uint64_t seed);
  ~FaultFileSystem() override;
  FaultFileSystem(const FaultFileSystem&) = delete;
  FaultFileSystem& operator=(const FaultFileSystem&) = delete;

  // ---- error injection ----
  // Fails the n-th call of class `c` from now (1 = the next one) with `err`.
  void FailNth(FaultClass c, uint64_t n, int err = EIO);
  // Fails each call of class `c` with odds 1/k (k = 0 turns it off).
  void FailOneIn(FaultClass c, uint64_t k, int err = EIO);
  // With `on`, a failing write first writes a random sector-aligned prefix.
  void SetShortWrites(bool on);
  void SetReadFault(ReadFault kind);
  // Removes every rule (counters stay).
  void ClearFaults();
  uint64_t injected(FaultClass c) const;
  // Per kind of read fault actually applied: error, corrupt, truncated.
  uint64_t read_faults(ReadFault kind) const;

  // ---- power loss ----
  // The n-th mutating call from now (1 = the next) is the crash point.
  // Mutating: create, mkdir, allocate, each write segment, DataSync, rename,
  // SyncDir, unlink, rmdir. With `only` set, only calls of that class count
  // (CrashAfter(1, kPrefix, FaultClass::kSync): the power goes just before
  // the next fdatasync).
  void CrashAfter(uint64_t n, TearMode tear = TearMode::kMixed,
                  FaultClass only = FaultClass::kNumClasses);
  // Freezes now (a crash between two calls).
  void FreezeNow();
  bool frozen() const;
  // Mutating calls seen so far (for sizing crash points).
  uint64_t mutating_ops() const;
  // REQUIRES: nothing holds files or directories of the tree open for
  // writing (close LayerStore and Index first). Rewrites the tree into a
  // post-power-loss image per `policy`, makes it the durable state and thaws.
  // Works frozen or not (not frozen: a crash at a quiet moment).
  absl::StatusOr<CrashReport> MakeCrashImage(const CrashPolicy& policy);
  // Declares everything on disk durable now (forgets the side record).
  void ForgetUnsynced();
  // Unsynced directory operations and files with unsynced data right now.
  uint64_t unsynced_dir_ops() const;
  uint64_t unsynced_files() const;
  // DataSync calls on a file whose earlier DataSync failed (must stay 0).
  uint64_t sync_retries_after_failure() const;

  // A generator for the caller's own choices, seeded from the same seed.
  std::mt19937_64& rng() { return caller_rng_; }

  // ---- FileSystem ----
  absl::StatusOr<UniqueFd> MakeDirs(const std::string& path) override;
  absl::StatusOr<UniqueFd> OpenSubdir(int dir_fd, const std::string& name, bool create) override;
  absl::StatusOr<UniqueFd> CreateExclusive(int dir_fd, const std::string& name, bool direct,
                                           bool* direct_used) override;
  absl::StatusOr<UniqueFd> OpenForRead(int dir_fd, const std::string& name, bool direct,
                                       bool* direct_used) override;
  absl::Status Allocate(int fd, uint64_t len) override;
  absl::Status DataSync(int fd) override;
  absl::Status RenameNoReplace(int dir_fd, const std::string& from, const std::string& to) override;
  absl::Status MoveNoReplace(int from_dir, const std::string& from, int to_dir,
                             const std::string& to) override;
  absl::Status SyncDir(int dir_fd) override;
  absl::Status Unlink(int dir_fd, const std::string& name) override;
  absl::Status RemoveDir(int dir_fd, const std::string& name) override;
  absl::StatusOr<std::vector<std::string>> List(int dir_fd, std::vector<bool>* is_dir) override;
  absl::StatusOr<uint64_t> FileSize(int fd) override;
  absl::StatusOr<uint64_t> FileSizeAt(int dir_fd, const std::string& name) override;
  absl::StatusOr<uint64_t> FreeBytes(int fd) override;
  absl::StatusOr<uint64_t> TotalBytes(int fd) override;
  // From now on FreeBytes and TotalBytes report these (a full or a small
  // disk without filling one); nullopt goes back to the real figures.
  void SetFreeBytes(std::optional<uint64_t> free_bytes) ABSL_LOCKS_EXCLUDED(mu_);
  void SetTotalBytes(std::optional<uint64_t> total_bytes) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  friend class FaultIoBackend;
  using Key = std::pair<dev_t, ino_t>;

  struct Extent {
    uint64_t offset;
    uint64_t len;
  };
  struct FileState {
    std::string path;          // current location (a graveyard link once unlinked)
    uint64_t synced_size = 0;  // durable size
    std::vector<Extent> unsynced;
    std::map<uint64_t, std::string> old_bytes;  // sector offset -> durable bytes overwritten
    bool size_changed = false;                  // allocate/extend since the last sync
    bool poisoned = false;                      // a DataSync failed: unsynced data is lost
  };
  enum class DirOpKind { kCreate, kMkdir, kRename, kMove, kUnlink, kRmdir };
  struct DirOp {
    Key dir;
    DirOpKind kind;
    std::string name;   // created/removed name; rename: from
    std::string name2;  // rename: to; move: the destination's path
    std::string grave;  // unlink: graveyard path holding the file
  };
  struct Rule {
    uint64_t nth = 0;     // countdown; 0 = off
    uint64_t one_in = 0;  // 0 = off
    int nth_err = 0;
    int odds_err = 0;
  };

  // Frozen -> EIO; the crash point -> freezes and returns EIO (*crashed set);
  // an injected fault -> its errno status. Counts a mutating call.
  absl::Status Gate(FaultClass c, bool mutating, const char* what, bool* crashed = nullptr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status FrozenError(const char* what) const;
  absl::StatusOr<Key> KeyOfFd(int fd) const;
  absl::StatusOr<Key> KeyOfDirFd(int dir_fd) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  FileState* FileFor(int fd) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RecordWrite(int fd, uint64_t offset, uint64_t len) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes a random sector subset/prefix of `s` (the torn write at the crash
  // point, or a short write before an injected error).
  uint64_t WritePartial(int fd, const IoSegment& s, bool prefix, TornWrite* torn)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RevertData(const CrashPolicy& policy, CrashReport* report)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UndoDirOps(const CrashPolicy& policy, CrashReport* report)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ResetLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string NewGravePath() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool Odds(uint64_t k) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  FileSystem* const base_;
  const std::string graveyard_;

  mutable absl::Mutex mu_;
  std::mt19937_64 rng_ ABSL_GUARDED_BY(mu_);
  std::mt19937_64 caller_rng_;  // the caller's; not shared
  Rule rules_[static_cast<int>(FaultClass::kNumClasses)] ABSL_GUARDED_BY(mu_);
  uint64_t injected_[static_cast<int>(FaultClass::kNumClasses)] ABSL_GUARDED_BY(mu_) = {};
  uint64_t read_faults_[3] ABSL_GUARDED_BY(mu_) = {};
  bool short_writes_ ABSL_GUARDED_BY(mu_) = false;
  ReadFault read_fault_ ABSL_GUARDED_BY(mu_) = ReadFault::kError;
  bool frozen_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<uint64_t> free_bytes_ ABSL_GUARDED_BY(mu_);
  std::optional<uint64_t> total_bytes_ ABSL_GUARDED_BY(mu_);
  uint64_t crash_countdown_ ABSL_GUARDED_BY(mu_) = 0;  // 0 = no crash armed
  TearMode tear_ ABSL_GUARDED_BY(mu_) = TearMode::kMixed;
  FaultClass crash_class_ ABSL_GUARDED_BY(mu_) = FaultClass::kNumClasses;  // any
  uint64_t mutating_ops_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t sync_retries_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t grave_seq_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<Key, FileState> files_ ABSL_GUARDED_BY(mu_);
  std::map<Key, std::string> dirs_ ABSL_GUARDED_BY(mu_);  // directory -> path
  std::vector<DirOp> dir_ops_ ABSL_GUARDED_BY(mu_);       // unsynced, in order
  std::vector<TornWrite> torn_ ABSL_GUARDED_BY(mu_);
};

// The IoBackend twin: passes each segment to `base` on its own (so a fault
// or the crash point hits one segment), records what was written with `fs`,
// and injects write and read faults from `fs`'s rules.
class FaultIoBackend final : public IoBackend {
 public:
  FaultIoBackend(FaultFileSystem* fs, std::unique_ptr<IoBackend> base);
  const char* Name() const override { return name_.c_str(); }
  // As its base says, so that a restore over it takes the base's path;
  // Submit only takes note, and the transfer (with its faults) runs in Wait.
  bool Overlaps() const override { return base_->Overlaps(); }
  void Submit(IoDirection direction, int fd, absl::Span<const IoSegment> segments) override;
  absl::Status Wait() override;

 private:
  absl::Status Write(int fd, absl::Span<const IoSegment> segments);
  absl::Status Read(int fd, absl::Span<const IoSegment> segments);

  FaultFileSystem* const fs_;
  const std::unique_ptr<IoBackend> base_;
  const std::string name_;
  // The transfer between Submit and Wait.
  IoDirection direction_ = IoDirection::kRead;
  int fd_ = -1;
  std::vector<IoSegment> segments_;
};

}  // namespace testing
}  // namespace ckpt
