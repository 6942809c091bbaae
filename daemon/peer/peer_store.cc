#include "daemon/peer/peer_store.h"

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "daemon/common/sync_point.h"
#include "daemon/peer/replica.grpc.pb.h"
#include "daemon/remote/remote_layout.h"

namespace ckpt::peer {
namespace {

// The most keys one List takes in (a rank's objects and manifests are a few
// per layer and step kept).
constexpr size_t kMaxListed = 10000000;
constexpr uint64_t kMaxListedBytes = uint64_t{1} << 30;  // of their keys

absl::Status FromGrpc(const grpc::Status& s, const std::string& what) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat(what, ": ", s.error_message()));
}

}  // namespace

// The peer's replica service over `connections` TCP connections: each
// carries its own TLS session and HTTP/2 transport, which gRPC runs on one
// thread at a time, so versions sent at once go over different ones.
class PeerStore::Stub {
 public:
  explicit Stub(const PeerStoreOptions& o) {
    grpc::ChannelArguments args;
    if (!o.server_name.empty()) args.SetSslTargetNameOverride(o.server_name);
    args.SetMaxReceiveMessageSize(std::max(static_cast<int>(o.chunk_bytes) + (64 << 10), 64 << 20));
    // A peer that went away is found again quickly once it is back.
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
    // A connection of its own per channel, not one shared through gRPC's
    // global subchannel pool.
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    for (uint32_t i = 0; i < std::max(1u, o.connections); ++i) {
      stubs_.push_back(v1::Replica::NewStub(
          grpc::CreateCustomChannel(o.address, o.tls.ChannelCredentials(), args)));
    }
  }
  // The stub for the next transfer, round-robin.
  v1::Replica::Stub* Next() { return stubs_[next_.fetch_add(1) % stubs_.size()].get(); }
  // Small calls: the first connection.
  v1::Replica::Stub* Control() { return stubs_[0].get(); }

 private:
  std::vector<std::unique_ptr<v1::Replica::Stub>> stubs_;
  std::atomic<size_t> next_{0};
};

absl::Time RateCap::Reserve(uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  if (rate_ == 0) return now;
  next_send_ = std::max(next_send_, now - absl::Milliseconds(100));
  const absl::Time at = next_send_;
  next_send_ += absl::Seconds(static_cast<double>(bytes) / static_cast<double>(rate_));
  return at;
}

void RateCap::Reset() {
  absl::MutexLock lock(&mu_);
  next_send_ = absl::InfinitePast();
}

PeerStore::PeerStore(PeerStoreOptions options)
    : options_(std::move(options)),
      cap_(options_.cap != nullptr ? options_.cap
                                   : std::make_shared<RateCap>(options_.rate_bytes_per_s)),
      stub_(std::make_unique<Stub>(options_)) {}

PeerStore::~PeerStore() = default;

std::string PeerStore::Describe() const {
  return absl::StrCat("peer ", options_.server_name, " at ", options_.address);
}

size_t PeerStore::ChunkBytes() const {
  if (cap_->rate() == 0) return options_.chunk_bytes;
  // Under a low cap, smaller messages: each call moves one at least every
  // half second at its share of the cap, well inside the peer's idle limit.
  const uint64_t share = cap_->rate() / std::max(1u, options_.calls_at_once) / 2;
  return static_cast<size_t>(
      std::clamp<uint64_t>(share, 64 << 10, std::max<uint64_t>(options_.chunk_bytes, 64 << 10)));
}

absl::Time PeerStore::DeadlineFor(uint64_t bytes) const {
  double rate = static_cast<double>(kSlowestBytesPerS);
  if (cap_->rate() > 0) {
    rate = static_cast<double>(cap_->rate()) / std::max(1u, options_.calls_at_once);
  }
  return absl::Now() + options_.call_timeout + absl::Seconds(static_cast<double>(bytes) / rate);
}

// A call registered for CancelCalls while it runs.
class PeerStore::Call {
 public:
  Call(PeerStore* store, absl::Time deadline) : store_(store) {
    ctx.set_deadline(absl::ToChronoTime(deadline));
    absl::MutexLock lock(&store_->mu_);
    generation = store_->cancels_;
    store_->calls_.insert(&ctx);
  }
  ~Call() {
    absl::MutexLock lock(&store_->mu_);
    store_->calls_.erase(&ctx);
  }
  grpc::ClientContext ctx;
  uint64_t generation = 0;  // CancelCalls seen when it began

