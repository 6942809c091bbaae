#include "ckpt/client.h"

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <cerrno>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/dtype.h"
#include "base/handover_wire.h"
#include "base/logging.h"
#include "base/region.h"
#include "base/status.h"
#include "ckpt/v1/ckpt.grpc.pb.h"
#include "client_internal.h"
#include "gpu_export.h"

namespace ckpt {
namespace {

// Whether a status the gRPC runtime made (not ckptd: no details) means the
// call did not reach a ckptd that answers: cancelled as the server stopped,
// a connection reset or broken mid-call.
bool RuntimeLostTheCall(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::CANCELLED:
    case grpc::StatusCode::UNKNOWN:
    case grpc::StatusCode::INTERNAL:
    case grpc::StatusCode::ABORTED:
    case grpc::StatusCode::UNAVAILABLE:
      return true;
    default:
      return false;
  }
}

bool DaemonLost(const absl::Status& s) {
  // UNAVAILABLE: the socket is gone. Not registered or a stale generation:
  // ckptd restarted and no longer knows this rank. Shutting down: ckptd is
  // going away.
  if (absl::IsUnavailable(s)) return true;
  switch (ReasonOf(s)) {
    case ErrorReason::kNotRegistered:
    case ErrorReason::kStaleGeneration:
    case ErrorReason::kShuttingDown:
      return true;
    default:
      return false;
  }
}

// Every per-registration request names the job, the rank and the generation.
template <typename Request>
void Identify(const RankSpec& spec, uint64_t generation, Request* req) {
  req->set_job_id(spec.job_id);
  req->set_rank(spec.rank);
  req->set_generation(generation);
}

v1::WaitRequest WaitFor(const RankSpec& spec, uint64_t generation, uint64_t step) {
  v1::WaitRequest req;
  Identify(spec, generation, &req);
  req.set_step(step);
  return req;
}

void AddDrift(const std::vector<LayerSums>& sums,
              google::protobuf::RepeatedPtrField<v1::LayerDrift>* out) {
  for (const LayerSums& d : sums) {
    v1::LayerDrift* ld = out->Add();
    ld->set_dw2(d.dw2);
    ld->set_w2(d.w2);
  }
}

// The one conversion of a tensor the caller describes into the API's: the
// fields as given, nbytes from the shape and the element size.
v1::TensorSpec TensorSpecOf(const TensorDesc& t) {
  v1::TensorSpec ts;
  ts.set_name(t.name);
  ts.set_dtype(t.dtype);
  uint64_t elems = 1;
  for (uint64_t d : t.shape) {
    ts.add_shape(d);
    elems *= d;
  }
  ts.set_nbytes(elems * DTypeBytes(t.dtype));
  ts.set_role(t.role);
  ts.set_group(t.group);
  ts.set_region(t.region);
  ts.set_offset(t.offset);
  ts.set_param(t.param);
  ts.set_lr_scale(t.lr_scale);
  ts.set_beta1(t.beta1);
  ts.set_beta2(t.beta2);
  ts.set_eps(t.eps);
  ts.set_weight_decay(t.weight_decay);
  return ts;
}

}  // namespace

namespace internal {

// grpc::Status -> absl::Status, in one place on the client side: the code,
// the message, and the ErrorReason ckptd put in the status details. ckptd
// puts details in every error it answers; a transport status without them
// (gRPC's own CANCELLED for a call in flight when ckptd stopped, say) is the
// loss of ckptd, marked kShuttingDown like ckptd's own refusals.
absl::Status FromGrpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  absl::Status out(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
  v1::RpcStatus details;
  if (s.error_details().empty() || !details.ParseFromString(s.error_details())) {
    return RuntimeLostTheCall(s.error_code())
               ? WithReason(std::move(out), ErrorReason::kShuttingDown)
               : out;
  }
  for (const google::protobuf::Any& any : details.details()) {
    v1::ErrorInfo info;
    if (any.UnpackTo(&info) && info.reason() > 0 && info.reason() < kErrorReasonCount) {
      return WithReason(std::move(out), static_cast<ErrorReason>(info.reason()));
    }
  }
  return out;
}

void SetDeadline(grpc::ClientContext* ctx, absl::Duration timeout) {
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
}

}  // namespace internal

