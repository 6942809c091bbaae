// ReplicaStore: what a ckptd keeps for its peers (docs/peer.md).
//
// A peer's ckptd replicates each durable layer version and manifest here
// through the replica service (replica_server.h). The objects are keyed by
// the remote layout (remote_layout.h) and signed with the cluster key by
// their writer, so one namespace serves every authenticated peer: a
// replacement node reads the objects the node it replaces wrote. Only
// keys of that layout are kept (jobs/<job>/owner and jobs/<job>/rank-*/).
//
// Every replica is charged to the uid that owns its job (ReplicaCharges:
// the engine's per-uid disk quota, so replicas kept for a user's job count
// like that user's own checkpoints on this node): the job's owner record,
// which the job's first copy brings and which must carry the cluster key's
// MAC (remote_key_file), names the uid. A replica of a job with no owner
// record here is refused (FAILED_PRECONDITION), one past its owner's quota
// too (RESOURCE_EXHAUSTED); after a restart the owner records found on
// disk charge every replica again.
//
// Every object is written to the replica directory (a PosixStore: temp
// file, fsync, rename) before Receive returns, so an acknowledged replica
// survives this ckptd's crash or restart and is never torn; the newest
// replicas are also kept in memory (ReplicaMemory, peer_memory_bytes: a
// new one takes the place of the oldest there), and reads are served from
// there (a restore from a peer reads no disk). Every object is charged
// to the peer that wrote it; a peer past its share (max_bytes_per_peer) or
// the store past its whole bound (max_bytes), or a replica that would leave
// less than min_free_disk_bytes free on the file system, is refused with
// RESOURCE_EXHAUSTED, so one peer's flood leaves room for the others and
// for this node's own checkpoints. After a restart the objects found on
// disk are charged to no peer until rewritten (to their owners, above),
// and the temp files of receipts a crash cut short are removed.
//
// Thread-safety: thread-safe; under mu_ only ReplicaCharges is called (a
// leaf of its own). Disk I/O runs outside it.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "base/unique_fd.h"
#include "daemon/peer/replica_memory.h"
#include "daemon/remote/posix_store.h"
#include "daemon/remote/remote_auth.h"

namespace ckpt::peer {

// What replicas cost the uids that own their jobs on this node (ckptd:
// the engine's QuotaTable). Thread-safe; never calls back into the store.
class ReplicaCharges {
 public:
  virtual ~ReplicaCharges() = default;
  // RESOURCE_EXHAUSTED when `bytes` more would pass `uid`'s quota here,
  // counting `replaced` bytes (of the replica this one replaces, released
  // once it is stored) as free.
  virtual absl::Status Reserve(uid_t uid, uint64_t bytes, uint64_t replaced) = 0;
  virtual void Release(uid_t uid, uint64_t bytes) = 0;
  // What start-up found (no bound applies).
  virtual void Seed(uid_t uid, uint64_t bytes) = 0;
};

struct ReplicaStoreOptions {
  std::string dir;                            // the replica directory (created 0700)
  uint64_t memory_bytes = uint64_t{1} << 30;  // replicas held in memory
  bool populate_memory = true;                // populate memory_bytes at start (ReplicaMemory)
  size_t memory_piece_bytes = ReplicaMemory::kDefaultPieceBytes;  // a multiple of 4 KiB
  uint64_t max_bytes = uint64_t{64} << 30;                        // memory and disk together
  uint64_t max_bytes_per_peer = uint64_t{32} << 30;
  uint64_t max_object_bytes = uint64_t{16} << 30;  // one object
  // Free space on the replica directory's file system that replicas never
  // take: this node's own checkpoints need it.
  uint64_t min_free_disk_bytes = 64 << 20;
  // The cluster key owner records are checked with; REQUIRED, not owned.
  const remote::RemoteKey* key = nullptr;
  // Where replicas are charged; null: nowhere (the shares above still
  // bound them). Not owned.
  ReplicaCharges* charges = nullptr;
};

// What Totals reports.
struct ReplicaTotals {
  uint64_t memory_bytes = 0;  // of disk_bytes, also in memory
  uint64_t disk_bytes = 0;    // every replica
  uint64_t objects = 0;
};

class ReplicaStore {
 public:
  // Opens (creating) the replica directory and lists what an earlier run
  // left on disk.
  static absl::StatusOr<std::unique_ptr<ReplicaStore>> Open(ReplicaStoreOptions options);

