// ReplicaStore: replicas in memory within a budget, on disk past it.
#include "daemon/peer/replica_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/logging.h"
#include "base/status.h"
#include "daemon/common/kill_point.h"
#include "daemon/remote/remote_layout.h"

namespace ckpt::peer {
namespace {

// Owner records are a few dozen bytes; bounded on their own.
constexpr uint64_t kMaxOwnerRecordBytes = 64 << 10;

std::string Bytes(uint64_t n) { return absl::StrFormat("%.1f MiB", n / 1048576.0); }

// Writes a replica's file from offset 0 in whole blocks of up to a memory
// piece, each from a 4 KiB-aligned buffer the caller fills (a memory piece
// of the replica, or a buffer of its own), so a file opened O_DIRECT gets
// aligned blocks: the last one padded, then the file cut to the replica's
// length. (Writing one block while the next arrived, through io_uring,
// measured no faster: docs/peer.md.)
class FileWriter {
 public:
  static constexpr size_t kAlign = 4096;
  explicit FileWriter(int fd) : fd_(fd), direct_((fcntl(fd, F_GETFL) & O_DIRECT) != 0) {}

  // Writes `n` bytes of `block`, the replica's next ones. Unless `last`,
  // n is a multiple of kAlign. With `last`, `block` has room for n rounded
  // up to kAlign (the padding is zeroed there).
  absl::Status Write(char* block, size_t n, bool last) {
    size_t len = n;
    if (last && direct_) {
      len = (n + kAlign - 1) / kAlign * kAlign;
      std::memset(block + n, 0, len - n);
    }
    size_t done = 0;
    while (done < len) {
      ssize_t w = pwrite(fd_, block + done, len - done, static_cast<off_t>(written_ + done));
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) return ErrnoStatus(errno, "write a replica");
      done += static_cast<size_t>(w);
    }
    written_ += n;
    if (last && direct_ && len != n && ftruncate(fd_, static_cast<off_t>(written_)) != 0) {
      return ErrnoStatus(errno, "cut a replica to its size");
    }
    return absl::OkStatus();
  }

 private:
  const int fd_;
  const bool direct_;
  uint64_t written_ = 0;
};

struct Free {
  void operator()(char* p) const { std::free(p); }
};

}  // namespace

absl::StatusOr<std::unique_ptr<ReplicaStore>> ReplicaStore::Open(ReplicaStoreOptions options) {
  if (::mkdir(options.dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return ErrnoStatus(errno, absl::StrCat("mkdir ", options.dir));
  }
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<remote::PosixStore> disk,
                        remote::PosixStore::Open(options.dir));
  CKPT_RETURN_IF_ERROR(disk->RemoveTempFiles());
  CKPT_ASSIGN_OR_RETURN(std::vector<remote::ObjectInfo> found, disk->List(""));
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<ReplicaMemory> memory,
                        ReplicaMemory::Create(options.memory_bytes, options.memory_piece_bytes,
                                              options.populate_memory));
  if (options.key == nullptr) {
    return absl::InvalidArgumentError("the replica store needs the cluster key (remote_key_file)");
  }
  std::unique_ptr<ReplicaStore> store(
      new ReplicaStore(std::move(options), std::move(disk), std::move(memory)));
  // The owner records first: they say whom every other replica is charged to.
  std::map<std::string, uid_t> owners;
  for (const remote::ObjectInfo& o : found) {
    bool owner_record = false;
    absl::StatusOr<std::string> job = JobOfKey(o.key, &owner_record);
    if (!job.ok() || !owner_record) continue;
    absl::StatusOr<std::string> bytes = store->disk_->GetBytes(o.key, kMaxOwnerRecordBytes);
    absl::StatusOr<uid_t> uid =
        bytes.ok() ? store->OwnerOfRecord(o.key, *bytes) : absl::StatusOr<uid_t>(bytes.status());
    if (!uid.ok()) {
      CKPT_LOG(WARNING) << "replicas: " << o.key << " is not an owner record ckptd wrote ("
                        << uid.status() << "); the job's replicas are charged to no one";
      continue;
    }
    owners[*job] = *uid;
  }
  absl::MutexLock lock(&store->mu_);
  store->owners_ = owners;
  for (const remote::ObjectInfo& o : found) {
    Entry e;
    e.size = o.size;
    bool owner_record = false;
    absl::StatusOr<std::string> job = JobOfKey(o.key, &owner_record);
    if (auto it = job.ok() ? owners.find(*job) : owners.end(); it != owners.end()) {
      e.owner = it->second;
      e.charged = store->options_.charges != nullptr;
      if (e.charged) store->options_.charges->Seed(e.owner, e.size);
    }
    store->ChargeLocked(e, +1);
    store->objects_.emplace(o.key, std::move(e));
  }
  return store;
}