using internal::FromGrpc;
using internal::SetDeadline;

// ckpt.v1.DType carries the numbers of base/dtype.h's table (checked by
// tests/base/dtype_test.cc), so a value is a row's number or has no row.
uint64_t DTypeBytes(v1::DType dtype) { return ElementBytes(static_cast<DType>(dtype)); }

Client::Client(const ClientOptions& options) : options_(options), impl_(new Impl) {}
Client::~Client() = default;

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  std::unique_ptr<Client> c(new Client(options));
  if (c->options_.handover_socket_path.empty()) {
    c->options_.handover_socket_path = c->options_.socket_path + ".fds";
  }
  c->impl_->Reconnect(c->options_.socket_path);
  return c;
}

absl::StatusOr<size_t> Client::AllocateRegion(uint64_t bytes) {
  if (registered_) return absl::FailedPreconditionError("allocate regions before Register");
  if (impl_->gpu != nullptr) {
    return absl::FailedPreconditionError(
        "this rank already has GPU tensors; a rank registers "
        "host regions or GPU tensors, not both");
  }
  CKPT_ASSIGN_OR_RETURN(
      MemfdRegion r,
      MemfdRegion::Create(absl::StrCat("ckpt-region-", impl_->regions.size()), bytes));
  impl_->regions.push_back(std::move(r));
  return impl_->regions.size() - 1;
}

void* Client::RegionData(size_t region) const { return impl_->regions.at(region).data(); }
uint64_t Client::RegionSize(size_t region) const { return impl_->regions.at(region).size(); }

absl::StatusOr<Client::GpuPlace> Client::AddGpuTensor(const void* ptr, uint64_t bytes,
                                                      const std::string& name) {
  if (registered_) return absl::FailedPreconditionError("add GPU tensors before Register");
  if (!impl_->regions.empty()) {
    return absl::FailedPreconditionError(
        "this rank already has host regions; a rank registers "
        "host regions or GPU tensors, not both");
  }
  if (impl_->gpu == nullptr) {
    CKPT_ASSIGN_OR_RETURN(impl_->gpu, internal::GpuExport::Create());
  }
  CKPT_ASSIGN_OR_RETURN(auto place, impl_->gpu->Add(ptr, bytes, name));
  return GpuPlace{place.first, place.second};
}

absl::Status Client::Register(const RankSpec& spec) {
  if (impl_->regions.empty() && (impl_->gpu == nullptr || impl_->gpu->empty())) {
    return absl::FailedPreconditionError("no regions allocated and no GPU tensors added");
  }
  spec_ = spec;
  return DoRegister(options_.call_timeout);
}

