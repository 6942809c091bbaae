#include "daemon/peer/replica_server.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/resource_quota.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "base/status.h"
#include "base/unique_fd.h"
#include "daemon/common/kill_point.h"
#include "daemon/peer/replica.grpc.pb.h"
#include "daemon/remote/remote_layout.h"

namespace ckpt::peer {
namespace {

// Objects up to this size are received in memory; larger ones in a file.
// Conditional ones (owner records, manifests: small) always in memory, so
// they are bounded on their own.
constexpr uint64_t kInMemoryPut = 4 << 20;
constexpr uint64_t kMaxConditionalPut = 64 << 20;

absl::Status WriteAll(int fd, const std::string& data, uint64_t offset) {
  size_t done = 0;
  while (done < data.size()) {
    ssize_t w =
        pwrite(fd, data.data() + done, data.size() - done, static_cast<off_t>(offset + done));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return ErrnoStatus(errno, "write a replica's temp file");
    done += static_cast<size_t>(w);
  }
  return absl::OkStatus();
}

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

}  // namespace

class ReplicaServer::Service final : public v1::Replica::Service {
 public:
  Service(ReplicaServerOptions options, ReplicaStore* store, Metrics* metrics)
      : options_(std::move(options)), store_(store), metrics_(metrics) {}

  grpc::Status Put(grpc::ServerContext* ctx, grpc::ServerReader<v1::PutChunk>* reader,
                   v1::PutReply*) override {
    std::string peer;
    if (grpc::Status s = Authenticate(ctx, &peer); !s.ok()) return s;
    v1::PutChunk chunk;
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
    // The room is held while the bytes arrive, so concurrent calls cannot
    // announce more than the bounds allow between them.
    if (absl::Status s = store_->Hold(peer, key, size); !s.ok()) {
      return Refuse(absl::IsResourceExhausted(s) ? "full" : "bad_request", s);
    }
    struct Held {
      ReplicaStore* store;
      const std::string& peer;
      uint64_t size;
      bool held = true;
      void Drop() {
        if (held) store->Release(peer, size);
        held = false;
      }
      ~Held() { Drop(); }
    } held{store_, peer, size};
    // Small objects (and conditional ones) arrive in memory, large ones in
    // a temp file: memory per call stays bounded by kInMemoryPut.
    const bool in_memory = if_absent || size <= kInMemoryPut;
    std::string data;
    UniqueFd tmp;
    if (in_memory) {
      data.reserve(size);
    } else {
      absl::StatusOr<UniqueFd> fd = store_->TempFile();
      if (!fd.ok()) return ToGrpc(fd.status());
      tmp = std::move(*fd);
    }
    uint64_t got = 0;
    do {
      if (chunk.data().size() > size - got) {
        return Refuse("bad_request", absl::InvalidArgumentError(
                                         absl::StrCat(key, ": more than ", size, " bytes")));
      }
      if (in_memory) {
        data.append(chunk.data());
      } else if (absl::Status w = WriteAll(tmp.get(), chunk.data(), got); !w.ok()) {
        return ToGrpc(w);
      }
      got += chunk.data().size();
    } while (reader->Read(&chunk));
    if (got != size) {
      return Refuse("bad_request", absl::InvalidArgumentError(absl::StrCat(
                                       key, ": ", got, " of ", size, " bytes arrived")));
    }
    // A peer killed here, or after the store wrote the replica, leaves
    // the sender without an acknowledgement: the step is not peer-durable
    // and is sent again (tests/integration/test_peer.py kills at both).
    CKPT_KILL_POINT("replica.received");
    held.Drop();
    absl::Status s = in_memory ? store_->Put(peer, key, std::move(data), if_absent)
                               : store_->PutFile(peer, key, tmp.get(), size);
    CKPT_KILL_POINT("replica.stored");
    if (absl::IsResourceExhausted(s)) return Refuse("full", s);
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
    absl::StatusOr<std::string> data = store_->Get(req->key(), req->max_bytes());
    if (!data.ok()) return ToGrpc(data.status());
    v1::DataChunk chunk;
    chunk.set_size(data->size());
    size_t off = 0;
    do {
      const size_t n = std::min<size_t>(options_.chunk_bytes, data->size() - off);
      chunk.set_data(data->data() + off, n);
      off += n;
      if (!writer->Write(chunk)) return grpc::Status(grpc::StatusCode::CANCELLED, "peer left");
      chunk.clear_size();
    } while (off < data->size());
    return grpc::Status::OK;
  }

  grpc::Status List(grpc::ServerContext* ctx, const v1::ListRequest* req,
                    v1::ListReply* reply) override {
    std::string peer;
    if (grpc::Status s = Authenticate(ctx, &peer); !s.ok()) return s;
    absl::StatusOr<std::vector<remote::ObjectInfo>> objects = store_->List(req->prefix());
    if (!objects.ok()) return ToGrpc(objects.status());
    for (const remote::ObjectInfo& o : *objects) {
      v1::ObjectEntry* e = reply->add_objects();
      e->set_key(o.key);
      e->set_size(o.size);
    }
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

  const ReplicaServerOptions options_;
  ReplicaStore* const store_;
  Metrics* const metrics_;
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