absl::StatusOr<std::string> ReplicaStore::JobOfKey(const std::string& key, bool* owner_record) {
  std::string job;
  uint32_t rank = 0;
  *owner_record = false;
  if (remote::ParseRankOfKey(key, &job, &rank)) return job;
  if (absl::StartsWith(key, remote::JobsPrefix()) && absl::EndsWith(key, "/owner")) {
    job = key.substr(remote::JobsPrefix().size(),
                     key.size() - remote::JobsPrefix().size() - std::string("/owner").size());
    if (!job.empty() && job.find('/') == std::string::npos && remote::OwnerKey(job) == key) {
      *owner_record = true;
      return job;
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat(key,
                   " is not a key ckptd replicates (jobs/<job>/owner or "
                   "jobs/<job>/rank-<rank>/...)"));
}

absl::StatusOr<uid_t> ReplicaStore::OwnerOfRecord(const std::string& key,
                                                  const std::string& bytes) const {
  CKPT_ASSIGN_OR_RETURN(store::RemoteJob rec, remote::DecodeOwner(bytes, *options_.key));
  if (remote::OwnerKey(rec.job_id()) != key) {
    return absl::DataLossError(
        absl::StrCat("the owner record at ", key, " names job ", rec.job_id()));
  }
  return static_cast<uid_t>(rec.owner_uid());
}

void ReplicaStore::ChargeLocked(const Entry& e, int sign) {
  const uint64_t n = e.size;
  disk_bytes_ = sign > 0 ? disk_bytes_ + n : disk_bytes_ - n;
  // The owner's charge was taken by Reserve (or Seed); it goes with the
  // entry.
  if (sign < 0 && e.charged) options_.charges->Release(e.owner, n);
  if (e.peer.empty()) return;
  uint64_t& mine = peer_bytes_[e.peer];
  mine = sign > 0 ? mine + n : mine - n;
  if (mine == 0) peer_bytes_.erase(e.peer);
}

absl::Status ReplicaStore::RoomLocked(const std::string& peer, const std::string& key,
                                      uint64_t size) const {
  if (size > options_.max_object_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("a replica of ", Bytes(size),
                                                   " is larger than max_object_bytes (",
                                                   Bytes(options_.max_object_bytes), ")"));
  }
  uint64_t old_total = 0, old_mine = 0;
  if (auto it = objects_.find(key); it != objects_.end()) {
    old_total = it->second.size;
    if (it->second.peer == peer) old_mine = it->second.size;
  }
  auto mine_it = peer_bytes_.find(peer);
  auto pending_it = peer_reserved_.find(peer);
  const uint64_t mine = (mine_it == peer_bytes_.end() ? 0 : mine_it->second) +
                        (pending_it == peer_reserved_.end() ? 0 : pending_it->second);
  if (mine - old_mine + size > options_.max_bytes_per_peer) {
    return absl::ResourceExhaustedError(
        absl::StrCat("peer ", peer, " holds ", Bytes(mine), " of replicas here; another ",
                     Bytes(size), " would pass its share (peer_max_bytes_per_peer ",
                     Bytes(options_.max_bytes_per_peer), ")"));
  }
  const uint64_t total = disk_bytes_ + reserved_;
  if (total - old_total + size > options_.max_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the replica store holds ", Bytes(total), "; another ", Bytes(size),
                     " would pass peer_max_replica_bytes (", Bytes(options_.max_bytes), ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<ReplicaStore::Reservation> ReplicaStore::Reserve(const std::string& peer,
                                                                const std::string& key,
                                                                uint64_t size, bool if_absent) {
  bool owner_record = false;
  CKPT_ASSIGN_OR_RETURN(const std::string job, JobOfKey(key, &owner_record));
  if (owner_record && size > kMaxOwnerRecordBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(key, ": an owner record of ", size, " bytes; at most ", kMaxOwnerRecordBytes));
  }
  struct statvfs fs;
  if (statvfs(options_.dir.c_str(), &fs) != 0) {
    return ErrnoStatus(errno, absl::StrCat("statvfs ", options_.dir));
  }
  const uint64_t free_bytes = static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize;
  absl::MutexLock lock(&mu_);
  // Bytes of other receipts still to arrive will take their share too.
  if (free_bytes < options_.min_free_disk_bytes + reserved_ + size) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the replica directory's file system has ", Bytes(free_bytes),
                     " free; another ", Bytes(size), " would leave less than min_free_disk_bytes (",
                     Bytes(options_.min_free_disk_bytes), ") for this node's own checkpoints"));
  }
  if (if_absent && objects_.count(key) > 0) {
    return absl::AlreadyExistsError(absl::StrCat(key, " exists"));
  }
  // One receipt that replaces a key at a time, so the memory copy and the
  // file are always the same writer's (conditional ones are arbitrated by
  // the link that publishes them: one wins, the others get ALREADY_EXISTS).
  if (!if_absent && receiving_.count(key) > 0) {
    return absl::AbortedError(absl::StrCat(key, " is being received by another call; try again"));
  }
  CKPT_RETURN_IF_ERROR(RoomLocked(peer, key, size));
  Reservation taken;
  // The owner of the job pays (an owner record is charged when it has
  // arrived and named its uid: Record).
  if (!owner_record && options_.charges != nullptr) {
    auto it = owners_.find(job);
    if (it == owners_.end()) {
      return absl::FailedPreconditionError(
          absl::StrCat("job ", job, " has no owner record here: whose replica ", key,
                       " is cannot be told (its owner record comes first)"));
    }
    uint64_t replaced = 0;
    if (auto old = objects_.find(key);
        old != objects_.end() && old->second.charged && old->second.owner == it->second) {
      replaced = old->second.size;
    }
    CKPT_RETURN_IF_ERROR(options_.charges->Reserve(it->second, size, replaced));
    taken.owner = it->second;
  }
  if (!if_absent) receiving_.insert(key);
  reserved_ += size;
  peer_reserved_[peer] += size;
  taken.memory = TakeMemoryLocked(size);
  return taken;
}

