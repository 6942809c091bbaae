// LayerCheck in the engine: drift tasks, decisions, multi-rank drift.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/logging.h"
#include "base/status.h"
#include "daemon/common/kill_point.h"
#include "daemon/engine/engine.h"
#include "daemon/engine/rank_state.h"
#include "daemon/gpu/ipc_memory.h"
#include "nlohmann/json.hpp"

namespace ckpt {

namespace {

// A write budget's figures against the registration.
absl::Status CheckBudget(const LayerCheckConfig& config, const Registration& req) {
  if (!config.budget.enabled()) return absl::OkStatus();
  const LayerCheckBudget& b = config.budget;
  if (!b.layer_bytes.empty() && b.layer_bytes.size() != req.layers.size()) {
    return absl::InvalidArgumentError(absl::StrCat("layercheck budget: layer_bytes has ",
                                                   b.layer_bytes.size(), " entries; the rank has ",
                                                   req.layers.size(), " layers"));
  }
  if (req.world_size > 1 && !config.local_drift) {
    // Ranks that all-reduce their drift must compute the same multiplier.
    if (b.share > 0) {
      return absl::InvalidArgumentError(
          "layercheck budget: a share of the device's bandwidth is a figure of this node, "
          "and ranks that all-reduce their drift (world_size > 1) must derive the same budget; "
          "give bytes_per_s or bytes_per_step");
    }
    if (b.layer_bytes.empty()) {
      return absl::InvalidArgumentError(
          "layercheck budget with world_size > 1 needs layer_bytes, the same list on every "
          "rank (e.g. each layer's bytes over all ranks): the ranks' own shard sizes may "
          "differ, and so would their decisions");
    }
  }
  CKPT_LOG(INFO) << "job " << req.job << " rank " << req.rank << ": layercheck write budget "
                 << b.BytesPerStep() << " bytes per step, multiplier of K0 in [" << b.k_min << ", "
                 << b.k_max << "], horizon " << b.horizon << " steps";
  return absl::OkStatus();
}

// The drift kernel's element type of `t`; false for one it does not read.
// The one conversion into the kernels' numbering: base/dtype.h's drift code.
static_assert(DriftCode(DType::kF32) == static_cast<int>(drift::DType::kF32) &&
              DriftCode(DType::kBF16) == static_cast<int>(drift::DType::kBF16) &&
              DriftCode(DType::kF16) == static_cast<int>(drift::DType::kF16));
bool DriftDType(DType t, drift::DType* out) {
  if (DriftCode(t) == kNoDriftCode) return false;
  *out = static_cast<drift::DType>(DriftCode(t));
  return true;
}

// The optimizer state of layer tensor `w` (the tensors whose `param` names
// it), into `task`.
absl::Status AddOptimizerState(const LayerDesc& layer, const LayerTemplate& lt, const TensorDesc& w,
                               const std::string& where, drift::TensorTask* task) {
  for (size_t j = 0; j < layer.tensors.size(); ++j) {
    const TensorDesc& st = layer.tensors[j];
    if (st.param != w.name) continue;
    const void* p = lt.src[j];
    const bool m_role = st.role == TensorRole::kExpAvg || st.role == TensorRole::kMomentum;
    if (!m_role && st.role != TensorRole::kExpAvgSq) continue;
    if (st.nbytes / ElementBytes(st.dtype) != task->n) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": state '", st.name, "' has a different element count"));
    }
    drift::DType dt;
    if (!DriftDType(st.dtype, &dt)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": state '", st.name, "' must be f32, bf16 or f16"));
    }
    if (m_role) {
      task->m = p;
      task->m_dtype = dt;
    } else {
      task->v = p;
      task->v_dtype = dt;
    }
  }
  return absl::OkStatus();
}

