#include "daemon/rpc/server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/server_posix.h>
#include <grpcpp/support/server_interceptor.h>
#include <malloc.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/types/span.h"
#include "base/logging.h"
#include "base/status.h"
#include "ckpt/v1/ckpt.grpc.pb.h"
#include "daemon/common/accept_backoff.h"
#include "daemon/common/kill_point.h"
#include "daemon/common/sync_point.h"
#include "daemon/rpc/call_entry.h"
#include "daemon/rpc/convert.h"
#include "daemon/rpc/status_convert.h"

namespace ckpt {
namespace {

using rpc_internal::CallKey;
using rpc_internal::Weight;
using rpc_internal::WithCaller;

// Waits without a client deadline are bounded by this.
constexpr absl::Duration kDefaultWait = absl::Seconds(30);

absl::Time DeadlineOf(const grpc::ServerContext& ctx) {
  absl::Time d = absl::FromChrono(ctx.deadline());
  absl::Time cap = absl::Now() + kDefaultWait;
  return d < cap ? d : cap;
}

// Tells the server when a call's request has been freed: the sync server
// destroys the request right after the handler returns, then sends the
// status, which passes this hook on the handler's thread.
class FinishCallInterceptor final : public grpc::experimental::Interceptor {
 public:
  FinishCallInterceptor(RpcServer* server, grpc::experimental::ServerRpcInfo* info)
      : server_(server), info_(info) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      server_->FinishCall(CallKey(info_->server_context()));
    }
    methods->Proceed();
  }

 private:
  RpcServer* const server_;
  grpc::experimental::ServerRpcInfo* const info_;
};

class FinishCallInterceptorFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit FinishCallInterceptorFactory(RpcServer* server) : server_(server) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new FinishCallInterceptor(server_, info);
  }

 private:
  RpcServer* const server_;
};

template <typename T>
absl::Status Assign(absl::StatusOr<T> v, T* out) {
  if (!v.ok()) return v.status();
  *out = std::move(*v);
  return absl::OkStatus();
}

// Plan is served by both services.
grpc::Status PlanCall(RpcServer* server, grpc::ServerContext* ctx, const v1::PlanRequest& req,
                      v1::Plan* reply) {
  return WithCaller(server, ctx, req, [&](const Caller& c) -> absl::Status {
    CKPT_ASSIGN_OR_RETURN(CompositePlan plan,
                          server->engine()->Plan(req.job_id(), req.rank(), req.target_step(), c,
                                                 req.older_within_steps()));
    *reply = ToApi(plan);
    return absl::OkStatus();
  });
}

class TrainerService final : public v1::Trainer::Service {
 public:
  explicit TrainerService(RpcServer* server) : s_(server) {}

