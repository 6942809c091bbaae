#include "daemon/peer/replica_server.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/resource_quota.h>

#include <algorithm>
#include <map>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "base/logging.h"
#include "base/status.h"
#include "daemon/common/kill_point.h"
#include "daemon/peer/replica.grpc.pb.h"
#include "daemon/remote/remote_layout.h"

namespace ckpt::peer {
namespace {

// Conditional objects (owner records, manifests) are small; bounded on
// their own.
constexpr uint64_t kMaxConditionalPut = 64 << 20;

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

}  // namespace

class ReplicaServer::Service final : public v1::Replica::Service {
 public:
  Service(ReplicaServerOptions options, ReplicaStore* store, Metrics* metrics)
      : options_(std::move(options)), store_(store), metrics_(metrics) {
    watchdog_ = std::thread([this] { WatchLoop(); });
  }
  ~Service() override {
    {
      absl::MutexLock lock(&watch_mu_);
      stop_ = true;
    }
    watchdog_.join();
  }

  // A call that moves bytes, watched for progress while it lives.
  class Watch {
   public:
    Watch(Service* s, grpc::ServerContext* ctx) : s_(s), ctx_(ctx) {
      absl::MutexLock lock(&s_->watch_mu_);
      s_->active_[ctx_] = absl::Now();
    }
    ~Watch() {
      absl::MutexLock lock(&s_->watch_mu_);
      s_->active_.erase(ctx_);
    }
    void Moved() {
      absl::MutexLock lock(&s_->watch_mu_);
      s_->active_[ctx_] = absl::Now();
    }

   private:
    Service* const s_;
    grpc::ServerContext* const ctx_;
  };

  grpc::Status Put(grpc::ServerContext* ctx, grpc::ServerReader<v1::PutChunk>* reader,
                   v1::PutReply*) override {
    std::string peer;
    if (grpc::Status s = Authenticate(ctx, &peer); !s.ok()) return s;
    v1::PutChunk chunk;
    // Watched from the start: a peer that opens a Put and sends nothing
    // holds a thread no longer than one that stops half-way.
    Watch watch(this, ctx);
    if (!reader->Read(&chunk))
      return Refuse("bad_request", absl::InvalidArgumentError("no object"));
    const std::string key = chunk.key();
    const uint64_t size = chunk.size();
    const bool if_absent = chunk.if_absent();
    if (absl::Status s = remote::CheckObjectKey(key); !s.ok()) return Refuse("bad_request", s);
    if (if_absent && size > kMaxConditionalPut) {
      return Refuse("bad_request", absl::InvalidArgumentError(
                                       absl::StrCat(key, ": a conditional object of ", size,
                                                    " bytes; at most ", kMaxConditionalPut)));
    }
    // The first message's bytes first, then each further message's.
    bool first = true;
    watch.Moved();
    absl::Status s = store_->Receive(peer, key, size, if_absent, [&](std::string_view* piece) {
      if (!std::exchange(first, false) && !reader->Read(&chunk)) return false;
      watch.Moved();
      *piece = chunk.data();
      return true;
    });
    CKPT_KILL_POINT("replica.stored");
    if (absl::IsResourceExhausted(s)) return Refuse("full", s);
    if (absl::IsInvalidArgument(s)) return Refuse("bad_request", s);
    if (s.ok() && metrics_ != nullptr) {
      metrics_->Inc(Counter::kPeerReplicaReceivedBytes, static_cast<double>(size));
    }
    return ToGrpc(s);
  }

  grpc::Status Get(grpc::ServerContext* ctx, const v1::GetRequest* req,
                   grpc::ServerWriter<v1::DataChunk>* writer) override {
    std::string peer;
    if (grpc::Status s = Authenticate(ctx, &peer); !s.ok()) return s;
    if (absl::Status s = remote::CheckObjectKey(req->key()); !s.ok())
      return Refuse("bad_request", s);
    v1::DataChunk chunk;
    bool first = true;
    Watch watch(this, ctx);
    absl::Status s = store_->Read(req->key(), req->max_bytes(), options_.chunk_bytes,
                                  [&](uint64_t size, std::string_view piece) {
                                    if (std::exchange(first, false))
                                      chunk.set_size(size);
                                    else
                                      chunk.clear_size();
                                    chunk.set_data(piece.data(), piece.size());
                                    if (!writer->Write(chunk)) {
                                      return absl::CancelledError("the peer left");
                                    }
                                    watch.Moved();
                                    return absl::OkStatus();
                                  });
    if (!s.ok()) return ToGrpc(s);
    return grpc::Status::OK;
  }

  grpc::Status List(grpc::ServerContext* ctx, const v1::ListRequest* req,
                    v1::ListReply* reply) override {
    std::string peer;
    if (grpc::Status s = Authenticate(ctx, &peer); !s.ok()) return s;
    // A page at a time: a reply's size is bounded whatever the store holds.
    const size_t page = std::max<size_t>(1, options_.list_page);
    const size_t max = req->max_keys() == 0 ? page : std::min<size_t>(req->max_keys(), page);
    bool more = false;
    for (const remote::ObjectInfo& o :
         store_->ListPage(req->prefix(), req->start_after(), max, &more)) {
      v1::ObjectEntry* e = reply->add_objects();
      e->set_key(o.key);
      e->set_size(o.size);
    }
    reply->set_truncated(more);
    return grpc::Status::OK;
  }