// The drift task of weight tensor `i` of layer `l`.
absl::StatusOr<drift::TensorTask> DriftTaskOf(const LayerDesc& layer, const LayerTemplate& lt,
                                              size_t l, size_t i, OptimizerKind optimizer) {
  const TensorDesc& w = layer.tensors[i];
  const std::string where = absl::StrCat("layer ", l, " tensor '", w.name, "'");
  drift::TensorTask task;
  task.layer = static_cast<uint32_t>(l);
  task.n = w.nbytes / ElementBytes(w.dtype);
  task.w = lt.src[i];
  if (!DriftDType(w.dtype, &task.w_dtype)) {
    return absl::InvalidArgumentError(where + ": drift needs f32, bf16 or f16 weights");
  }
  task.beta1 = w.beta1 > 0 ? w.beta1 : 0.9;
  task.beta2 = w.beta2 > 0 ? w.beta2 : 0.999;
  task.eps = w.eps > 0 ? w.eps : 1e-8;
  task.weight_decay = w.weight_decay;
  CKPT_RETURN_IF_ERROR(AddOptimizerState(layer, lt, w, where, &task));
  switch (optimizer) {
    case OptimizerKind::kAdamW:
    case OptimizerKind::kAdam:
      if (task.m == nullptr || task.v == nullptr) {
        return absl::InvalidArgumentError(
            where + ": adam(w) drift needs exp_avg and exp_avg_sq tensors naming it in 'param'");
      }
      task.optimizer =
          optimizer == OptimizerKind::kAdamW ? drift::Optimizer::kAdamW : drift::Optimizer::kAdam;
      break;
    case OptimizerKind::kSgd:
      if (task.m == nullptr) {
        return absl::InvalidArgumentError(
            where + ": sgd drift needs a momentum tensor naming it in 'param'");
      }
      task.optimizer = drift::Optimizer::kSgd;
      break;
    default:
      return absl::InvalidArgumentError("unknown optimizer");
  }
  return task;
}

// The first line of the drift trace: the job, its layers and the policy.
nlohmann::json TraceHeader(const RankState& r, const Registration& req,
                           const LayerCheckConfig& config) {
  nlohmann::json header;
  header["job"] = r.job;
  header["rank"] = r.rank;
  nlohmann::json layers = nlohmann::json::array();
  for (const LayerDesc& layer : req.layers) {
    uint64_t bytes = 0;
    for (const TensorDesc& t : layer.tensors) bytes += t.nbytes;
    layers.push_back(
        {{"name", layer.name}, {"kind", static_cast<int>(layer.kind)}, {"bytes", bytes}});
  }
  header["layers"] = layers;
  header["config"] = {{"k0", config.k0},
                      {"k0_embedding", config.k0_embedding},
                      {"k_floor", config.k_floor},
                      {"s_max", config.s_max},
                      {"warmup", config.warmup},
                      {"warmup_interval", config.warmup_interval},
                      {"full_every", config.full_every}};
  if (config.budget.enabled()) {
    const LayerCheckBudget& b = config.budget;
    nlohmann::json budget = {{"bytes_per_step", b.BytesPerStep()},
                             {"k_min", b.k_min},
                             {"k_max", b.k_max},
                             {"horizon", b.horizon}};
    if (b.bytes_per_s > 0) budget["bytes_per_s"] = b.bytes_per_s;
    if (b.share > 0) budget["share"] = b.share;
    if (b.step_s > 0) budget["step_s"] = b.step_s;
    if (!b.layer_bytes.empty()) budget["layer_bytes"] = b.layer_bytes;
    header["config"]["budget"] = budget;
  }
  return header;
}

}  // namespace