absl::Status Client::DoRegister(absl::Duration wait_for_daemon) {
  v1::RegisterRequest req;
  if (impl_->gpu != nullptr) {
    const std::string& socket = options_.handover_socket_path;
    CKPT_ASSIGN_OR_RETURN(*req.mutable_gpu(), impl_->gpu->Handover([&](absl::Span<const int> fds) {
      return HandOverFds(socket, fds, wait_for_daemon, HandoverKind::kCudaPages);
    }));
  } else {
    std::vector<int> fds;
    for (const MemfdRegion& r : impl_->regions) fds.push_back(r.fd());
    CKPT_ASSIGN_OR_RETURN(std::string token,
                          HandOverFds(options_.handover_socket_path, fds, wait_for_daemon));
    req.set_handover_token(token);
  }
  req.set_job_id(spec_.job_id);
  req.set_rank(spec_.rank);
  req.set_world_size(spec_.world_size);
  for (const std::string& n : spec_.job_nodes) req.add_job_nodes(n);
  *req.mutable_policy() = spec_.policy;
  for (size_t i = 0; i < spec_.layers.size(); ++i) {
    const LayerDesc& l = spec_.layers[i];
    v1::LayerSpec* ls = req.add_layers();
    ls->set_id(static_cast<uint32_t>(i));
    ls->set_name(l.name);
    ls->set_kind(l.kind);
    ls->set_frozen(l.frozen);
    for (const TensorDesc& t : l.tensors) *ls->add_tensors() = TensorSpecOf(t);
  }
  // The handover just reached the daemon; give the gRPC channel the same
  // chance to connect instead of failing fast from reconnect backoff.
  if (!impl_->channel->WaitForConnected(absl::ToChronoTime(absl::Now() + wait_for_daemon))) {
    return absl::UnavailableError(
        "ckptd accepted the handover but its gRPC socket did not connect");
  }
  grpc::ClientContext ctx;
  // A first registration may wait (bounded, server side) for a previous
  // registration of the rank to drain; a re-registration from inside a
  // training step is bounded by the call timeout.
  SetDeadline(&ctx,
              registered_ ? options_.call_timeout : options_.call_timeout + absl::Seconds(60));
  v1::RegisterReply reply;
  CKPT_RETURN_IF_ERROR(FromGrpc(impl_->stub->Register(&ctx, req, &reply)));
  registered_ = true;
  generation_ = reply.generation();
  latest_durable_at_register_ = reply.latest_durable_step();
  registered_after_step_ = last_step_;
  io_backend_ = reply.io_backend();
  if (unprotected_) {
    CKPT_LOG(WARNING) << "ckptd is back: job " << spec_.job_id << " rank " << spec_.rank
                      << " re-registered (generation " << generation_ << "); protected again";
  }
  unprotected_ = false;
  return absl::OkStatus();
}

absl::Status Client::OnCallError(const absl::Status& s, bool* reregistered) {
  *reregistered = false;
  if (!DaemonLost(s)) return s;
  if (!unprotected_) {
    CKPT_LOG(WARNING) << "ckptd unreachable or restarted (" << s << "); "
                      << (options_.on_daemon_loss == OnDaemonLoss::kContinueUnprotected
                              ? "training continues UNPROTECTED until it is back"
                              : "calls fail until it is back");
  }
  unprotected_ = true;
  if (absl::Now() >= next_reconnect_) {
    impl_->Reconnect(options_.socket_path);
    absl::Status r = DoRegister(std::min(options_.call_timeout, absl::Seconds(2)));
    // The next attempt is counted from the end of this one, so a hung daemon
    // costs a training step at most one bounded attempt per interval.
    next_reconnect_ = absl::Now() + options_.reconnect_interval;
    if (r.ok()) {
      *reregistered = true;
      return absl::OkStatus();
    }
    // A refusal of the spec is reported; anything else (the daemon died
    // again mid-registration, timed out) means it is still not back.
    if (absl::IsInvalidArgument(r) || absl::IsPermissionDenied(r) ||
        absl::IsFailedPrecondition(r) || absl::IsResourceExhausted(r)) {
      return r;
    }
  }
  if (options_.on_daemon_loss == OnDaemonLoss::kContinueUnprotected) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat("ckptd unavailable: ", s.message()));
}

absl::Status Client::StepDone(uint64_t step, double lr, const std::string& aux,
                              const std::vector<uint32_t>& layers,
                              const std::vector<v1::GroupStep>& group_steps) {
  StepInfo info;
  info.step = step;
  info.lr = lr;
  info.aux = aux;
  info.layers = layers;
  info.group_steps = group_steps;
  return StepDone(info);
}