ReplicaStore::Memory ReplicaStore::TakeMemoryLocked(uint64_t size) {
  if (!memory_->Fits(size)) return nullptr;
  for (;;) {
    if (Memory m = memory_->Take(size)) return m;
    if (in_memory_.empty()) return nullptr;
    // The oldest replica in memory makes room: its file stays.
    auto it = objects_.find(in_memory_.begin()->second);
    if (it == objects_.end()) {
      in_memory_.erase(in_memory_.begin());
      continue;
    }
    ForgetMemoryLocked(&it->second);
  }
}

void ReplicaStore::ForgetMemoryLocked(Entry* e) {
  if (e->data == nullptr) return;
  memory_bytes_ -= e->size;
  in_memory_.erase(e->stored);
  e->data.reset();
}

absl::Status ReplicaStore::Record(const std::string& peer, const std::string& key, uint64_t size,
                                  bool if_absent, const absl::Status& written, Reservation taken) {
  // An owner record names its uid (checked before its file was published).
  std::optional<uid_t> owner = taken.owner;
  const absl::Status stored = written;
  bool owner_record = false;
  const std::string job = JobOfKey(key, &owner_record).value_or("");
  if (stored.ok() && owner_record) {
    owner = taken.record_owner;
    if (options_.charges != nullptr) options_.charges->Seed(*owner, size);
  }
  absl::MutexLock lock(&mu_);
  if (!if_absent) receiving_.erase(key);
  reserved_ -= size;
  if ((peer_reserved_[peer] -= size) == 0) peer_reserved_.erase(peer);
  if (!stored.ok()) {
    if (taken.owner.has_value()) options_.charges->Release(*taken.owner, size);
    return stored;
  }
  if (auto it = objects_.find(key); it != objects_.end()) {
    ChargeLocked(it->second, -1);
    ForgetMemoryLocked(&it->second);
    objects_.erase(it);
  }
  if (owner_record) owners_[job] = *owner;
  Entry e;
  e.peer = peer;
  e.size = size;
  e.owner = owner.value_or(0);
  e.charged = owner.has_value() && options_.charges != nullptr;
  e.stored = ++stored_;
  e.data = std::move(taken.memory);
  if (e.data != nullptr) {
    in_memory_[e.stored] = key;
    memory_bytes_ += size;
  }
  ChargeLocked(e, +1);
  objects_[key] = std::move(e);
  return absl::OkStatus();
}

