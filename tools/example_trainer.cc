// ckpt_example_trainer: a synthetic trainer for tests, benchmarks and the
// quickstart. N layers of configurable sizes live in ckptd shared memory; each
// "optimizer step" mutates every layer deterministically (a function of the
// previous bytes and the step), so a restored state can be checked exactly.
//
//   --log=FILE        one JSON line per step: {"step":t,"hashes":[xxh3 per layer]}
//   --ack-log=FILE    one JSON line per durable ack (fsynced):
//                     {"durable":t,"layers":[newest staged step <= t per layer]}
//   --restore         restore the composite checkpoint first, print the plan,
//                     and with --verify-log=FILE check every layer's bytes against
//                     the hash the earlier run logged at that layer's step.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "ckpt/client.h"
#include "nlohmann/json.hpp"
#include "tools/example_trainer_args.h"
#include "tools/flags.h"

namespace {

using ckpt::tools::example::Args;
using ckpt::tools::example::Number;
using ckpt::tools::example::ParseArgs;
using ckpt::tools::example::ParseBytes;

uint64_t Mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  return x ^ (x >> 33);
}

// Uniform in [-1, 1) from a hash.
float Uniform(uint64_t x) {
  return static_cast<float>(Mix(x) >> 40) / static_cast<float>(1 << 23) - 1.0f;
}

// One AdamW step (PyTorch's order: decay, moments, bias-corrected update) on a
// layer whose gradient is a layer-specific mix of a fixed direction and noise,
// so layers drift at different paces.
void AdamWStep(float* w, float* m, float* v, uint64_t n, uint32_t layer, uint64_t t, double lr) {
  const float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, wd = 0.01f;
  const float consistency = 0.15f * static_cast<float>(layer % 7);  // 0 .. 0.9
  const float bc1 = 1.0f - std::pow(beta1, static_cast<float>(t));
  const float bc2 = 1.0f - std::pow(beta2, static_cast<float>(t));
  const float step_size = static_cast<float>(lr) / bc1;
  const float bc2_sqrt = std::sqrt(bc2);
  for (uint64_t i = 0; i < n; ++i) {
    const float g = consistency * Uniform(layer * 0x9e37ULL + i) +
                    (1.0f - consistency) * Uniform((t << 32) ^ (layer * 0x85ebULL + i));
    w[i] *= 1.0f - static_cast<float>(lr) * wd;
    m[i] = beta1 * m[i] + (1.0f - beta1) * g;
    v[i] = beta2 * v[i] + (1.0f - beta2) * g * g;
    w[i] -= step_size * m[i] / (std::sqrt(v[i]) / bc2_sqrt + eps);
  }
}

// The explicit policy's schedule: layer l is persisted every (l % 5) + 2 steps.
bool ExplicitSelects(uint32_t layer, uint64_t step) { return step % ((layer % 5) + 2) == 0; }

// The trainer's layers in ckptd shared memory: one region holds every layer;
// a layer is one f32 "weight" tensor, or with --optimizer=adamw the weight
// followed by its exp_avg and exp_avg_sq.
struct Model {
  std::vector<uint64_t> bytes;   // of each layer's whole span
  std::vector<uint64_t*> words;  // where each layer starts
};

// Connects to ckptd as the flags say; nullptr after printing why not.
std::unique_ptr<ckpt::Client> Connect(const Args& a) {
  ckpt::ClientOptions co;
  co.socket_path = a.socket;
  co.on_daemon_loss = a.continue_unprotected ? ckpt::OnDaemonLoss::kContinueUnprotected
                                             : ckpt::OnDaemonLoss::kError;
  co.reconnect_interval = absl::Milliseconds(static_cast<int64_t>(a.reconnect_ms));
  auto client_or = ckpt::Client::Connect(co);
  if (!client_or.ok()) {
    std::fprintf(stderr, "connect: %s\n", client_or.status().ToString().c_str());
    return nullptr;
  }
  return std::move(*client_or);
}