absl::Status Engine::SetUpLayerCheck(const Registration& req, RankMemory* memory, RankState* r) {
  const RegistrationPolicy& spec = req.policy;
  LayerCheckConfig config = spec.layercheck;
  config.budget.device_write_bytes_per_s = static_cast<double>(options_.device_write_bytes_per_s);
  CKPT_RETURN_IF_ERROR(config.Validate());
  // What each layer counts for under a write budget: the bytes this rank
  // writes of it, unless the registration names them (layercheck.h).
  std::vector<uint64_t> layer_bytes;
  for (const LayerDesc& layer : req.layers) {
    uint64_t bytes = 0;
    for (const TensorDesc& t : layer.tensors) bytes += t.nbytes;
    layer_bytes.push_back(bytes);
  }
  CKPT_RETURN_IF_ERROR(CheckBudget(config, req));
  r->optimizer = spec.optimizer;
  if (r->optimizer == OptimizerKind::kUnspecified) {
    return absl::InvalidArgumentError(
        "policy layercheck needs an optimizer: adamw, adam, sgd or client");
  }
  // The drift kernel that can read the rank's memory.
  if (const auto* gpu = dynamic_cast<const GpuMemory*>(memory); gpu != nullptr) {
    CKPT_ASSIGN_OR_RETURN(r->own_drift_kernel, cuda_ipc_->MakeDriftKernel(gpu->device()));
    r->drift_kernel = r->own_drift_kernel.get();
  } else {
    r->drift_kernel = drift_kernel_.get();
  }
  std::vector<LayerKind> kinds;
  std::vector<bool> frozen;
  for (size_t l = 0; l < r->layers.size(); ++l) {
    const LayerDesc& layer = req.layers[l];
    kinds.push_back(layer.kind);
    frozen.push_back(layer.frozen);
    // A frozen layer has no drift (and usually no optimizer state).
    if (r->optimizer == OptimizerKind::kClient || layer.frozen) continue;
    bool has_master = false;
    for (const TensorDesc& t : layer.tensors) has_master |= t.role == TensorRole::kMaster;
    const TensorRole weight_role = has_master ? TensorRole::kMaster : TensorRole::kParam;
    for (size_t i = 0; i < layer.tensors.size(); ++i) {
      const TensorDesc& w = layer.tensors[i];
      if (w.role != weight_role) continue;
      CKPT_ASSIGN_OR_RETURN(drift::TensorTask task,
                            DriftTaskOf(layer, r->layers[l], l, i, r->optimizer));
      r->drift_tasks.push_back(task);
      r->drift_task_groups.push_back(w.group);
      r->drift_task_lr_scale.push_back(w.lr_scale > 0 ? w.lr_scale : 1.0);
    }
    if (r->drift_tasks.empty() || r->drift_tasks.back().layer != l) {
      return absl::InvalidArgumentError(absl::StrCat("layer ", l, " has no ",
                                                     has_master ? "master" : "param",
                                                     " tensor for drift accounting"));
    }
  }
  r->layercheck = std::make_unique<LayerCheckPolicy>(config, std::move(kinds), std::move(frozen),
                                                     std::move(layer_bytes));
  if (spec.record_trace) {
    CKPT_ASSIGN_OR_RETURN(r->trace, store_->OpenSideFile(r->job, r->rank, kDriftTraceFile));
    CKPT_RETURN_IF_ERROR(
        store_->AppendSideFile(r->trace.get(), TraceHeader(*r, req, config).dump() + "\n"));
  }
  return absl::OkStatus();
}

bool Engine::DecideLayerCheck(const std::shared_ptr<RankState>& r, SnapTask& task,
                              RankMemory* memory) {
  if (task.stage == SnapTask::Stage::kNew) {
    std::vector<drift::LayerSums> sums(r->layers.size());
    if (r->optimizer == OptimizerKind::kClient) {
      sums = task.client_drift;
    } else {
      std::vector<drift::TensorTask> tasks = r->drift_tasks;
      for (size_t i = 0; i < tasks.size(); ++i) {
        tasks[i].lr = task.lr * r->drift_task_lr_scale[i];
        tasks[i].step = task.step;
        for (const GroupStep& g : task.group_steps) {
          if (g.group == r->drift_task_groups[i]) tasks[i].step = g.step;
        }
      }
      std::string error;
      const absl::Time drift_start = absl::Now();
      const bool ok = r->drift_kernel->Compute(tasks, &sums, &error);
      if (options_.metrics != nullptr) {
        options_.metrics->Observe(Histogram::kDriftSeconds,
                                  absl::ToDoubleSeconds(absl::Now() - drift_start));
      }
      if (!ok) {
        CKPT_LOG(ERROR) << "drift kernel failed (" << error << "); persisting every layer";
        for (drift::LayerSums& s : sums) s = drift::LayerSums{1, 1};
      }
    }
    CKPT_KILL_POINT("snapshot.drift");
    task.global = std::move(sums);  // this rank's partial sums until SetGlobalDrift
    if (r->world_size > 1 && !r->local_drift) {
      task.stage = SnapTask::Stage::kAwaitingGlobal;
      return false;  // SnapshotLoop publishes them and parks the task
    }
    task.stage = SnapTask::Stage::kReady;
  }
  std::string trace_line;
  {
    absl::MutexLock lock(&r->mu);
    std::vector<LayerDecision> decisions =
        r->layercheck->Decide(task.step, task.lr, task.global, r->retry);
    task.layers.clear();
    const LayerCheckConfig& lc = r->layercheck->config();
    for (uint32_t l = 0; l < decisions.size(); ++l) {
      if (decisions[l].reason != PersistReason::kNone) task.layers.push_back(l);
      // The invariant (docs/layercheck.md): after the base checkpoint no layer's newest
      // selected version is S_max or more steps old. Checked, never expected.
      if (task.step >= lc.warmup && !r->layercheck->frozen(l) &&
          task.step - r->layercheck->last_persisted(l) >= lc.s_max) {
        CKPT_LOG(ERROR) << "staleness invariant broken: job " << r->job << " layer " << l;
        if (options_.metrics != nullptr) {
          options_.metrics->Inc(Counter::kStalenessInvariantViolations);
        }
      }
    }
    if (r->trace.valid()) {
      nlohmann::json line;
      line["step"] = task.step;
      line["lr"] = task.lr;
      std::vector<double> d;
      for (const LayerDecision& dec : decisions) d.push_back(dec.d);
      line["d"] = d;
      line["persist"] = task.layers;
      if (r->layercheck->budget_bytes_per_step() > 0) {
        line["k_mult"] = r->layercheck->k_multiplier();
      }
      // Wall time of the decision: the simulator reports the step interval
      // it implies (a hint for LayerCheckBudget::step_s); decisions never use it.
      line["unix_s"] = absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch());
      trace_line = line.dump();
    }
    r->last_decisions = std::move(decisions);
    // Kept with the step's event for later registrations of the rank (no
    // write of its own).
    task.event.set_layercheck_lr_ref(r->layercheck->lr_reference());
  }
  // The trace is written outside mu_. Only this rank's snapshot worker writes
  // it (one at a time per rank), so lines stay whole and in step order.
  if (!trace_line.empty()) {
    if (absl::Status s = store_->AppendSideFile(r->trace.get(), trace_line + "\n"); !s.ok()) {
      CKPT_LOG(ERROR) << "drift trace of job " << r->job << " rank " << r->rank
                      << " stopped: " << s;
      r->trace = UniqueFd();
    }
  }
  return true;
}