absl::Status Client::StepDone(const StepInfo& info) {
  if (!registered_) return absl::FailedPreconditionError("Register first");
  last_step_ = info.step;
  // The daemon's copies wait for this event on the GPU, not for the host.
  if (impl_->gpu != nullptr) CKPT_RETURN_IF_ERROR(impl_->gpu->RecordStep(cuda_stream_));
  for (int attempt = 0; attempt < 2; ++attempt) {
    v1::StepDoneRequest req;
    Identify(spec_, generation_, &req);
    req.set_step(info.step);
    req.set_lr(info.lr);
    req.set_aux(info.aux);
    for (uint32_t l : info.layers) req.add_layers(l);
    for (const v1::GroupStep& g : info.group_steps) *req.add_group_steps() = g;
    AddDrift(info.client_drift, req.mutable_client_drift());
    if (info.global_durable_step.has_value())
      req.set_global_durable_step(*info.global_durable_step);
    grpc::ClientContext ctx;
    SetDeadline(&ctx, options_.call_timeout);
    v1::StepDoneReply reply;
    absl::Status s = FromGrpc(impl_->stub->StepDone(&ctx, req, &reply));
    if (s.ok()) return s;
    bool rereg = false;
    absl::Status handled = OnCallError(s, &rereg);
    if (!rereg) return handled;
    registered_after_step_ = info.step - 1;  // this step goes to the new registration
  }
  return absl::UnavailableError("ckptd kept failing");
}

absl::StatusOr<std::vector<LayerSums>> Client::DriftPartials(uint64_t step) {
  if (!registered_) return absl::FailedPreconditionError("Register first");
  const v1::WaitRequest req = WaitFor(spec_, generation_, step);
  grpc::ClientContext ctx;
  SetDeadline(&ctx, options_.wait_timeout);
  v1::DriftReply reply;
  if (absl::Status s = FromGrpc(impl_->stub->DriftPartials(&ctx, req, &reply)); !s.ok()) {
    return NoteDriftError(s);
  }
  std::vector<LayerSums> out;
  for (const v1::LayerDrift& d : reply.layers()) out.push_back(LayerSums{d.dw2(), d.w2()});
  return out;
}

absl::Status Client::SetGlobalDrift(uint64_t step, const std::vector<LayerSums>& global) {
  if (!registered_) return absl::FailedPreconditionError("Register first");
  v1::GlobalDriftRequest req;
  Identify(spec_, generation_, &req);
  req.set_step(step);
  AddDrift(global, req.mutable_layers());
  grpc::ClientContext ctx;
  SetDeadline(&ctx, options_.call_timeout);
  v1::GlobalDriftReply reply;
  absl::Status s = FromGrpc(impl_->stub->SetGlobalDrift(&ctx, req, &reply));
  return s.ok() ? s : NoteDriftError(s);
}

absl::Status Client::NoteDriftError(const absl::Status& s) {
  // A lost daemon is noted like in every other call (unprotected(), the
  // reconnect); the exchange itself has no result to give, so the error
  // is returned in both loss modes.
  bool reregistered = false;
  OnCallError(s, &reregistered).IgnoreError();
  return s;
}

absl::Status Client::ExchangeDrift(
    uint64_t step, const std::function<absl::Status(std::vector<double>*)>& allreduce_sum) {
  CKPT_ASSIGN_OR_RETURN(std::vector<LayerSums> partial, DriftPartials(step));
  std::vector<double> flat;
  for (const LayerSums& s : partial) {
    flat.push_back(s.dw2);
    flat.push_back(s.w2);
  }
  CKPT_RETURN_IF_ERROR(allreduce_sum(&flat));
  if (flat.size() != 2 * partial.size()) {
    return absl::InvalidArgumentError("the all-reduce changed the vector's length");
  }
  std::vector<LayerSums> global(partial.size());
  for (size_t i = 0; i < global.size(); ++i) global[i] = LayerSums{flat[2 * i], flat[2 * i + 1]};
  return SetGlobalDrift(step, global);
}

absl::StatusOr<SnapshotInfo> Client::WaitSnapshot(uint64_t step) {
  SnapshotInfo info;
  if (!registered_) return absl::FailedPreconditionError("Register first");
  if (step <= registered_after_step_) {  // reported before a daemon restart
    info.lost = true;
    return info;
  }
  const v1::WaitRequest req = WaitFor(spec_, generation_, step);
  grpc::ClientContext ctx;
  SetDeadline(&ctx, options_.wait_timeout);
  v1::WaitSnapshotReply reply;
  absl::Status s = FromGrpc(impl_->stub->WaitSnapshot(&ctx, req, &reply));
  if (!s.ok()) {
    bool rereg = false;
    absl::Status handled = OnCallError(s, &rereg);
    if (rereg || handled.ok()) {
      // The fence has nothing to wait for: the daemon holds no snapshot.
      info.lost = true;
      return info;
    }
    return handled;
  }
  info.layers.assign(reply.layers().begin(), reply.layers().end());
  info.skipped = reply.skipped();
  return info;
}

