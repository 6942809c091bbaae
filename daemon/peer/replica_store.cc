// ReplicaStore: replicas in memory within a budget, on disk past it.
#include "daemon/peer/replica_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status.h"

namespace ckpt::peer {
namespace {

std::string Bytes(uint64_t n) { return absl::StrFormat("%.1f MiB", n / 1048576.0); }

}  // namespace

absl::StatusOr<std::unique_ptr<ReplicaStore>> ReplicaStore::Open(ReplicaStoreOptions options) {
  if (::mkdir(options.dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return ErrnoStatus(errno, absl::StrCat("mkdir ", options.dir));
  }
  CKPT_ASSIGN_OR_RETURN(std::unique_ptr<remote::PosixStore> disk,
                        remote::PosixStore::Open(options.dir));
  CKPT_ASSIGN_OR_RETURN(std::vector<remote::ObjectInfo> found, disk->List(""));
  std::unique_ptr<ReplicaStore> store(new ReplicaStore(std::move(options), std::move(disk)));
  absl::MutexLock lock(&store->mu_);
  for (const remote::ObjectInfo& o : found) {
    Entry e;
    e.size = o.size;
    store->ChargeLocked(e, +1);
    store->objects_.emplace(o.key, std::move(e));
  }
  return store;
}

void ReplicaStore::ChargeLocked(const Entry& e, int sign) {
  const uint64_t n = e.size;
  disk_bytes_ = sign > 0 ? disk_bytes_ + n : disk_bytes_ - n;
  if (e.data != nullptr) memory_bytes_ = sign > 0 ? memory_bytes_ + n : memory_bytes_ - n;
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

absl::Status ReplicaStore::Hold(const std::string& peer, const std::string& key, uint64_t size) {
  return Reserve(peer, key, size, /*if_absent=*/false);
}

void ReplicaStore::Release(const std::string& peer, uint64_t size) {
  absl::MutexLock lock(&mu_);
  reserved_ -= size;
  if ((peer_reserved_[peer] -= size) == 0) peer_reserved_.erase(peer);
}

absl::Status ReplicaStore::Reserve(const std::string& peer, const std::string& key, uint64_t size,
                                   bool if_absent) {
  absl::MutexLock lock(&mu_);
  if (if_absent && objects_.count(key) > 0) {
    return absl::AlreadyExistsError(absl::StrCat(key, " exists"));
  }
  CKPT_RETURN_IF_ERROR(RoomLocked(peer, key, size));
  reserved_ += size;
  peer_reserved_[peer] += size;
  return absl::OkStatus();
}

absl::Status ReplicaStore::Record(const std::string& peer, const std::string& key, uint64_t size,
                                  const absl::Status& written, std::string* data) {
  absl::MutexLock lock(&mu_);
  reserved_ -= size;
  if ((peer_reserved_[peer] -= size) == 0) peer_reserved_.erase(peer);
  CKPT_RETURN_IF_ERROR(written);
  if (auto it = objects_.find(key); it != objects_.end()) {
    ChargeLocked(it->second, -1);
    objects_.erase(it);
  }
  Entry e;
  e.peer = peer;
  e.size = size;
  if (data != nullptr && memory_bytes_ + size <= options_.memory_bytes) {
    e.data = std::make_shared<const std::string>(std::move(*data));
  }
  ChargeLocked(e, +1);
  objects_[key] = std::move(e);
  return absl::OkStatus();
}

absl::Status ReplicaStore::Put(const std::string& peer, const std::string& key, std::string data,
                               bool if_absent) {
  const uint64_t size = data.size();
  CKPT_RETURN_IF_ERROR(Reserve(peer, key, size, if_absent));
  // Durable before it is acknowledged; an old object of that name is
  // replaced whole (rename).
  absl::Status written = disk_->PutBytes(key, data, if_absent);
  return Record(peer, key, size, written, &data);
}

absl::Status ReplicaStore::PutFile(const std::string& peer, const std::string& key, int fd,
                                   uint64_t size) {
  CKPT_RETURN_IF_ERROR(Reserve(peer, key, size, /*if_absent=*/false));
  absl::Status written = disk_->PutFile(key, fd, size);
  std::string data;
  std::string* keep = nullptr;
  if (written.ok() && size <= options_.memory_bytes) {
    // Kept in memory too when it fits (Record decides under the lock).
    data.resize(size);
    size_t done = 0;
    while (done < size) {
      ssize_t r = pread(fd, data.data() + done, size - done, static_cast<off_t>(done));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) break;
      done += static_cast<size_t>(r);
    }
    if (done == size) keep = &data;
  }
  return Record(peer, key, size, written, keep);
}

absl::StatusOr<UniqueFd> ReplicaStore::TempFile() {
  UniqueFd fd(open(options_.dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600));
  if (!fd.valid()) return ErrnoStatus(errno, absl::StrCat("temp file in ", options_.dir));
  return fd;
}

absl::StatusOr<std::string> ReplicaStore::Get(const std::string& key, uint64_t max_bytes) {
  std::shared_ptr<const std::string> data;
  {
    absl::MutexLock lock(&mu_);
    auto it = objects_.find(key);
    if (it == objects_.end()) return absl::NotFoundError(absl::StrCat("no replica ", key));
    if (it->second.size > max_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(key, " is larger than ", max_bytes, " bytes"));
    }
    data = it->second.data;
  }
  if (data != nullptr) return *data;
  return disk_->GetBytes(key, max_bytes);
}

absl::StatusOr<std::vector<remote::ObjectInfo>> ReplicaStore::List(const std::string& prefix) {
  std::vector<remote::ObjectInfo> out;
  absl::MutexLock lock(&mu_);
  for (auto it = objects_.lower_bound(prefix);
       it != objects_.end() && it->first.compare(0, prefix.size(), prefix) == 0; ++it) {
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
    objects_.erase(it);
  }
  return disk_->Delete(key);
}

ReplicaTotals ReplicaStore::Totals() {
  absl::MutexLock lock(&mu_);
  return ReplicaTotals{memory_bytes_, disk_bytes_, objects_.size()};
}

uint64_t ReplicaStore::PeerBytes(const std::string& peer) {
  absl::MutexLock lock(&mu_);
  auto it = peer_bytes_.find(peer);
  return it == peer_bytes_.end() ? 0 : it->second;
}

}  // namespace ckpt::peer