// One layer's description: its tensors at `off` in `region`.
ckpt::LayerDesc DescribeLayer(const Args& a, uint32_t l, uint64_t layer_bytes, size_t region,
                              uint64_t off) {
  const uint64_t tensors_per_layer = a.adamw ? 3 : 1;
  ckpt::LayerDesc ld;
  ld.name = l == 0 ? "embed_tokens" : absl::StrCat("layers.", l - 1);
  ld.kind = l == 0 ? ckpt::v1::LAYER_EMBEDDING : ckpt::v1::LAYER_BLOCK;
  const uint64_t tensor_bytes = layer_bytes / tensors_per_layer;
  const char* suffixes[] = {".weight", ".exp_avg", ".exp_avg_sq"};
  const ckpt::v1::TensorRole roles[] = {ckpt::v1::ROLE_PARAM, ckpt::v1::ROLE_EXP_AVG,
                                        ckpt::v1::ROLE_EXP_AVG_SQ};
  for (uint64_t k = 0; k < tensors_per_layer; ++k) {
    ckpt::TensorDesc td;
    td.name = absl::StrCat(ld.name, suffixes[k]);
    td.dtype = ckpt::v1::DTYPE_F32;
    td.shape = {tensor_bytes / 4};
    td.role = roles[k];
    td.region = static_cast<uint32_t>(region);
    td.offset = off + k * tensor_bytes;
    if (k > 0) td.param = absl::StrCat(ld.name, ".weight");
    if (k == 0) td.weight_decay = 0.01;
    ld.tensors.push_back(td);
  }
  return ld;
}

// Allocates the region, gives every layer its first bytes (a function of
// --seed) and describes the layers in `spec`. Returns 0 or the exit code.
int BuildModel(const Args& a, ckpt::Client* client, ckpt::RankSpec* spec, Model* m) {
  const uint64_t tensors_per_layer = a.adamw ? 3 : 1;
  m->bytes.resize(a.layers);
  uint64_t total = 0;
  for (uint32_t l = 0; l < a.layers; ++l) {
    m->bytes[l] = std::max<uint64_t>(64, a.layer_bytes[l % a.layer_bytes.size()] / 64 * 64);
    m->bytes[l] *= tensors_per_layer;
    total += m->bytes[l];
  }
  auto region = client->AllocateRegion(total);
  if (!region.ok()) {
    std::fprintf(stderr, "allocate: %s\n", region.status().ToString().c_str());
    return 1;
  }
  char* base = static_cast<char*>(client->RegionData(*region));
  spec->job_id = a.job;
  spec->rank = a.rank;
  spec->world_size = std::max<uint32_t>(a.rank + 1, static_cast<uint32_t>(a.job_nodes.size()));
  spec->job_nodes = a.job_nodes;
  m->words.resize(a.layers);
  uint64_t off = 0;
  for (uint32_t l = 0; l < a.layers; ++l) {
    spec->layers.push_back(DescribeLayer(a, l, m->bytes[l], *region, off));
    m->words[l] = reinterpret_cast<uint64_t*>(base + off);
    if (a.adamw) {
      const uint64_t tensor_bytes = m->bytes[l] / tensors_per_layer;
      float* w = reinterpret_cast<float*>(base + off);
      for (uint64_t i = 0; i < tensor_bytes / 4; ++i)
        w[i] = Uniform(a.seed * 1000003 + l * 7919 + i);
    } else {
      for (uint64_t i = 0; i < m->bytes[l] / 8; ++i)
        m->words[l][i] = Mix(a.seed * 1000003 + l * 7919 + i);
    }
    off += m->bytes[l];
  }
  return 0;
}

// The registration's policy from --policy (and the layercheck flags).
// Returns 0, or 2 for a policy it does not know.
int SetPolicy(const Args& a, ckpt::v1::PolicySpec* policy) {
  if (a.policy == "all") {
    policy->set_kind(ckpt::v1::POLICY_ALL);
  } else if (a.policy == "explicit") {
    policy->set_kind(ckpt::v1::POLICY_EXPLICIT);
  } else if (a.policy == "none") {
    policy->set_kind(ckpt::v1::POLICY_NONE);
  } else if (a.policy == "layercheck") {
    policy->set_kind(ckpt::v1::POLICY_LAYERCHECK);
    // With real AdamW state the daemon reconstructs ΔW itself; otherwise the
    // trainer reports a synthetic per-layer drift (optimizer "client").
    policy->set_optimizer(a.adamw ? ckpt::v1::OPTIMIZER_ADAMW : ckpt::v1::OPTIMIZER_CLIENT);
    ckpt::v1::LayerCheckSpec* lc = policy->mutable_layercheck();
    if (a.k0 > 0) lc->set_k0(a.k0);
    if (a.s_max > 0) lc->set_s_max(a.s_max);
    if (a.warmup >= 0) lc->set_warmup(static_cast<uint64_t>(a.warmup));
    if (a.warmup_interval > 0) lc->set_warmup_interval(a.warmup_interval);
    policy->set_record_trace(a.record_trace);
  } else if (a.policy.rfind("every_n:", 0) == 0) {
    policy->set_kind(ckpt::v1::POLICY_EVERY_N);
    uint64_t n = 0;
    if (!Number("--policy=every_n", a.policy.substr(8), &n)) return 2;
    policy->set_every_n(n);
  } else {
    std::fprintf(stderr, "unknown policy %s\n", a.policy.c_str());
    return 2;
  }
  return 0;
}