absl::StatusOr<std::vector<drift::LayerSums>> Engine::DriftPartials(const RankRef& rank,
                                                                    uint64_t step,
                                                                    const Caller& caller,
                                                                    absl::Time deadline) {
  CKPT_ASSIGN_OR_RETURN(std::shared_ptr<RankState> r, Find(rank, caller));
  if (r->layercheck == nullptr)
    return absl::FailedPreconditionError("the rank's policy is not layercheck");
  absl::MutexLock rank_lock(&r->mu);
  CKPT_RETURN_IF_ERROR(r->CheckReported(step));
  auto ready = [&r, step]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(r->mu) {
    return r->partials.count(step) > 0 || r->snapshot_step >= step || !r->active || r->stopping;
  };
  r->mu.AwaitWithDeadline(absl::Condition(&ready), deadline);
  auto it = r->partials.find(step);
  if (it == r->partials.end()) {
    if (r->snapshot_step >= step) return absl::NotFoundError("step is too old");
    if (!r->active || r->stopping)
      return RegistrationEndedError(r->stopping, "the registration ended");
    return absl::DeadlineExceededError(absl::StrCat("drift of step ", step, " not ready in time"));
  }
  return it->second;
}

absl::Status Engine::SetGlobalDrift(const RankRef& rank, uint64_t step,
                                    const std::vector<drift::LayerSums>& global,
                                    const Caller& caller) {
  absl::MutexLock lock(&mu_);
  CKPT_ASSIGN_OR_RETURN(std::shared_ptr<RankState> r, FindLocked(rank, caller));
  if (r->layercheck == nullptr)
    return absl::FailedPreconditionError("the rank's policy is not layercheck");
  absl::MutexLock rank_lock(&r->mu);
  if (global.size() != r->layers.size()) {
    return absl::InvalidArgumentError(absl::StrCat("global drift has ", global.size(),
                                                   " layers; the rank has ", r->layers.size()));
  }
  if (!r->deferred || r->snap_queue.empty() || r->snap_queue.front().step != step) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", step, " is not waiting for its global drift (call DriftPartials first)"));
  }
  for (const drift::LayerSums& d : global) {
    if (!(d.dw2 >= 0) || !(d.w2 >= 0)) {
      return absl::InvalidArgumentError("global drift sums must be finite and >= 0");
    }
  }
  SnapTask& task = r->snap_queue.front();
  task.global = global;
  task.stage = SnapTask::Stage::kReady;
  r->deferred = false;
  snapshot_ready_.push_back(r);
  return absl::OkStatus();
}

}  // namespace ckpt
