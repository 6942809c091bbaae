#include "daemon/rpc/convert.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/status.h"

namespace ckpt {
namespace {

// The daemon's enums carry the API's numbers (base/dtype.h,
// daemon/common/tensor_types.h), so converting is a cast; an unknown API value
// stays unknown and validation names it. The highest numbers are checked
// here; every name and number by tests/base/dtype_test.cc and
// tests/daemon/common/tensor_types_test.cc.
static_assert(v1::DType_MIN == 0 && v1::DType_MAX == kMaxDTypeNumber,
              "ckpt.v1.DType and base/dtype.h differ");
static_assert(v1::TensorRole_MIN == 0 && v1::TensorRole_MAX == kMaxTensorRoleNumber,
              "ckpt.v1.TensorRole and daemon/common/tensor_types.h differ");
static_assert(v1::LayerKind_MIN == 0 && v1::LayerKind_MAX == kMaxLayerKindNumber,
              "ckpt.v1.LayerKind and daemon/common/tensor_types.h differ");

DType DTypeOf(v1::DType dtype) { return static_cast<DType>(dtype); }
TensorRole RoleOf(v1::TensorRole role) { return static_cast<TensorRole>(role); }
LayerKind KindOf(v1::LayerKind kind) { return static_cast<LayerKind>(kind); }

absl::StatusOr<PolicyKind> PolicyKindOf(v1::PolicyKind kind) {
  switch (kind) {
    case v1::POLICY_UNSPECIFIED:  // the daemon's default
    case v1::POLICY_ALL:
      return PolicyKind::kAll;
    case v1::POLICY_EVERY_N:
      return PolicyKind::kEveryN;
    case v1::POLICY_EXPLICIT:
      return PolicyKind::kExplicit;
    case v1::POLICY_NONE:
      return PolicyKind::kNone;
    case v1::POLICY_LAYERCHECK:
      return PolicyKind::kLayerCheck;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("unknown policy kind ", static_cast<int>(kind)));
  }
}

absl::StatusOr<OptimizerKind> OptimizerKindOf(v1::OptimizerKind kind) {
  switch (kind) {
    case v1::OPTIMIZER_UNSPECIFIED:
      return OptimizerKind::kUnspecified;
    case v1::OPTIMIZER_ADAMW:
      return OptimizerKind::kAdamW;
    case v1::OPTIMIZER_ADAM:
      return OptimizerKind::kAdam;
    case v1::OPTIMIZER_SGD:
      return OptimizerKind::kSgd;
    case v1::OPTIMIZER_CLIENT:
      return OptimizerKind::kClient;
    default:
      return absl::InvalidArgumentError(absl::StrCat("unknown optimizer ", static_cast<int>(kind)));
  }
}

// Unset (zero) fields take LayerCheckConfig's defaults.
LayerCheckConfig LayerCheckOf(const v1::LayerCheckSpec& spec) {
  LayerCheckConfig c;
  if (spec.k0() > 0) c.k0 = spec.k0();
  if (spec.k0_embedding() > 0) c.k0_embedding = spec.k0_embedding();
  if (spec.k_floor() > 0) c.k_floor = spec.k_floor();
  if (spec.s_max() > 0) c.s_max = spec.s_max();
  if (spec.has_warmup()) c.warmup = spec.warmup();
  if (spec.warmup_interval() > 0) c.warmup_interval = spec.warmup_interval();
  c.full_every = spec.full_every();
  c.local_drift = spec.local_drift();
  const v1::WriteBudget& b = spec.budget();
  c.budget.bytes_per_step = b.bytes_per_step();
  c.budget.bytes_per_s = b.bytes_per_s();
  c.budget.share = b.share();
  c.budget.step_s = b.step_s();
  if (b.k_min() != 0) c.budget.k_min = b.k_min();  // a negative one is refused by Validate
  if (b.k_max() != 0) c.budget.k_max = b.k_max();
  if (b.horizon() > 0) c.budget.horizon = b.horizon();
  c.budget.layer_bytes.assign(b.layer_bytes().begin(), b.layer_bytes().end());
  return c;
}

TensorDesc TensorOf(const v1::TensorSpec& t) {
  TensorDesc d;
  d.name = t.name();
  d.dtype = DTypeOf(t.dtype());
  d.shape.assign(t.shape().begin(), t.shape().end());
  d.nbytes = t.nbytes();
  d.role = RoleOf(t.role());
  d.region = t.region();
  d.offset = t.offset();
  d.group = t.group();
  d.param = t.param();
  d.lr_scale = t.lr_scale();
  d.beta1 = t.beta1();
  d.beta2 = t.beta2();
  d.eps = t.eps();
  d.weight_decay = t.weight_decay();
  return d;
}

}  // namespace