 private:
  PeerStore* const store_;
};

void PeerStore::CancelCalls() {
  {
    absl::MutexLock lock(&mu_);
    ++cancels_;
    for (grpc::ClientContext* ctx : calls_) ctx->TryCancel();
  }
  // The cancelled calls' bytes are not sent: their share of the cap is free.
  cap_->Reset();
}

absl::Status PeerStore::Pace(uint64_t bytes, uint64_t generation) {
  if (cap_->rate() == 0 || bytes == 0) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  // A cancelled call takes no share of the cap (CancelCalls freed it).
  if (cancels_ != generation) return absl::CancelledError("ckptd is stopping");
  const absl::Time at = cap_->Reserve(bytes);
  auto cancelled = [this, generation]()
                       ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return cancels_ != generation; };
  if (mu_.AwaitWithDeadline(absl::Condition(&cancelled), at)) {
    return absl::CancelledError("ckptd is stopping");
  }
  return absl::OkStatus();
}

absl::Status PeerStore::Put(const std::string& key, uint64_t size, bool if_absent,
                            const Filler& fill, const Observer* observe) {
  Call call(this, DeadlineFor(size));
  grpc::ClientContext& ctx = call.ctx;
  v1::PutReply reply;
  std::unique_ptr<grpc::ClientWriter<v1::PutChunk>> writer = stub_->Next()->Put(&ctx, &reply);
  v1::PutChunk chunk;
  chunk.set_key(key);
  chunk.set_size(size);
  chunk.set_if_absent(if_absent);
  uint64_t off = 0;
  absl::Status local;
  const size_t piece_bytes = ChunkBytes();
  do {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(piece_bytes, size - off));
    if (n > 0) {
      local = fill(off, n, chunk.mutable_data());
      if (local.ok() && chunk.data().size() != n) {
        local =
            absl::InternalError(absl::StrCat(key, ": ", chunk.data().size(), " bytes filled in at ",
                                             off, " where ", n, " were asked for"));
      }
      if (local.ok() && observe != nullptr) local = (*observe)(chunk.data());
      if (!local.ok()) break;
    }
    CKPT_SYNC_POINT("peer.before_pace");
    local = Pace(n, call.generation);
    if (!local.ok()) break;
    off += n;
    if (!writer->Write(chunk)) break;  // Finish says why
    chunk.clear_key();
    chunk.clear_size();
    chunk.clear_if_absent();
  } while (off < size);
  if (!local.ok()) {
    ctx.TryCancel();
    (void)writer->Finish();
    return local;
  }
  writer->WritesDone();
  return FromGrpc(writer->Finish(), absl::StrCat("put ", key, " to ", Describe()));
}

absl::Status PeerStore::PutFile(const std::string& key, int fd, uint64_t size) {
  return PutFileObserved(key, fd, size, nullptr);
}

absl::Status PeerStore::PutFileObserved(const std::string& key, int fd, uint64_t size,
                                        const Observer& observe) {
  CKPT_ASSIGN_OR_RETURN(remote::SequentialFileReader reader,
                        remote::SequentialFileReader::Open(fd, options_.chunk_bytes));
  return Put(
      key, size, false,
      [&reader](uint64_t off, size_t n, std::string* out) {
        return remote::FillFromFile(&reader, off, n, out);
      },
      observe ? &observe : nullptr);
}

absl::Status PeerStore::PutFilledObserved(const std::string& key, uint64_t size, const Filler& fill,
                                          const Observer& observe) {
  return Put(key, size, false, fill, observe ? &observe : nullptr);
}

absl::Status PeerStore::PutBytes(const std::string& key, std::string_view data, bool if_absent) {
  return Put(
      key, data.size(), if_absent,
      [data](uint64_t off, size_t n, std::string* out) {
        out->assign(data.substr(static_cast<size_t>(off), n));
        return absl::OkStatus();
      },
      nullptr);
}