  grpc::Status Register(grpc::ServerContext* ctx, const v1::RegisterRequest* req,
                        v1::RegisterReply* reply) override {
    std::vector<std::string> tokens(req->gpu().page_tokens().begin(),
                                    req->gpu().page_tokens().end());
    if (!req->handover_token().empty()) tokens.push_back(req->handover_token());
    return WithCaller(
        s_, ctx, *req,
        [&](const Caller& c) -> absl::Status {
          // GPU registrations carry their IPC handles in the request itself.
          // The token is claimed first, so a refused request releases its
          // descriptors now rather than when the token expires; the claim keeps
          // them counted against the caller's handover limits for as long as
          // they are held: the registration keeps the claim with its memory.
          HandoverClaim claim;
          if (!req->has_gpu() || !req->handover_token().empty()) {
            CKPT_ASSIGN_OR_RETURN(claim, s_->handover()->Claim(req->handover_token(), c.uid));
          }
          // Or a GPU handover's page descriptors, in token order (GpuPage.fd).
          if (req->has_gpu() && req->gpu().page_tokens_size() > 0) {
            const std::vector<std::string> tokens(req->gpu().page_tokens().begin(),
                                                  req->gpu().page_tokens().end());
            CKPT_ASSIGN_OR_RETURN(
                HandoverClaim pages,
                s_->handover()->ClaimAll(tokens, c.uid, HandoverKind::kCudaPages));
            if (claim.fds().empty()) claim = std::move(pages);
          }
          CKPT_ASSIGN_OR_RETURN(Registration registration, RegistrationOf(*req));
          registration.deadline = DeadlineOf(*ctx);
          std::vector<UniqueFd> fds = claim.TakeFds();
          CKPT_ASSIGN_OR_RETURN(
              Registered registered,
              s_->engine()->Register(registration, std::move(fds), c,
                                     std::make_unique<HandoverClaim>(std::move(claim))));
          *reply = ToProto(registered);
          return absl::OkStatus();
        },
        Weight::kRegister, tokens);
  }
  grpc::Status StepDone(grpc::ServerContext* ctx, const v1::StepDoneRequest* req,
                        v1::StepDoneReply*) override {
    // A test holds a StepDone here while ckptd stops under it, or has the
    // call cancelled as the runtime cancels one in flight when ckptd stops.
    CKPT_DELAY_POINT("rpc.step_done");
    if (CKPT_CANCEL_POINT("rpc.step_done")) {
      ctx->TryCancel();
      return grpc::Status::CANCELLED;
    }
    return WithCaller(s_, ctx, *req, [&](const Caller& c) {
      return s_->engine()->StepDone(StepReportOf(*req), c);
    });
  }
  grpc::Status WaitSnapshot(grpc::ServerContext* ctx, const v1::WaitRequest* req,
                            v1::WaitSnapshotReply* reply) override {
    return WithCaller(s_, ctx, *req, [&](const Caller& c) -> absl::Status {
      CKPT_ASSIGN_OR_RETURN(SnapshotTaken taken,
                            s_->engine()->WaitSnapshot(RankRefOf(*req), req->step(), c,
                                                       WaitDeadline(*req, DeadlineOf(*ctx))));
      *reply = ToProto(taken);
      return absl::OkStatus();
    });
  }
  grpc::Status WaitDurable(grpc::ServerContext* ctx, const v1::WaitRequest* req,
                           v1::WaitDurableReply* reply) override {
    return WithCaller(s_, ctx, *req, [&](const Caller& c) -> absl::Status {
      CKPT_ASSIGN_OR_RETURN(
          uint64_t durable,
          s_->engine()->WaitDurable(RankRefOf(*req), req->step(), c,
                                    WaitDeadline(*req, DeadlineOf(*ctx)), TierName(req->tier())));
      reply->set_durable_step(durable);
      return absl::OkStatus();
    });
  }
  grpc::Status DriftPartials(grpc::ServerContext* ctx, const v1::WaitRequest* req,
                             v1::DriftReply* reply) override {
    return WithCaller(s_, ctx, *req, [&](const Caller& c) -> absl::Status {
      CKPT_ASSIGN_OR_RETURN(std::vector<drift::LayerSums> sums,
                            s_->engine()->DriftPartials(RankRefOf(*req), req->step(), c,
                                                        WaitDeadline(*req, DeadlineOf(*ctx))));
      *reply = DriftReplyOf(req->step(), sums);
      return absl::OkStatus();
    });
  }
  grpc::Status SetGlobalDrift(grpc::ServerContext* ctx, const v1::GlobalDriftRequest* req,
                              v1::GlobalDriftReply*) override {
    return WithCaller(s_, ctx, *req, [&](const Caller& c) {
      return s_->engine()->SetGlobalDrift(RankRefOf(*req), req->step(), LayerSumsOf(req->layers()),
                                          c);
    });
  }
  grpc::Status Plan(grpc::ServerContext* ctx, const v1::PlanRequest* req,
                    v1::Plan* reply) override {
    return PlanCall(s_, ctx, *req, reply);
  }
  grpc::Status Restore(grpc::ServerContext* ctx, const v1::RestoreRequest* req,
                       v1::RestoreReply* reply) override {
    return WithCaller(s_, ctx, *req, [&](const Caller& c) -> absl::Status {
      CKPT_ASSIGN_OR_RETURN(Restored restored,
                            s_->engine()->Restore(RankRefOf(*req), req->target_step(), c,
                                                  req->discard_later(), req->older_within_steps()));
      *reply = ToProto(restored);
      return absl::OkStatus();
    });
  }
  grpc::Status Unregister(grpc::ServerContext* ctx, const v1::UnregisterRequest* req,
                          v1::UnregisterReply*) override {
    return WithCaller(s_, ctx, *req, [&](const Caller& c) {
      return s_->engine()->Unregister(RankRefOf(*req), req->drain(), c, DeadlineOf(*ctx));
    });
  }

 private:
  RpcServer* const s_;
};

class AdminService final : public v1::Admin::Service {
 public:
  explicit AdminService(RpcServer* server) : s_(server) {}