absl::StatusOr<Registration> RegistrationOf(const v1::RegisterRequest& req) {
  Registration r;
  r.job = req.job_id();
  r.rank = req.rank();
  r.world_size = req.world_size();
  r.handover_token = req.handover_token();
  r.layers.reserve(static_cast<size_t>(req.layers_size()));
  for (const v1::LayerSpec& l : req.layers()) {
    LayerDesc& d = r.layers.emplace_back();
    d.id = l.id();
    d.name = l.name();
    d.kind = KindOf(l.kind());
    d.frozen = l.frozen();
    d.tensors.reserve(static_cast<size_t>(l.tensors_size()));
    for (const v1::TensorSpec& t : l.tensors()) d.tensors.push_back(TensorOf(t));
  }
  const v1::PolicySpec& p = req.policy();
  CKPT_ASSIGN_OR_RETURN(r.policy.selection.kind, PolicyKindOf(p.kind()));
  r.policy.selection.every_n = p.every_n();
  CKPT_ASSIGN_OR_RETURN(r.policy.optimizer, OptimizerKindOf(p.optimizer()));
  r.policy.layercheck = LayerCheckOf(p.layercheck());
  r.policy.record_trace = p.record_trace();
  if (req.has_gpu()) r.gpu = GpuHandoverOf(req.gpu());
  r.job_nodes.assign(req.job_nodes().begin(), req.job_nodes().end());
  return r;
}

GpuHandover GpuHandoverOf(const v1::GpuHandover& gpu) {
  GpuHandover g;
  g.device_uuid = gpu.device_uuid();
  g.step_event = gpu.step_event();
  g.regions.reserve(static_cast<size_t>(gpu.regions_size()));
  for (const v1::GpuRegion& region : gpu.regions()) {
    GpuRegion r{region.ipc_handle(), region.bytes(), {}};
    r.pages.reserve(static_cast<size_t>(region.pages_size()));
    for (const v1::GpuPage& p : region.pages()) {
      r.pages.push_back(GpuPage{p.fd(), p.fabric_handle(), p.bytes()});
    }
    g.regions.push_back(std::move(r));
  }
  g.page_tokens.assign(gpu.page_tokens().begin(), gpu.page_tokens().end());
  return g;
}

v1::RegisterReply ToProto(const Registered& registered) {
  v1::RegisterReply reply;
  reply.set_generation(registered.generation);
  reply.set_latest_durable_step(registered.latest_durable_step);
  reply.set_io_backend(registered.io_backend);
  return reply;
}

v1::RestoreReply ToProto(const Restored& restored) {
  v1::RestoreReply reply;
  *reply.mutable_plan() = ToApi(restored.plan);
  for (int i = 0; i < reply.plan().layers_size(); ++i) {
    const auto at = static_cast<size_t>(i);
    v1::LayerPlan* lp = reply.mutable_plan()->mutable_layers(i);
    if (at < restored.from_memory.size() && lp->has_version()) {
      auto repaired = restored.repaired_from.find(lp->layer());
      lp->set_source(restored.from_memory[at]                   ? "memory"
                     : repaired != restored.repaired_from.end() ? repaired->second
                                                                : "disk");
    }
  }
  reply.set_bytes_restored(restored.bytes);
  reply.set_seconds(restored.seconds);
  reply.set_bytes_from_memory(restored.memory_bytes);
  return reply;
}

v1::DeleteJobReply ToProto(const JobDeleted& deleted) {
  v1::DeleteJobReply reply;
  reply.set_ranks(deleted.ranks);
  reply.set_versions_deleted(deleted.versions);
  reply.set_bytes_deleted(deleted.bytes);
  reply.set_events_deleted(deleted.events);
  return reply;
}

StepReport StepReportOf(const v1::StepDoneRequest& req) {
  StepReport r;
  r.rank = RankRefOf(req);
  r.step = req.step();
  r.lr = req.lr();
  r.aux = req.aux();
  r.layers.assign(req.layers().begin(), req.layers().end());
  for (const v1::GroupStep& g : req.group_steps()) r.group_steps.push_back({g.group(), g.step()});
  r.client_drift = LayerSumsOf(req.client_drift());
  if (req.has_global_durable_step()) r.global_durable_step = req.global_durable_step();
  return r;
}

std::vector<drift::LayerSums> LayerSumsOf(
    const google::protobuf::RepeatedPtrField<v1::LayerDrift>& layers) {
  std::vector<drift::LayerSums> sums;
  sums.reserve(static_cast<size_t>(layers.size()));
  for (const v1::LayerDrift& d : layers) sums.push_back(drift::LayerSums{d.dw2(), d.w2()});
  return sums;
}

absl::Time WaitDeadline(const v1::WaitRequest& req, absl::Time call_deadline) {
  if (req.timeout_ms() == 0) return call_deadline;
  return std::min(call_deadline, absl::Now() + absl::Milliseconds(req.timeout_ms()));
}

v1::WaitSnapshotReply ToProto(const SnapshotTaken& taken) {
  v1::WaitSnapshotReply reply;
  for (uint32_t l : taken.layers) reply.add_layers(l);
  reply.set_skipped(taken.skipped);
  return reply;
}

v1::DriftReply DriftReplyOf(uint64_t step, const std::vector<drift::LayerSums>& sums) {
  v1::DriftReply reply;
  reply.set_step(step);
  for (const drift::LayerSums& s : sums) {
    v1::LayerDrift* d = reply.add_layers();
    d->set_dw2(s.dw2);
    d->set_w2(s.w2);
  }
  return reply;
}

std::string_view TierName(v1::DurabilityTier tier) {
  switch (tier) {
    case v1::TIER_REMOTE:
      return "remote";
    case v1::TIER_PEER:
      return "peer";
    default:
      return {};
  }
}

}  // namespace ckpt