absl::StatusOr<uint64_t> Client::WaitDurable(uint64_t step, Tier tier) {
  const bool remote = tier != Tier::kLocal;
  if (!registered_) return absl::FailedPreconditionError("Register first");
  if (step <= registered_after_step_ && !remote) {
    // Reported to an earlier registration: durable exactly when the daemon
    // said so at registration (a restored target always is).
    if (step <= latest_durable_at_register_) return latest_durable_at_register_;
    return absl::AbortedError(
        absl::StrCat("step ", step, " was reported before ckptd restarted; it is not durable"));
  }
  v1::WaitRequest req = WaitFor(spec_, generation_, step);
  if (tier == Tier::kRemote) req.set_tier(v1::TIER_REMOTE);
  if (tier == Tier::kPeer) req.set_tier(v1::TIER_PEER);
  grpc::ClientContext ctx;
  SetDeadline(&ctx, options_.wait_timeout);
  v1::WaitDurableReply reply;
  absl::Status s = FromGrpc(impl_->stub->WaitDurable(&ctx, req, &reply));
  if (!s.ok()) {
    bool rereg = false;
    absl::Status handled = OnCallError(s, &rereg);
    if (DaemonLost(s)) {
      return absl::AbortedError(
          absl::StrCat("ckptd was lost before step ", step, " became durable"));
    }
    return handled;
  }
  return reply.durable_step();
}

absl::StatusOr<std::string> Client::Node() {
  grpc::ClientContext ctx;
  SetDeadline(&ctx, options_.call_timeout);
  v1::StatusReply reply;
  CKPT_RETURN_IF_ERROR(FromGrpc(impl_->admin->Status(&ctx, v1::StatusRequest(), &reply)));
  return reply.node();
}

absl::StatusOr<v1::RestoreReply> Client::Restore(uint64_t target_step, bool discard_later,
                                                 uint64_t older_within_steps) {
  if (!registered_) return absl::FailedPreconditionError("Register first");
  v1::RestoreRequest req;
  Identify(spec_, generation_, &req);
  req.set_target_step(target_step);
  req.set_discard_later(discard_later);
  req.set_older_within_steps(older_within_steps);
  grpc::ClientContext ctx;
  SetDeadline(&ctx, options_.restore_timeout);
  v1::RestoreReply reply;
  CKPT_RETURN_IF_ERROR(FromGrpc(impl_->stub->Restore(&ctx, req, &reply)));
  last_step_ = reply.plan().target_step();
  registered_after_step_ = last_step_;
  return reply;
}

absl::Status Client::Unregister(bool drain) {
  if (!registered_) return absl::OkStatus();
  v1::UnregisterRequest req;
  Identify(spec_, generation_, &req);
  req.set_drain(drain);
  grpc::ClientContext ctx;
  SetDeadline(&ctx, options_.wait_timeout);
  v1::UnregisterReply reply;
  absl::Status s = FromGrpc(impl_->stub->Unregister(&ctx, req, &reply));
  registered_ = false;
  // A lost ckptd holds no registration of this rank any more (a restarted one
  // never had it): with kContinueUnprotected there is nothing left to undo.
  if (DaemonLost(s) && options_.on_daemon_loss == OnDaemonLoss::kContinueUnprotected) {
    return absl::OkStatus();
  }
  // The reason stays: a caller tells "ckptd is gone" from "another
  // registration of the rank replaced this one".
  if (DaemonLost(s)) {
    return WithReason(absl::UnavailableError(absl::StrCat("ckptd unavailable: ", s.message())),
                      ReasonOf(s));
  }
  return s;
}

}  // namespace ckpt