  // Where Receive's bytes come from: each call sets `piece` to the next
  // bytes and returns true, or returns false at the end; an error stops the
  // receipt and nothing is stored.
  using Source = std::function<absl::StatusOr<bool>(std::string_view* piece)>;
  // Stores the `size` bytes `next` yields as `key` for `peer`. The room is
  // taken before the first piece is asked for, so concurrent receipts
  // cannot announce more than the bounds allow between them:
  // RESOURCE_EXHAUSTED with what is full, INVALID_ARGUMENT past
  // max_object_bytes or when `next` yields more or fewer bytes than `size`,
  // ALREADY_EXISTS with `if_absent` when `key` exists, ABORTED while another
  // call receives `key` (one writer's bytes in memory and on disk). The bytes go straight
  // into the object's temp file (O_DIRECT where the file system allows it:
  // replicas are written once and read back only on a restore), through
  // the memory pieces that keep it when the memory budget has room for it
  // (the oldest replicas in memory leave it to make room).
  absl::Status Receive(const std::string& peer, const std::string& key, uint64_t size,
                       bool if_absent, const Source& next) ABSL_LOCKS_EXCLUDED(mu_);
  // Receive of bytes at hand.
  absl::Status Put(const std::string& peer, const std::string& key, std::string_view data,
                   bool if_absent) ABSL_LOCKS_EXCLUDED(mu_);
  // Hands `sink` the object's size and its bytes in pieces of at most
  // `piece_bytes` (one empty piece for an empty object), from memory or
  // from its file: a read holds one piece of memory, whatever the object's
  // size. NOT_FOUND, INVALID_ARGUMENT past `max_bytes`; a sink's error
  // stops the read and is returned.
  using Sink = std::function<absl::Status(uint64_t size, std::string_view piece)>;
  absl::Status Read(const std::string& key, uint64_t max_bytes, size_t piece_bytes,
                    const Sink& sink);
  // Read into one string.
  absl::StatusOr<std::string> Get(const std::string& key, uint64_t max_bytes);
  absl::StatusOr<std::vector<remote::ObjectInfo>> List(const std::string& prefix);
  // At most `max` objects of List(prefix) whose keys come after
  // `start_after` ("" = from the first); *more says whether others follow.
  std::vector<remote::ObjectInfo> ListPage(const std::string& prefix,
                                           const std::string& start_after, size_t max, bool* more)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Delete(const std::string& key);

  ReplicaTotals Totals();
  // Whether `key` is held in memory as well.
  bool InMemory(const std::string& key) ABSL_LOCKS_EXCLUDED(mu_);
  // The bytes charged to `peer`.
  uint64_t PeerBytes(const std::string& peer);

 private:
  using Memory = std::shared_ptr<ReplicaMemory::Span>;
  struct Entry {
    std::string peer;  // who wrote it ("" when found on disk at start)
    uid_t owner = 0;   // whose job it belongs to (charged when `charged`)
    bool charged = false;
    uint64_t size = 0;
    Memory data;          // its bytes, when also in memory
    uint64_t stored = 0;  // when it was stored (a sequence), for leaving memory
  };
  ReplicaStore(ReplicaStoreOptions options, std::unique_ptr<remote::PosixStore> disk,
               std::unique_ptr<ReplicaMemory> memory)
      : options_(std::move(options)), disk_(std::move(disk)), memory_(std::move(memory)) {}
  // Receive's steps: room taken (and memory pieces, returned, when the
  // budget has them), the file written, the entry recorded (`data` kept in
  // memory when the write went well).
  // What Reserve took: memory (when the budget had it) and the owner
  // charged for the bytes.
  struct Reservation {
    Memory memory;
    std::optional<uid_t> owner;         // set when charged
    std::optional<uid_t> record_owner;  // an owner record's uid, once checked
  };
  absl::StatusOr<Reservation> Reserve(const std::string& peer, const std::string& key,
                                      uint64_t size, bool if_absent) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Record(const std::string& peer, const std::string& key, uint64_t size,
                      bool if_absent, const absl::Status& written, Reservation taken)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The uid an owner record names, checked with the cluster key.
  absl::StatusOr<uid_t> OwnerOfRecord(const std::string& key, const std::string& bytes) const;
  // The job of a key of the remote layout; INVALID_ARGUMENT for another key.
  static absl::StatusOr<std::string> JobOfKey(const std::string& key, bool* owner_record);
  // Pieces for `size` bytes, taking the oldest replicas out of memory
  // while the pool lacks them; null when even that leaves too few (reads
  // in flight hold the pieces they read).
  Memory TakeMemoryLocked(uint64_t size) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ForgetMemoryLocked(Entry* e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status RoomLocked(const std::string& peer, const std::string& key, uint64_t size) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The disk bytes of `e`, and its peer's (its memory: Record and
  // ForgetMemoryLocked).
  void ChargeLocked(const Entry& e, int sign) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ReplicaStoreOptions options_;
  const std::unique_ptr<remote::PosixStore> disk_;
  const std::unique_ptr<ReplicaMemory> memory_;

  absl::Mutex mu_;
  // Room taken by Puts writing their files now (outside mu_): counted
  // against the bounds like stored bytes.
  uint64_t reserved_ ABSL_GUARDED_BY(mu_) = 0;
  std::set<std::string> receiving_ ABSL_GUARDED_BY(mu_);  // keys of those Puts
  std::map<std::string, uint64_t> peer_reserved_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Entry> objects_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, uid_t> owners_ ABSL_GUARDED_BY(mu_);        // job -> uid (owner records)
  std::map<uint64_t, std::string> in_memory_ ABSL_GUARDED_BY(mu_);  // stored -> key, oldest first
  uint64_t stored_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, uint64_t> peer_bytes_ ABSL_GUARDED_BY(mu_);
  uint64_t memory_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t disk_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace ckpt::peer
