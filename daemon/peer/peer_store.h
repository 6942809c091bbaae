// PeerStore: the peer tier's transport (docs/peer.md), a RemoteStore whose
// objects live in a peer node's ckptd (its ReplicaServer and ReplicaStore).
//
// The peer tier is a RemoteTier over this store: the same uploads,
// manifests, MACs under the cluster key, retention and pulls as the remote
// tier, to another place. This transport is gRPC over TCP with mutual TLS;
// another transport (RDMA) implements RemoteStore the same way.
//
// Every call has a deadline: `call_timeout`, plus its bytes' time at its
// share of the rate cap (the cap over `calls_at_once`), or, without a cap,
// at kSlowestBytesPerS: a large version gets the time it needs, a stalled
// call still ends. The bytes sent are paced to `rate_bytes_per_s`
// (shared by every call of this store) so replication leaves the network
// to training; 0 is no cap. Status codes follow remote_store.h: a peer
// that cannot be reached is UNAVAILABLE, one whose store is full
// RESOURCE_EXHAUSTED (the tier backs off and retries both).
//
// Thread-safety: thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/peer/peer_tls.h"
#include "daemon/remote/remote_store.h"

namespace grpc {
class Channel;
class ClientContext;
}  // namespace grpc

namespace ckpt::peer {

// The rate cap replication shares (peer_rate_bytes): every call of every
// PeerStore that holds it is paced to one budget of bytes/s, so the copies
// to F peers together leave the network to training.
// Thread-safety: thread-safe; mu_ is a leaf.
class RateCap {
 public:
  explicit RateCap(uint64_t bytes_per_s) : rate_(bytes_per_s) {}
  uint64_t rate() const { return rate_; }
  // When `bytes` more may go out; the schedule moves on by them. A burst
  // of at most 100 ms of the rate is allowed after an idle spell.
  absl::Time Reserve(uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // Cancelled calls send nothing more: their share is free again.
  void Reset() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const uint64_t rate_;  // 0: no cap
  absl::Mutex mu_;
  absl::Time next_send_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

struct PeerStoreOptions {
  std::string address;      // host:port of the peer's replica service
  std::string server_name;  // the common name its certificate must carry
  PeerTls tls;
  uint64_t rate_bytes_per_s = 0;  // 0: no cap
  // Shared with other stores (one budget for every peer); null: a cap of
  // rate_bytes_per_s for this store alone.
  std::shared_ptr<RateCap> cap;
  // The calls that share the cap (the upload threads, times the peers that
  // share it): each call's deadline allows for its share.
  uint32_t calls_at_once = 4;
  // TCP connections to the peer; transfers take them in turn (gRPC runs
  // each connection's TLS and HTTP/2 on one thread at a time).
  uint32_t connections = 4;
  absl::Duration call_timeout = absl::Seconds(30);
  uint32_t chunk_bytes = 1 << 20;
};

class PeerStore final : public remote::RemoteStore {
 public:
  static constexpr uint64_t kSlowestBytesPerS = 8 << 20;
  explicit PeerStore(PeerStoreOptions options);
  ~PeerStore() override;

  std::string Describe() const override;
  absl::Status PutFile(const std::string& key, int fd, uint64_t size) override;
  // One pass over the file, with O_DIRECT where its file system allows it:
  // the bytes are read once, for `observe` and the stream together.
  absl::Status PutFileObserved(const std::string& key, int fd, uint64_t size,
                               const Observer& observe) override;
  absl::StatusOr<uint64_t> GetToFileObserved(const std::string& key, int fd, uint64_t max_bytes,
                                             const Observer& observe) override;
  // The bytes go from `fill` into each message: from the memory tier
  // without a read of the version's file.
  bool PutsFromMemory() const override { return true; }
  absl::Status PutFilledObserved(const std::string& key, uint64_t size, const Filler& fill,
                                 const Observer& observe) override;
  absl::Status PutBytes(const std::string& key, std::string_view data, bool if_absent) override;
  absl::StatusOr<uint64_t> GetToFile(const std::string& key, int fd, uint64_t max_bytes) override;
  absl::StatusOr<std::string> GetBytes(const std::string& key, uint64_t max_bytes) override;
  absl::StatusOr<std::vector<remote::ObjectInfo>> List(const std::string& prefix) override;
  absl::Status Delete(const std::string& key) override;
  void CancelCalls() override ABSL_LOCKS_EXCLUDED(mu_);

 private:
  class Stub;
  class Call;
  // Streams `size` bytes, each message's filled in by `fill` and then
  // shown to `observe` when given.
  absl::Status Put(const std::string& key, uint64_t size, bool if_absent, const Filler& fill,
                   const Observer* observe);
  // Streams the object to `sink(data)`; its size.
  absl::StatusOr<uint64_t> Get(const std::string& key, uint64_t max_bytes,
                               const std::function<absl::Status(std::string_view)>& sink);
  // Waits until `bytes` more may go out under the rate cap; CANCELLED when
  // CancelCalls came after the call's `generation`.
  absl::Status Pace(uint64_t bytes, uint64_t generation) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Time DeadlineFor(uint64_t bytes) const;
  // The bytes of one Put message: chunk_bytes, less under a low rate cap.
  size_t ChunkBytes() const;

  const PeerStoreOptions options_;
  const std::shared_ptr<RateCap> cap_;
  std::unique_ptr<Stub> stub_;
  absl::Mutex mu_;
  std::set<grpc::ClientContext*> calls_ ABSL_GUARDED_BY(mu_);  // in flight
  uint64_t cancels_ ABSL_GUARDED_BY(mu_) = 0;                  // CancelCalls so far
};

}  // namespace ckpt::peer