  grpc::Status Status(grpc::ServerContext* ctx, const v1::StatusRequest* req,
                      v1::StatusReply* reply) override {
    return WithCaller(s_, ctx, *req, [&](const Caller& c) {
      *reply = s_->engine()->GetStatus(c);
      return absl::OkStatus();
    });
  }
  grpc::Status Jobs(grpc::ServerContext* ctx, const v1::JobsRequest* req,
                    v1::JobsReply* reply) override {
    return WithCaller(s_, ctx, *req,
                      [&](const Caller& c) { return Assign(s_->engine()->Jobs(c), reply); });
  }
  grpc::Status Layers(grpc::ServerContext* ctx, const v1::LayersRequest* req,
                      v1::LayersReply* reply) override {
    return WithCaller(s_, ctx, *req, [&](const Caller& c) {
      return Assign(s_->engine()->Layers(*req, c), reply);
    });
  }
  grpc::Status History(grpc::ServerContext* ctx, const v1::HistoryRequest* req,
                       v1::HistoryReply* reply) override {
    return WithCaller(s_, ctx, *req, [&](const Caller& c) {
      return Assign(s_->engine()->History(*req, c), reply);
    });
  }
  grpc::Status Plan(grpc::ServerContext* ctx, const v1::PlanRequest* req,
                    v1::Plan* reply) override {
    return PlanCall(s_, ctx, *req, reply);
  }
  grpc::Status Verify(grpc::ServerContext* ctx, const v1::VerifyRequest* req,
                      v1::VerifyReply* reply) override {
    return WithCaller(
        s_, ctx, *req,
        [&](const Caller& c) { return Assign(s_->engine()->Verify(*req, c), reply); },
        Weight::kHeavy);
  }
  grpc::Status Gc(grpc::ServerContext* ctx, const v1::GcRequest* req, v1::GcReply* reply) override {
    return WithCaller(
        s_, ctx, *req, [&](const Caller& c) { return Assign(s_->engine()->Gc(*req, c), reply); },
        Weight::kHeavy);
  }
  grpc::Status Export(grpc::ServerContext* ctx, const v1::ExportRequest* req,
                      grpc::ServerWriter<v1::ExportChunk>* writer) override {
    const std::string* token = &req->region_token();
    return WithCaller(
        s_, ctx, *req,
        [&](const Caller& c) -> absl::Status {
          // A region to write into instead of the stream: one memfd of the
          // caller's, counted against its handover limits until the call ends.
          HandoverClaim claim;
          UniqueFd region;
          if (!req->region_token().empty()) {
            CKPT_ASSIGN_OR_RETURN(claim, s_->handover()->Claim(req->region_token(), c.uid));
            if (claim.fds().size() != 1) {
              return absl::InvalidArgumentError(absl::StrCat(
                  "an export's region_token must name one region, not ", claim.fds().size()));
            }
            region = std::move(claim.fds()[0]);
          }
          return s_->engine()->Export(
              *req, c,
              [&](const v1::ExportChunk& chunk) {
                return !ctx->IsCancelled() && writer->Write(chunk);
              },
              std::move(region));
        },
        Weight::kHeavy, absl::MakeSpan(token, token->empty() ? 0 : 1));
  }
  grpc::Status Config(grpc::ServerContext* ctx, const v1::ConfigRequest* req,
                      v1::ConfigReply* reply) override {
    return WithCaller(s_, ctx, *req, [&](const Caller&) {
      reply->set_text(s_->options().config_text);
      return absl::OkStatus();
    });
  }
  grpc::Status ReleaseRank(grpc::ServerContext* ctx, const v1::ReleaseRankRequest* req,
                           v1::ReleaseRankReply* reply) override {
    return WithCaller(s_, ctx, *req, [&](const Caller& c) -> absl::Status {
      if (req->evict()) {
        CKPT_ASSIGN_OR_RETURN(uint32_t released, s_->engine()->EvictJob(req->job_id(), c));
        reply->set_ranks_released(released);
        return absl::OkStatus();
      }
      CKPT_ASSIGN_OR_RETURN(uint64_t generation,
                            s_->engine()->ReleaseRank(req->job_id(), req->rank(), c));
      reply->set_generation(generation);
      reply->set_ranks_released(1);
      return absl::OkStatus();
    });
  }
  grpc::Status DeleteJob(grpc::ServerContext* ctx, const v1::DeleteJobRequest* req,
                         v1::DeleteJobReply* reply) override {
    return WithCaller(
        s_, ctx, *req,
        [&](const Caller& c) -> absl::Status {
          CKPT_ASSIGN_OR_RETURN(JobDeleted deleted, s_->engine()->DeleteJob(req->job_id(), c));
          *reply = ToProto(deleted);
          return absl::OkStatus();
        },
        Weight::kHeavy);
  }