absl::Status ReplicaStore::Receive(const std::string& peer, const std::string& key, uint64_t size,
                                   bool if_absent, const Source& next) {
  CKPT_ASSIGN_OR_RETURN(Reservation taken, Reserve(peer, key, size, if_absent));
  ReplicaMemory::Span* const kept = taken.memory.get();
  bool owner_record = false;
  (void)JobOfKey(key, &owner_record);  // Reserve checked the key
  std::string record;                  // an owner record's bytes (at most 64 KiB)
  // Durable before it is acknowledged; an old object of that name is
  // replaced whole (rename).
  absl::Status written = disk_->PutWith(key, if_absent, /*direct=*/true, [&](int fd) {
    const size_t kPiece = memory_->piece_bytes();
    FileWriter out(fd);
    // The bytes gather in the replica's memory pieces when it is kept, else
    // in one buffer of this call's; each full piece is written from there.
    std::unique_ptr<char, Free> own;
    if (kept == nullptr) {
      own.reset(static_cast<char*>(std::aligned_alloc(FileWriter::kAlign, kPiece)));
      if (own == nullptr) return absl::ResourceExhaustedError("no memory for a replica's buffer");
    }
    size_t index = 0, used = 0;
    auto block_at = [&](size_t i) { return kept != nullptr ? kept->MutablePiece(i) : own.get(); };
    char* block = block_at(0);
    uint64_t got = 0;
    std::string_view piece;
    for (;;) {
      CKPT_ASSIGN_OR_RETURN(const bool more, next(&piece));
      if (!more) break;
      if (piece.size() > size - got) {
        return absl::InvalidArgumentError(absl::StrCat(key, ": more than ", size, " bytes"));
      }
      got += piece.size();
      if (owner_record) record.append(piece);
      while (!piece.empty()) {
        if (used == kPiece) {
          CKPT_RETURN_IF_ERROR(out.Write(block, kPiece, /*last=*/false));
          used = 0;
          block = block_at(++index);
        }
        const size_t n = std::min(piece.size(), kPiece - used);
        std::memcpy(block + used, piece.data(), n);
        used += n;
        piece.remove_prefix(n);
      }
    }
    if (got != size) {
      return absl::InvalidArgumentError(
          absl::StrCat(key, ": ", got, " of ", size, " bytes arrived"));
    }
    // An owner record is checked before it takes the place of one there:
    // a record the cluster key does not vouch for never replaces a good one.
    if (owner_record) {
      absl::StatusOr<uid_t> uid = OwnerOfRecord(key, record);
      if (!uid.ok()) {
        return absl::Status(uid.status().code(),
                            absl::StrCat("refused ", key, ": ", uid.status().message()));
      }
      taken.record_owner = *uid;
    }
    // Killed here, or once the replica is stored, the sender has no
    // acknowledgement: the step is not peer-durable and is sent again
    // (tests/integration/test_peer.py kills at both).
    CKPT_KILL_POINT("replica.received");
    return out.Write(block, used, /*last=*/true);
  });
  if (!written.ok()) taken.memory.reset();
  return Record(peer, key, size, if_absent, written, std::move(taken));
}

absl::Status ReplicaStore::Put(const std::string& peer, const std::string& key,
                               std::string_view data, bool if_absent) {
  bool given = false;
  return Receive(peer, key, data.size(), if_absent, [&](std::string_view* piece) {
    *piece = data;
    return !std::exchange(given, true);
  });
}