absl::StatusOr<uint64_t> PeerStore::Get(const std::string& key, uint64_t max_bytes,
                                        const std::function<absl::Status(std::string_view)>& sink) {
  Call call(this, DeadlineFor(max_bytes == ~uint64_t{0} ? 0 : max_bytes));
  grpc::ClientContext& ctx = call.ctx;
  v1::GetRequest req;
  req.set_key(key);
  req.set_max_bytes(max_bytes);
  std::unique_ptr<grpc::ClientReader<v1::DataChunk>> reader = stub_->Next()->Get(&ctx, req);
  v1::DataChunk chunk;
  uint64_t size = 0, got = 0;
  bool first = true;
  absl::Status local;
  while (reader->Read(&chunk)) {
    if (first) size = chunk.size();
    first = false;
    if (size > max_bytes || chunk.data().size() > size - got) {
      local = absl::DataLossError(absl::StrCat(key, ": the peer sent more than it announced"));
      break;
    }
    local = sink(chunk.data());
    if (!local.ok()) break;
    got += chunk.data().size();
  }
  if (!local.ok()) {
    ctx.TryCancel();
    (void)reader->Finish();
    return local;
  }
  CKPT_RETURN_IF_ERROR(FromGrpc(reader->Finish(), absl::StrCat("get ", key, " from ", Describe())));
  if (got != size) {
    return absl::DataLossError(absl::StrCat(key, ": ", got, " of ", size, " bytes arrived"));
  }
  return size;
}

absl::StatusOr<uint64_t> PeerStore::GetToFile(const std::string& key, int fd, uint64_t max_bytes) {
  return GetToFileObserved(key, fd, max_bytes, nullptr);
}

absl::StatusOr<uint64_t> PeerStore::GetToFileObserved(const std::string& key, int fd,
                                                      uint64_t max_bytes, const Observer& observe) {
  CKPT_ASSIGN_OR_RETURN(remote::SequentialFileWriter out, remote::SequentialFileWriter::Open(fd));
  CKPT_ASSIGN_OR_RETURN(const uint64_t size, Get(key, max_bytes, [&](std::string_view data) {
                          if (observe) CKPT_RETURN_IF_ERROR(observe(data));
                          return out.Append(data);
                        }));
  CKPT_RETURN_IF_ERROR(out.Finish());
  return size;
}

absl::StatusOr<std::string> PeerStore::GetBytes(const std::string& key, uint64_t max_bytes) {
  std::string out;
  CKPT_RETURN_IF_ERROR(Get(key, max_bytes, [&out](std::string_view data) {
                         out.append(data);
                         return absl::OkStatus();
                       }).status());
  return out;
}

absl::StatusOr<std::vector<remote::ObjectInfo>> PeerStore::List(const std::string& prefix) {
  std::vector<remote::ObjectInfo> out;
  uint64_t listed_bytes = 0;
  v1::ListRequest req;
  req.set_prefix(prefix);
  for (;;) {
    Call call(this, DeadlineFor(0));
    v1::ListReply reply;
    CKPT_RETURN_IF_ERROR(FromGrpc(stub_->Control()->List(&call.ctx, req, &reply),
                                  absl::StrCat("list ", Describe())));
    for (const v1::ObjectEntry& e : reply.objects()) {
      // Pages come in key order, each key under the prefix and of the
      // layout's size; a peer that sends otherwise (or without end) is not
      // followed, and what one List holds is bounded.
      listed_bytes += e.key().size();
      if (e.key() <= req.start_after() || e.key().compare(0, prefix.size(), prefix) != 0 ||
          !remote::CheckObjectKey(e.key()).ok() || out.size() >= kMaxListed ||
          listed_bytes > kMaxListedBytes) {
        return absl::DataLossError(absl::StrCat(
            "list ", Describe(), ": a key out of order, outside ", prefix, ", malformed, or past ",
            kMaxListed, " keys or ", kMaxListedBytes, " bytes of them"));
      }
      out.push_back({e.key(), e.size()});
    }
    if (!reply.truncated()) return out;
    if (reply.objects().empty()) {
      return absl::DataLossError(absl::StrCat("list ", Describe(), ": an empty page said more"));
    }
    req.set_start_after(reply.objects().rbegin()->key());
  }
}

absl::Status PeerStore::Delete(const std::string& key) {
  Call call(this, DeadlineFor(0));
  grpc::ClientContext& ctx = call.ctx;
  v1::DeleteRequest req;
  req.set_key(key);
  v1::DeleteReply reply;
  return FromGrpc(stub_->Control()->Delete(&ctx, req, &reply),
                  absl::StrCat("delete ", key, " at ", Describe()));
}

}  // namespace ckpt::peer