 private:
  RpcServer* const s_;
};

}  // namespace

RpcServer::RpcServer(RpcServerOptions options, Engine* engine, HandoverServer* handover)
    : options_(std::move(options)), engine_(engine), handover_(handover) {}

RpcServer::~RpcServer() { Shutdown(absl::ZeroDuration()); }

absl::Status RpcServer::Start() {
  const std::string& path = options_.socket_path;
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  trainer_service_ = std::make_unique<TrainerService>(this);
  admin_service_ = std::make_unique<AdminService>(this);
  grpc::ServerBuilder builder;
  builder.SetMaxReceiveMessageSize(options_.max_message_bytes);
  builder.SetMaxSendMessageSize(options_.max_message_bytes);
  builder.RegisterService(trainer_service_.get());
  builder.RegisterService(admin_service_.get());
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> hooks;
  hooks.push_back(std::make_unique<FinishCallInterceptorFactory>(this));
  builder.experimental().SetInterceptorCreators(std::move(hooks));
  server_ = builder.BuildAndStart();
  if (server_ == nullptr) return absl::InternalError("gRPC server failed to start");
  CKPT_ASSIGN_OR_RETURN(listen_fd_, ListenUnixSocket(path, 0660));
  accept_thread_ = std::thread([this] { AcceptLoop(); });
  return absl::OkStatus();
}

void RpcServer::Shutdown(absl::Duration grace) {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  if (accept_thread_.joinable()) accept_thread_.join();
  IgnoreError(listen_fd_.Close(), "shutdown");
  if (server_ != nullptr) {
    server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
    server_->Wait();
  }
}

void RpcServer::AcceptLoop() {
  AcceptBackoff backoff(options_.accept_backoff, "RpcServer::AcceptBackoff");
  LogRateLimit refusal_log;
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
    }
    const absl::Time now = absl::Now();
    if (!backoff.Accepting(now)) {
      // Paused; Shutdown is still seen within 200 ms.
      absl::SleepFor(std::min(backoff.resume_at() - now, absl::Milliseconds(200)));
      continue;
    }
    struct pollfd pfd = {listen_fd_.get(), POLLIN, 0};
    if (::poll(&pfd, 1, 200) <= 0) continue;
    const int fd = ::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      const int err = errno;
      if (!AcceptBackoff::OutOfResources(err)) continue;  // EAGAIN, EINTR, ECONNABORTED...
      // No descriptor (or memory) for the connection: retrying at once would
      // spin on the same readable backlog, so pause accepting.
      size_t open = 0;
      {
        absl::MutexLock lock(&mu_);
        ++accept_errors_;
        open = peers_.size();
      }
      const AcceptBackoff::Pause pause = backoff.Fail(absl::Now());
      if (pause.log) {
        CKPT_LOG(WARNING) << "gRPC accept: " << std::strerror(err) << " (and " << pause.unlogged
                          << " failures since the last report); not accepting for "
                          << absl::FormatDuration(pause.length) << "; " << open
                          << " connections open";
      }
      continue;
    }
    backoff.Reset();
    UniqueFd conn(fd);
    absl::StatusOr<PeerCred> cred = GetPeerCred(conn.get());
    struct stat st;
    if (!cred.ok() || ::fstat(conn.get(), &st) != 0) continue;  // closes the connection
    std::string refusal;
    {
      absl::MutexLock lock(&mu_);
      PrunePeers();
      const uid_t uid = cred->uid;
      const int mine = static_cast<int>(std::count_if(
          peers_.begin(), peers_.end(), [uid](const auto& p) { return p.second.cred.uid == uid; }));
      if (mine >= options_.max_connections_per_uid) {
        refusal = absl::StrCat("uid ", uid, " has ", mine, " connections open (limit ",
                               options_.max_connections_per_uid, ", max_connections_per_uid)");
      } else if (peers_.size() >= static_cast<size_t>(options_.max_connections)) {
        refusal = absl::StrCat("ckptd has ", peers_.size(), " connections open (limit ",
                               options_.max_connections, ", max_connections)");
      }
      if (!refusal.empty()) {
        ++connections_refused_;
      } else {
        peers_[conn.get()] = Peer{*cred, st.st_ino};
      }
    }
    if (!refusal.empty()) {
      uint64_t unlogged = 0;
      if (refusal_log.Due(absl::Now(), &unlogged)) {
        CKPT_LOG(WARNING) << "gRPC connection of pid " << cred->pid << " closed: " << refusal
                          << " (and " << unlogged << " more since the last report)";
      }
      CKPT_SYNC_POINT("RpcServer::Refused");
      continue;  // `conn` closes: the client sees its connection closed
    }
    // gRPC owns the fd from here on and closes it with the connection.
    grpc::AddInsecureChannelFromFd(server_.get(), conn.release());
    CKPT_SYNC_POINT("RpcServer::Accepted");
  }
}