// The composite restore's plan, one line per layer, and its figures.
void PrintRestore(const ckpt::v1::RestoreReply& r) {
  const ckpt::v1::Plan& plan = r.plan();
  std::printf("composite restore of job %s rank %u to step %" PRIu64 "\n", plan.job_id().c_str(),
              plan.rank(), plan.target_step());
  std::printf("  %-14s %8s %9s %12s  %s\n", "layer", "step", "staleness", "bytes", "from");
  for (const auto& lp : plan.layers()) {
    const std::string from =
        lp.lost_step() != 0 ? absl::StrCat(lp.source(), " (step ", lp.lost_step(), " was lost)")
        : lp.source() == "memory" ? "ckptd's memory tier"
        : lp.source().empty()     ? "-"
                                  : lp.source();
    std::printf("  %-14s %8" PRIu64 " %9" PRIu64 " %12" PRIu64 "  %s\n", lp.name().c_str(),
                lp.step(), lp.staleness(), lp.bytes(), from.c_str());
  }
  std::printf("  total %" PRIu64 " bytes, max staleness %" PRIu64
              ", size-weighted staleness %.2f, restore time %.3f s (%.2f GB/s), %" PRIu64
              " bytes from the memory tier\n",
              r.bytes_restored(), plan.max_staleness(), plan.size_weighted_staleness(), r.seconds(),
              r.seconds() > 0 ? r.bytes_restored() / r.seconds() / 1e9 : 0.0,
              r.bytes_from_memory());
}

// --verify-log: every restored layer's bytes against the hash the earlier
// run logged at the layer's planned step. Returns 0, or 3 on a mismatch.
int VerifyAgainstLog(const Args& a, const ckpt::v1::Plan& plan, const Model& m) {
  std::map<uint64_t, std::vector<uint64_t>> logged;
  std::ifstream in(a.verify_log);
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.contains("step")) continue;  // a torn last line
    logged[j["step"].get<uint64_t>()] = j["hashes"].get<std::vector<uint64_t>>();
  }
  int mismatches = 0;
  for (const auto& lp : plan.layers()) {
    uint64_t h = XXH3_64bits(m.words[lp.layer()], m.bytes[lp.layer()]);
    auto it = logged.find(lp.step());
    if (it == logged.end() || it->second.size() <= lp.layer() || it->second[lp.layer()] != h) {
      ++mismatches;
      std::printf("  MISMATCH layer %u step %" PRIu64 "\n", lp.layer(), lp.step());
    }
  }
  std::printf("verify: %d of %d layers match the bytes logged at their planned step\n",
              plan.layers_size() - mismatches, plan.layers_size());
  return mismatches > 0 ? 3 : 0;
}

// --restore: the composite checkpoint into the layers, printed, checked
// (--verify-log) and dumped (--dump); the training goes on after its step.
// Returns 0 or the exit code.
int RestoreCheckpoint(const Args& a, ckpt::Client* client, const Model& m, uint64_t* start_step) {
  auto r = client->Restore(0, /*discard_later=*/false, a.older_within);
  if (!r.ok()) {
    std::fprintf(stderr, "restore: %s\n", r.status().ToString().c_str());
    return 1;
  }
  PrintRestore(*r);
  const ckpt::v1::Plan& plan = r->plan();
  if (!a.verify_log.empty()) {
    if (int rc = VerifyAgainstLog(a, plan, m); rc != 0) return rc;
  }
  if (!a.dump.empty()) {  // the restored bytes, layer after layer
    FILE* f = std::fopen(a.dump.c_str(), "wb");
    for (uint32_t l = 0; f != nullptr && l < a.layers; ++l) {
      std::fwrite(m.words[l], 1, m.bytes[l], f);
    }
    if (f == nullptr || std::fclose(f) != 0) return 1;
  }
  *start_step = plan.target_step() + 1;
  return 0;
}