  grpc::Status Delete(grpc::ServerContext* ctx, const v1::DeleteRequest* req,
                      v1::DeleteReply*) override {
    std::string peer;
    if (grpc::Status s = Authenticate(ctx, &peer); !s.ok()) return s;
    if (absl::Status s = remote::CheckObjectKey(req->key()); !s.ok())
      return Refuse("bad_request", s);
    return ToGrpc(store_->Delete(req->key()));
  }

 private:
  // The peer's name from its certificate (TLS checked the CA's signature).
  grpc::Status Authenticate(grpc::ServerContext* ctx, std::string* peer) {
    std::shared_ptr<const grpc::AuthContext> auth = ctx->auth_context();
    std::vector<grpc::string_ref> names =
        auth ? auth->FindPropertyValues("x509_common_name") : std::vector<grpc::string_ref>();
    if (names.empty()) {
      return Refuse("unknown_peer",
                    absl::UnauthenticatedError("a peer must present a certificate"));
    }
    *peer = std::string(names[0].data(), names[0].size());
    if (!options_.allowed_peers.empty() && options_.allowed_peers.count(*peer) == 0) {
      CKPT_LOG(WARNING) << "refused replica call from " << ctx->peer() << ": certificate name "
                        << *peer << " is not in peer_allow";
      return Refuse("unknown_peer", absl::PermissionDeniedError(absl::StrCat(
                                        "peer ", *peer, " is not allowed to keep replicas here")));
    }
    return grpc::Status::OK;
  }

  grpc::Status Refuse(const char* reason, const absl::Status& s) {
    if (metrics_ != nullptr) metrics_->Inc(Counter::kPeerReplicaRefused, reason, 1);
    return ToGrpc(s);
  }

  // Cancels the calls that moved nothing for idle_timeout.
  void WatchLoop() {
    const absl::Duration tick =
        std::min(absl::Seconds(1), std::max(absl::Milliseconds(10), options_.idle_timeout / 4));
    absl::MutexLock lock(&watch_mu_);
    auto stopped = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(watch_mu_) { return stop_; };
    while (!watch_mu_.AwaitWithTimeout(absl::Condition(&stopped), tick)) {
      const absl::Time now = absl::Now();
      for (auto& [ctx, last] : active_) {
        if (now - last < options_.idle_timeout) continue;
        CKPT_LOG(WARNING) << "replica call from " << ctx->peer() << " moved nothing for "
                          << options_.idle_timeout << "; cancelled";
        if (metrics_ != nullptr) metrics_->Inc(Counter::kPeerReplicaRefused, "idle", 1);
        ctx->TryCancel();
        last = absl::InfiniteFuture();  // once
      }
    }
  }

  const ReplicaServerOptions options_;
  ReplicaStore* const store_;
  Metrics* const metrics_;
  absl::Mutex watch_mu_;
  std::map<grpc::ServerContext*, absl::Time> active_ ABSL_GUARDED_BY(watch_mu_);  // last move
  bool stop_ ABSL_GUARDED_BY(watch_mu_) = false;
  std::thread watchdog_;
};

absl::StatusOr<std::unique_ptr<ReplicaServer>> ReplicaServer::Start(ReplicaServerOptions options,
                                                                    ReplicaStore* store,
                                                                    Metrics* metrics) {
  std::unique_ptr<ReplicaServer> server(new ReplicaServer());
  std::shared_ptr<grpc::ServerCredentials> creds = options.tls.ServerCredentials();
  const std::string listen = options.listen;
  grpc::ResourceQuota quota("ckptd-replica");
  quota.SetMaxThreads(std::max(2, options.max_threads));
  // Lists of many objects are one message.
  const int message_bytes = std::max(static_cast<int>(options.chunk_bytes) + (64 << 10), 64 << 20);
  server->service_ = std::make_unique<Service>(std::move(options), store, metrics);
  grpc::ServerBuilder builder;
  builder.SetResourceQuota(quota);
  builder.SetMaxReceiveMessageSize(message_bytes);
  builder.SetMaxSendMessageSize(message_bytes);
  builder.AddListeningPort(listen, creds, &server->port_);
  builder.RegisterService(server->service_.get());
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || server->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen for peers on ", listen));
  }
  return server;
}

ReplicaServer::~ReplicaServer() { Shutdown(absl::Now()); }

void ReplicaServer::Shutdown(absl::Time deadline) {
  if (stopped_ || server_ == nullptr) return;
  stopped_ = true;
  server_->Shutdown(absl::ToChronoTime(deadline));
  server_->Wait();
}

}  // namespace ckpt::peer