// Whether descriptor `fd` still names the socket with inode `ino`. Asked of
// /proc by path, never through the descriptor: gRPC may have closed it and
// another thread reused the number meanwhile.
static bool StillTheSocket(int fd, ino_t ino) {
  char link[64];
  const ssize_t n = ::readlink(absl::StrCat("/proc/self/fd/", fd).c_str(), link, sizeof(link));
  return n > 0 && absl::string_view(link, static_cast<size_t>(n)) ==
                      absl::StrCat("socket:[", static_cast<uint64_t>(ino), "]");
}

void RpcServer::PrunePeers() const {
  for (auto it = peers_.begin(); it != peers_.end();) {
    if (!StillTheSocket(it->first, it->second.ino)) {
      it = peers_.erase(it);
    } else {
      ++it;
    }
  }
}

RpcServer::ConnectionStats RpcServer::connection_stats() const {
  absl::MutexLock lock(&mu_);
  PrunePeers();
  ConnectionStats s;
  s.open = peers_.size();
  s.refused = connections_refused_;
  s.accept_errors = accept_errors_;
  return s;
}

absl::Status RpcServer::EnterCall(uid_t uid, bool heavy, bool large) {
  absl::MutexLock lock(&mu_);
  int& calls = calls_by_uid_[uid];
  if (calls >= options_.max_calls_per_uid) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "uid ", uid, " has ", calls, " calls in flight (max_calls_per_uid); retry later"));
  }
  if (heavy && heavy_calls_ >= options_.max_heavy_calls) {
    return absl::ResourceExhaustedError(absl::StrCat(
        heavy_calls_, " verify/export/gc calls are running (max_heavy_calls); retry later"));
  }
  if (large && large_calls_ >= options_.max_large_calls) {
    return absl::ResourceExhaustedError(
        absl::StrCat(large_calls_, " Register calls above max_request_bytes are running ",
                     "(max_large_calls); retry later"));
  }
  ++calls;
  if (heavy) ++heavy_calls_;
  if (large) ++large_calls_;
  return absl::OkStatus();
}

void RpcServer::LeaveCall(uid_t uid, bool heavy, bool large) {
  absl::MutexLock lock(&mu_);
  auto it = calls_by_uid_.find(uid);
  if (it != calls_by_uid_.end() && --it->second <= 0) calls_by_uid_.erase(it);
  if (heavy) --heavy_calls_;
  if (large) --large_calls_;
}

void RpcServer::NoteLargeRequest(const void* call) {
  absl::MutexLock lock(&mu_);
  large_requests_.insert(call);
}

bool RpcServer::FinishCall(const void* call) {
  {
    absl::MutexLock lock(&mu_);
    if (large_requests_.erase(call) == 0 || !large_requests_.empty()) return false;
    ++memory_releases_;
  }
  // glibc keeps freed memory in the arena of the thread that allocated it
  // (gRPC's reads and the request's parse run on several threads); this
  // returns the free pages of every arena to the kernel. It runs once per
  // burst of large requests: when the last one still unfinished finishes.
  ::malloc_trim(0);
  return true;
}

uint64_t RpcServer::memory_releases() const {
  absl::MutexLock lock(&mu_);
  return memory_releases_;
}

absl::StatusOr<Caller> RpcServer::CallerOf(const grpc::ServerContext& ctx) const {
  const std::string peer = ctx.peer();
  int fd = -1;
  if (!absl::StartsWith(peer, "fd:") || !absl::SimpleAtoi(absl::string_view(peer).substr(3), &fd)) {
    return absl::UnauthenticatedError("connection identity unknown");
  }
  absl::MutexLock lock(&mu_);
  auto it = peers_.find(fd);
  if (it == peers_.end()) return absl::UnauthenticatedError("connection identity unknown");
  Caller c;
  c.uid = it->second.cred.uid;
  c.pid = it->second.cred.pid;
  return c;
}

}  // namespace ckpt