// Steps start_step .. --steps: per step the fence on the previous step's
// snapshot, the "optimizer step", its hashes in --log, StepDone, and every
// --durable-every steps the previous step's durable ack in --ack-log; at the
// end the last step's ack and the mean waits.
class TrainLoop {
 public:
  // Opens --log and --ack-log (appending).
  TrainLoop(const Args& a, ckpt::Client* client, const Model& m, uint64_t start_step)
      : a_(a),
        client_(client),
        m_(m),
        start_step_(start_step),
        log_(a.log.empty() ? nullptr : std::fopen(a.log.c_str(), "a")),
        ack_fd_(a.ack_log.empty() ? -1
                                  : ::open(a.ack_log.c_str(), O_WRONLY | O_APPEND | O_CREAT, 0644)),
        staged_step_(a.layers, 0) {}
  ~TrainLoop() {
    if (log_ != nullptr) std::fclose(log_);
    if (ack_fd_ >= 0) ::close(ack_fd_);
  }
  TrainLoop(const TrainLoop&) = delete;
  TrainLoop& operator=(const TrainLoop&) = delete;

  // Returns 0 or the exit code.
  int Run() {
    const uint64_t last = a_.steps;
    for (uint64_t t = start_step_; t <= last; ++t) {
      if (a_.compute_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(a_.compute_ms));
      // Fence: the snapshot of t-1 must be taken before the buffers change.
      if (t > start_step_) {
        if (int rc = Fence(t - 1); rc != 0) return rc;
      }
      Optimize(t);
      if (log_ != nullptr) LogHashes(t);
      if (int rc = ReportStep(t); rc != 0) return rc;
      if (a_.durable_every > 0 && t % a_.durable_every == 0 && t > start_step_) {
        // Ack the previous step (its snapshot result is known).
        if (int rc = AckPrevious(t - 1); rc != 0) return rc;
      }
      while (staged_at_.size() > 8) staged_at_.erase(staged_at_.begin());
    }
    if (last >= start_step_) return Finish(last);
    return 0;
  }