absl::Status ReplicaStore::Read(const std::string& key, uint64_t max_bytes, size_t piece_bytes,
                                const Sink& sink) {
  piece_bytes = std::max<size_t>(piece_bytes, 1);
  Memory data;
  {
    absl::MutexLock lock(&mu_);
    auto it = objects_.find(key);
    if (it == objects_.end()) return absl::NotFoundError(absl::StrCat("no replica ", key));
    if (it->second.size > max_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(key, " is larger than ", max_bytes, " bytes"));
    }
    data = it->second.data;
  }
  if (data != nullptr) {
    if (data->size() == 0) return sink(0, std::string_view());
    for (size_t i = 0; i < data->pieces(); ++i) {
      std::string_view p = data->Piece(i);
      while (!p.empty()) {
        const size_t n = std::min(piece_bytes, p.size());
        CKPT_RETURN_IF_ERROR(sink(data->size(), p.substr(0, n)));
        p.remove_prefix(n);
      }
    }
    return absl::OkStatus();
  }
  uint64_t size = 0;
  CKPT_ASSIGN_OR_RETURN(UniqueFd fd, disk_->OpenObject(key, max_bytes, &size));
  std::string buf(static_cast<size_t>(std::min<uint64_t>(piece_bytes, size)), '\0');
  uint64_t off = 0;
  do {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(piece_bytes, size - off));
    size_t got = 0;
    while (got < n) {
      ssize_t r = pread(fd.get(), buf.data() + got, n - got, static_cast<off_t>(off + got));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) return ErrnoStatus(errno, absl::StrCat("read the replica ", key));
      if (r == 0) return absl::DataLossError(absl::StrCat(key, " shrank while being read"));
      got += static_cast<size_t>(r);
    }
    CKPT_RETURN_IF_ERROR(sink(size, std::string_view(buf.data(), n)));
    off += n;
  } while (off < size);
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReplicaStore::Get(const std::string& key, uint64_t max_bytes) {
  std::string out;
  CKPT_RETURN_IF_ERROR(Read(key, max_bytes, 1 << 20, [&out](uint64_t size, std::string_view piece) {
    out.reserve(size);
    out.append(piece);
    return absl::OkStatus();
  }));
  return out;
}

absl::StatusOr<std::vector<remote::ObjectInfo>> ReplicaStore::List(const std::string& prefix) {
  bool more = false;
  return ListPage(prefix, "", ~size_t{0}, &more);
}

std::vector<remote::ObjectInfo> ReplicaStore::ListPage(const std::string& prefix,
                                                       const std::string& start_after, size_t max,
                                                       bool* more) {
  std::vector<remote::ObjectInfo> out;
  *more = false;
  absl::MutexLock lock(&mu_);
  auto it = start_after.empty() || start_after < prefix ? objects_.lower_bound(prefix)
                                                        : objects_.upper_bound(start_after);
  for (; it != objects_.end() && it->first.compare(0, prefix.size(), prefix) == 0; ++it) {
    if (out.size() == max) {
      *more = true;
      break;
    }
    out.push_back(remote::ObjectInfo{it->first, it->second.size});
  }
  return out;
}

absl::Status ReplicaStore::Delete(const std::string& key) {
  {
    absl::MutexLock lock(&mu_);
    auto it = objects_.find(key);
    if (it == objects_.end()) return absl::OkStatus();
    ChargeLocked(it->second, -1);
    ForgetMemoryLocked(&it->second);
    objects_.erase(it);
  }
  return disk_->Delete(key);
}

ReplicaTotals ReplicaStore::Totals() {
  absl::MutexLock lock(&mu_);
  return ReplicaTotals{memory_bytes_, disk_bytes_, objects_.size()};
}

bool ReplicaStore::InMemory(const std::string& key) {
  absl::MutexLock lock(&mu_);
  auto it = objects_.find(key);
  return it != objects_.end() && it->second.data != nullptr;
}

uint64_t ReplicaStore::PeerBytes(const std::string& peer) {
  absl::MutexLock lock(&mu_);
  auto it = peer_bytes_.find(peer);
  return it == peer_bytes_.end() ? 0 : it->second;
}

}  // namespace ckpt::peer