 private:
  // Waits for the snapshot of `step` and notes the layers it staged.
  int Fence(uint64_t step) {
    auto f0 = std::chrono::steady_clock::now();
    auto snap = client_->WaitSnapshot(step);
    fence_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - f0).count();
    if (!snap.ok()) {
      std::fprintf(stderr, "wait snapshot %" PRIu64 ": %s\n", step,
                   snap.status().ToString().c_str());
      return 1;
    }
    for (uint32_t l : snap->layers) staged_step_[l] = step;
    staged_at_[step] = staged_step_;
    return 0;
  }

  // The "optimizer step": every layer changes.
  void Optimize(uint64_t t) {
    for (uint32_t l = 0; l < a_.layers; ++l) {
      if (a_.adamw) {
        float* w = reinterpret_cast<float*>(m_.words[l]);
        const uint64_t n = m_.bytes[l] / 12;
        AdamWStep(w, w + n, w + 2 * n, n, l, t, a_.lr);
        continue;
      }
      uint64_t* w = m_.words[l];
      const uint64_t salt = Mix(t * 0x9e3779b97f4a7c15ULL + l);
      for (uint64_t i = 0; i < m_.bytes[l] / 8; ++i) {
        w[i] = w[i] * 6364136223846793005ULL + (salt ^ i);
      }
    }
  }

  // One --log line: the step and every layer's hash.
  void LogHashes(uint64_t t) {
    nlohmann::json j;
    j["step"] = t;
    std::vector<uint64_t> hashes(a_.layers);
    for (uint32_t l = 0; l < a_.layers; ++l) hashes[l] = XXH3_64bits(m_.words[l], m_.bytes[l]);
    j["hashes"] = hashes;
    std::fprintf(log_, "%s\n", j.dump().c_str());
    std::fflush(log_);
  }

  // StepDone(t), with the layers of the explicit policy and, for a
  // layercheck policy without AdamW, the synthetic drift.
  int ReportStep(uint64_t t) {
    std::vector<uint32_t> layers;
    if (a_.policy == "explicit") {
      for (uint32_t l = 0; l < a_.layers; ++l) {
        if (ExplicitSelects(l, t)) layers.push_back(l);
      }
    }
    auto s0 = std::chrono::steady_clock::now();
    ckpt::Client::StepInfo info;
    info.step = t;
    info.lr = a_.lr;
    info.aux = absl::StrCat("{\"step\":", t, "}");
    info.layers = layers;
    if (a_.policy == "layercheck" && !a_.adamw) {
      // Synthetic drift: layer l moves by 2e-4 * (1 + l % 4) of its norm per step.
      for (uint32_t l = 0; l < a_.layers; ++l) {
        const double d = 2e-4 * (1 + l % 4);
        info.client_drift.push_back(ckpt::LayerSums{d * d, 1.0});
      }
    }
    absl::Status s = client_->StepDone(info);
    stepdone_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - s0).count();
    if (!s.ok()) {
      std::fprintf(stderr, "step done %" PRIu64 ": %s\n", t, s.ToString().c_str());
      return 1;
    }
    return 0;
  }

  // One --ack-log line, fsynced: `durable` and the newest staged step of
  // each layer at or before it. Returns 0, or 1 when it cannot be written.
  int WriteAck(uint64_t durable, const std::vector<uint64_t>& layers) {
    nlohmann::json j;
    j["durable"] = durable;
    j["layers"] = layers;
    std::string line = j.dump() + "\n";
    if (::write(ack_fd_, line.data(), line.size()) < 0 || ::fsync(ack_fd_) != 0) return 1;
    return 0;
  }

  // Waits for `step` to be durable and acks it.
  int AckPrevious(uint64_t step) {
    auto d = client_->WaitDurable(step);
    if (d.ok() && ack_fd_ >= 0 && staged_at_.count(step)) {
      return WriteAck(step, staged_at_[step]);
    }
    if (!d.ok() && !a_.quiet) {
      std::fprintf(stderr, "durable %" PRIu64 ": %s\n", step, d.status().ToString().c_str());
    }
    return 0;
  }

  // The last step's snapshot and durability, its ack, and the mean waits.
  int Finish(uint64_t last) {
    auto snap = client_->WaitSnapshot(last);
    auto d = client_->WaitDurable(last);
    if (snap.ok() && d.ok()) {
      for (uint32_t l : snap->layers) staged_step_[l] = last;
      if (ack_fd_ >= 0) {
        if (int rc = WriteAck(last, staged_step_); rc != 0) return rc;
      }
    } else if (!a_.quiet) {
      std::fprintf(stderr, "final durable: %s\n",
                   (!snap.ok() ? snap.status() : d.status()).ToString().c_str());
    }
    if (!a_.wait_tier.empty() && d.ok()) {
      const auto tier =
          a_.wait_tier == "peer" ? ckpt::Client::Tier::kPeer : ckpt::Client::Tier::kRemote;
      const absl::Time t0 = absl::Now();
      auto there = client_->WaitDurable(last, tier);
      if (!there.ok()) {
        std::fprintf(stderr, "%s durable: %s\n", a_.wait_tier.c_str(),
                     there.status().ToString().c_str());
        return 1;
      }
      std::printf("step %" PRIu64 " in the %s tier %.3f s after it was durable here\n", last,
                  a_.wait_tier.c_str(), absl::ToDoubleSeconds(absl::Now() - t0));
    }
    uint64_t n = last - start_step_ + 1;
    if (!a_.quiet) {
      std::printf("trained steps %" PRIu64 "..%" PRIu64
                  ": mean fence wait %.3f ms, mean StepDone %.3f ms%s\n",
                  start_step_, last, 1e3 * fence_s_ / n, 1e3 * stepdone_s_ / n,
                  client_->unprotected() ? " (ended UNPROTECTED)" : "");
    }
    return 0;
  }

  const Args& a_;
  ckpt::Client* const client_;
  const Model& m_;
  const uint64_t start_step_;
  FILE* const log_;
  const int ack_fd_;
  std::vector<uint64_t> staged_step_;                    // newest staged step per layer
  std::map<uint64_t, std::vector<uint64_t>> staged_at_;  // step -> staged_step_ after it
  double fence_s_ = 0, stepdone_s_ = 0;
};

// The run: connect, register the layers, restore (--restore), train.
int Run(const Args& a) {
  std::unique_ptr<ckpt::Client> client = Connect(a);
  if (client == nullptr) return 1;
  ckpt::RankSpec spec;
  Model model;
  if (int rc = BuildModel(a, client.get(), &spec, &model); rc != 0) return rc;
  if (int rc = SetPolicy(a, &spec.policy); rc != 0) return rc;
  if (absl::Status s = client->Register(spec); !s.ok()) {
    std::fprintf(stderr, "register: %s\n", s.ToString().c_str());
    return 1;
  }
  uint64_t start_step = 1;
  if (a.restore) {
    if (int rc = RestoreCheckpoint(a, client.get(), model, &start_step); rc != 0) return rc;
  }
  TrainLoop loop(a, client.get(), model, start_step);
  return loop.Run();
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  if (!ParseArgs(argc, argv, &a)) return 2;
  return Run(a);
}
