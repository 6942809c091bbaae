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

#include <chrono>
#include <cmath>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <type_traits>
#include <thread>
#include <vector>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "ckpt/client.h"
#include "nlohmann/json.hpp"
#include "tools/flags.h"

namespace {

struct Args {
  std::string socket = "/run/ckptd/ckptd.sock";
  std::string job = "example";
  uint32_t rank = 0;
  uint32_t layers = 8;
  std::vector<uint64_t> layer_bytes = {1 << 20};
  uint64_t steps = 200;
  std::string policy = "all";
  bool restore = false;
  std::string log, ack_log, verify_log, dump;
  uint64_t durable_every = 0;
  uint64_t compute_ms = 0;
  bool continue_unprotected = false;
  uint64_t seed = 1;
  bool quiet = false;
  uint64_t reconnect_ms = 300;
  bool adamw = false;  // --optimizer=adamw: real AdamW steps on w, exp_avg, exp_avg_sq
  double lr = 1e-4;
  double k0 = 0;       // layercheck overrides (0 = daemon default)
  uint64_t s_max = 0;
  int64_t warmup = -1;
  uint64_t warmup_interval = 0;
  bool record_trace = false;
};

uint64_t ParseBytes(const std::string& s) {
  uint64_t mult = 1;
  std::string n = s;
  if (!n.empty() && (n.back() == 'K' || n.back() == 'k')) mult = 1 << 10;
  if (!n.empty() && (n.back() == 'M' || n.back() == 'm')) mult = 1 << 20;
  if (!n.empty() && (n.back() == 'G' || n.back() == 'g')) mult = uint64_t{1} << 30;
  if (mult != 1) n.pop_back();
  uint64_t v = 0;
  if (!absl::SimpleAtoi(n, &v)) {
    std::fprintf(stderr, "bad size '%s'\n", s.c_str());
    std::exit(2);
  }
  return v * mult;
}

// Parses `v` as the number of flag `k` into `out`; a message and false when
// it is not one (a bad flag ends the program with exit 2, not an exception).
template <typename T>
bool Number(const std::string& k, const std::string& v, T* out) {
  bool ok;
  if constexpr (std::is_floating_point_v<T>) {
    ok = absl::SimpleAtod(v, out);
  } else {
    ok = absl::SimpleAtoi(v, out);
  }
  if (!ok) std::fprintf(stderr, "ckpt_example_trainer: %s: '%s' is not a number\n", k.c_str(), v.c_str());
  return ok;
}

bool ParseArgs(int argc, char** argv, Args* a) {
  for (int i = 1; i < argc; ++i) {
    const auto [k, v] = ckpt::tools::SplitFlag(argv[i]);
    bool ok = true;
    if (k == "--socket") a->socket = v;
    else if (k == "--job") a->job = v;
    else if (k == "--rank") ok = Number(k, v, &a->rank);
    else if (k == "--layers") ok = Number(k, v, &a->layers);
    else if (k == "--layer-bytes") {
      a->layer_bytes.clear();
      for (absl::string_view p : absl::StrSplit(v, ',')) a->layer_bytes.push_back(ParseBytes(std::string(p)));
    } else if (k == "--steps") ok = Number(k, v, &a->steps);
    else if (k == "--policy") a->policy = v;
    else if (k == "--restore") a->restore = true;
    else if (k == "--log") a->log = v;
    else if (k == "--ack-log") a->ack_log = v;
    else if (k == "--verify-log") a->verify_log = v;
    else if (k == "--dump") a->dump = v;
    else if (k == "--durable-every") ok = Number(k, v, &a->durable_every);
    else if (k == "--compute-ms") ok = Number(k, v, &a->compute_ms);
    else if (k == "--on-daemon-loss") a->continue_unprotected = (v == "continue");
    else if (k == "--seed") ok = Number(k, v, &a->seed);
    else if (k == "--quiet") a->quiet = true;
    else if (k == "--reconnect-ms") ok = Number(k, v, &a->reconnect_ms);
    else if (k == "--optimizer") a->adamw = (v == "adamw");
    else if (k == "--lr") ok = Number(k, v, &a->lr);
    else if (k == "--k0") ok = Number(k, v, &a->k0);
    else if (k == "--s-max") ok = Number(k, v, &a->s_max);
    else if (k == "--warmup") ok = Number(k, v, &a->warmup);
    else if (k == "--warmup-interval") ok = Number(k, v, &a->warmup_interval);
    else if (k == "--record-trace") a->record_trace = true;
    else {
      std::fprintf(stderr,
                   "usage: ckpt_example_trainer [--socket=PATH] [--job=ID] [--rank=R] [--layers=N]\n"
                   "  [--layer-bytes=SIZE[,SIZE...]] [--steps=S] [--policy=all|every_n:K|explicit|none]\n"
                   "  [--restore] [--verify-log=FILE] [--dump=FILE] [--log=FILE] [--ack-log=FILE]\n"
                   "  [--durable-every=K] [--compute-ms=MS] [--on-daemon-loss=error|continue] [--seed=N]\n"
                   "  [--reconnect-ms=MS] [--quiet] [--optimizer=none|adamw] [--lr=LR]\n"
                   "  layercheck: [--k0=K] [--s-max=S] [--warmup=W] [--warmup-interval=I] [--record-trace]\n");
      return false;
    }
    if (!ok) return false;
  }
  return true;
}

uint64_t Mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  return x ^ (x >> 33);
}

// Uniform in [-1, 1) from a hash.
float Uniform(uint64_t x) { return static_cast<float>(Mix(x) >> 40) / static_cast<float>(1 << 23) - 1.0f; }

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

}  // namespace

int main(int argc, char** argv) {
  Args a;
  if (!ParseArgs(argc, argv, &a)) return 2;
  ckpt::ClientOptions co;
  co.socket_path = a.socket;
  co.on_daemon_loss = a.continue_unprotected ? ckpt::OnDaemonLoss::kContinueUnprotected
                                             : ckpt::OnDaemonLoss::kError;
  co.reconnect_interval = absl::Milliseconds(static_cast<int64_t>(a.reconnect_ms));
  auto client_or = ckpt::Client::Connect(co);
  if (!client_or.ok()) {
    std::fprintf(stderr, "connect: %s\n", client_or.status().ToString().c_str());
    return 1;
  }
  std::unique_ptr<ckpt::Client> client = std::move(*client_or);

  // One region holds every layer. A layer is one f32 "weight" tensor, or with
  // --optimizer=adamw the weight followed by its exp_avg and exp_avg_sq.
  const uint64_t tensors_per_layer = a.adamw ? 3 : 1;
  std::vector<uint64_t> bytes(a.layers);  // of the layer's whole span
  uint64_t total = 0;
  for (uint32_t l = 0; l < a.layers; ++l) {
    bytes[l] = a.layer_bytes[l % a.layer_bytes.size()] / 64 * 64;
    if (bytes[l] == 0) bytes[l] = 64;
    bytes[l] *= tensors_per_layer;
    total += bytes[l];
  }
  auto region = client->AllocateRegion(total);
  if (!region.ok()) {
    std::fprintf(stderr, "allocate: %s\n", region.status().ToString().c_str());
    return 1;
  }
  char* base = static_cast<char*>(client->RegionData(*region));
  ckpt::RankSpec spec;
  spec.job_id = a.job;
  spec.rank = a.rank;
  spec.world_size = a.rank + 1;
  std::vector<uint64_t*> words(a.layers);
  uint64_t off = 0;
  for (uint32_t l = 0; l < a.layers; ++l) {
    ckpt::LayerDesc ld;
    ld.name = l == 0 ? "embed_tokens" : absl::StrCat("layers.", l - 1);
    ld.kind = l == 0 ? ckpt::v1::LAYER_EMBEDDING : ckpt::v1::LAYER_BLOCK;
    const uint64_t tensor_bytes = bytes[l] / tensors_per_layer;
    const char* suffixes[] = {".weight", ".exp_avg", ".exp_avg_sq"};
    const ckpt::v1::TensorRole roles[] = {ckpt::v1::ROLE_PARAM, ckpt::v1::ROLE_EXP_AVG,
                                          ckpt::v1::ROLE_EXP_AVG_SQ};
    for (uint64_t k = 0; k < tensors_per_layer; ++k) {
      ckpt::TensorDesc td;
      td.name = absl::StrCat(ld.name, suffixes[k]);
      td.dtype = ckpt::v1::DTYPE_F32;
      td.shape = {tensor_bytes / 4};
      td.role = roles[k];
      td.region = static_cast<uint32_t>(*region);
      td.offset = off + k * tensor_bytes;
      if (k > 0) td.param = absl::StrCat(ld.name, ".weight");
      if (k == 0) td.weight_decay = 0.01;
      ld.tensors.push_back(td);
    }
    spec.layers.push_back(ld);
    words[l] = reinterpret_cast<uint64_t*>(base + off);
    if (a.adamw) {
      float* w = reinterpret_cast<float*>(base + off);
      for (uint64_t i = 0; i < tensor_bytes / 4; ++i) w[i] = Uniform(a.seed * 1000003 + l * 7919 + i);
    } else {
      for (uint64_t i = 0; i < bytes[l] / 8; ++i) words[l][i] = Mix(a.seed * 1000003 + l * 7919 + i);
    }
    off += bytes[l];
  }
  if (a.policy == "all") {
    spec.policy.set_kind(ckpt::v1::POLICY_ALL);
  } else if (a.policy == "explicit") {
    spec.policy.set_kind(ckpt::v1::POLICY_EXPLICIT);
  } else if (a.policy == "none") {
    spec.policy.set_kind(ckpt::v1::POLICY_NONE);
  } else if (a.policy == "layercheck") {
    spec.policy.set_kind(ckpt::v1::POLICY_LAYERCHECK);
    // With real AdamW state the daemon reconstructs ΔW itself; otherwise the
    // trainer reports a synthetic per-layer drift (optimizer "client").
    spec.policy.set_optimizer(a.adamw ? ckpt::v1::OPTIMIZER_ADAMW : ckpt::v1::OPTIMIZER_CLIENT);
    ckpt::v1::LayerCheckSpec* lc = spec.policy.mutable_layercheck();
    if (a.k0 > 0) lc->set_k0(a.k0);
    if (a.s_max > 0) lc->set_s_max(a.s_max);
    if (a.warmup >= 0) lc->set_warmup(static_cast<uint64_t>(a.warmup));
    if (a.warmup_interval > 0) lc->set_warmup_interval(a.warmup_interval);
    spec.policy.set_record_trace(a.record_trace);
  } else if (a.policy.rfind("every_n:", 0) == 0) {
    spec.policy.set_kind(ckpt::v1::POLICY_EVERY_N);
    uint64_t n = 0;
    if (!Number("--policy=every_n", a.policy.substr(8), &n)) return 2;
    spec.policy.set_every_n(n);
  } else {
    std::fprintf(stderr, "unknown policy %s\n", a.policy.c_str());
    return 2;
  }
  if (absl::Status s = client->Register(spec); !s.ok()) {
    std::fprintf(stderr, "register: %s\n", s.ToString().c_str());
    return 1;
  }

  uint64_t start_step = 1;
  if (a.restore) {
    auto r = client->Restore(0);
    if (!r.ok()) {
      std::fprintf(stderr, "restore: %s\n", r.status().ToString().c_str());
      return 1;
    }
    const ckpt::v1::Plan& plan = r->plan();
    std::printf("composite restore of job %s rank %u to step %" PRIu64 "\n", plan.job_id().c_str(),
                plan.rank(), plan.target_step());
    std::printf("  %-14s %8s %9s %12s\n", "layer", "step", "staleness", "bytes");
    for (const auto& lp : plan.layers()) {
      std::printf("  %-14s %8" PRIu64 " %9" PRIu64 " %12" PRIu64 "\n", lp.name().c_str(), lp.step(),
                  lp.staleness(), lp.bytes());
    }
    std::printf("  total %" PRIu64 " bytes, max staleness %" PRIu64
                ", size-weighted staleness %.2f, restore time %.3f s (%.2f GB/s), %" PRIu64
                " bytes from the memory tier\n",
                r->bytes_restored(), plan.max_staleness(), plan.size_weighted_staleness(), r->seconds(),
                r->seconds() > 0 ? r->bytes_restored() / r->seconds() / 1e9 : 0.0,
                r->bytes_from_memory());
    if (!a.verify_log.empty()) {
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
        uint64_t h = XXH3_64bits(words[lp.layer()], bytes[lp.layer()]);
        auto it = logged.find(lp.step());
        if (it == logged.end() || it->second.size() <= lp.layer() || it->second[lp.layer()] != h) {
          ++mismatches;
          std::printf("  MISMATCH layer %u step %" PRIu64 "\n", lp.layer(), lp.step());
        }
      }
      std::printf("verify: %d of %d layers match the bytes logged at their planned step\n",
                  plan.layers_size() - mismatches, plan.layers_size());
      if (mismatches > 0) return 3;
    }
    if (!a.dump.empty()) {  // the restored bytes, layer after layer
      FILE* f = std::fopen(a.dump.c_str(), "wb");
      for (uint32_t l = 0; f != nullptr && l < a.layers; ++l) std::fwrite(words[l], 1, bytes[l], f);
      if (f == nullptr || std::fclose(f) != 0) return 1;
    }
    start_step = plan.target_step() + 1;
  }

  FILE* log = a.log.empty() ? nullptr : std::fopen(a.log.c_str(), "a");
  int ack_fd = a.ack_log.empty() ? -1 : ::open(a.ack_log.c_str(), O_WRONLY | O_APPEND | O_CREAT, 0644);
  std::vector<uint64_t> staged_step(a.layers, 0);  // newest staged step per layer
  std::map<uint64_t, std::vector<uint64_t>> staged_at;  // step -> staged_step after it
  double fence_s = 0, stepdone_s = 0;
  const uint64_t last = a.steps;
  for (uint64_t t = start_step; t <= last; ++t) {
    if (a.compute_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(a.compute_ms));
    // Fence: the snapshot of t-1 must be taken before the buffers change.
    if (t > start_step) {
      auto f0 = std::chrono::steady_clock::now();
      auto snap = client->WaitSnapshot(t - 1);
      fence_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - f0).count();
      if (!snap.ok()) {
        std::fprintf(stderr, "wait snapshot %" PRIu64 ": %s\n", t - 1, snap.status().ToString().c_str());
        return 1;
      }
      for (uint32_t l : snap->layers) staged_step[l] = t - 1;
      staged_at[t - 1] = staged_step;
    }
    // The "optimizer step": every layer changes.
    for (uint32_t l = 0; l < a.layers; ++l) {
      if (a.adamw) {
        float* w = reinterpret_cast<float*>(words[l]);
        const uint64_t n = bytes[l] / 12;
        AdamWStep(w, w + n, w + 2 * n, n, l, t, a.lr);
        continue;
      }
      uint64_t* w = words[l];
      const uint64_t salt = Mix(t * 0x9e3779b97f4a7c15ULL + l);
      for (uint64_t i = 0; i < bytes[l] / 8; ++i) w[i] = w[i] * 6364136223846793005ULL + (salt ^ i);
    }
    if (log != nullptr) {
      nlohmann::json j;
      j["step"] = t;
      std::vector<uint64_t> hashes(a.layers);
      for (uint32_t l = 0; l < a.layers; ++l) hashes[l] = XXH3_64bits(words[l], bytes[l]);
      j["hashes"] = hashes;
      std::fprintf(log, "%s\n", j.dump().c_str());
      std::fflush(log);
    }
    std::vector<uint32_t> layers;
    if (a.policy == "explicit") {
      for (uint32_t l = 0; l < a.layers; ++l) {
        if (ExplicitSelects(l, t)) layers.push_back(l);
      }
    }
    auto s0 = std::chrono::steady_clock::now();
    ckpt::Client::StepInfo info;
    info.step = t;
    info.lr = a.lr;
    info.aux = absl::StrCat("{\"step\":", t, "}");
    info.layers = layers;
    if (a.policy == "layercheck" && !a.adamw) {
      // Synthetic drift: layer l moves by 2e-4 * (1 + l % 4) of its norm per step.
      for (uint32_t l = 0; l < a.layers; ++l) {
        const double d = 2e-4 * (1 + l % 4);
        info.client_drift.push_back(ckpt::LayerSums{d * d, 1.0});
      }
    }
    absl::Status s = client->StepDone(info);
    stepdone_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - s0).count();
    if (!s.ok()) {
      std::fprintf(stderr, "step done %" PRIu64 ": %s\n", t, s.ToString().c_str());
      return 1;
    }
    if (a.durable_every > 0 && t % a.durable_every == 0 && t > start_step) {
      // Ack the previous step (its snapshot result is known).
      auto d = client->WaitDurable(t - 1);
      if (d.ok() && ack_fd >= 0 && staged_at.count(t - 1)) {
        nlohmann::json j;
        j["durable"] = t - 1;
        j["layers"] = staged_at[t - 1];
        std::string line = j.dump() + "\n";
        if (::write(ack_fd, line.data(), line.size()) < 0 || ::fsync(ack_fd) != 0) return 1;
      } else if (!d.ok() && !a.quiet) {
        std::fprintf(stderr, "durable %" PRIu64 ": %s\n", t - 1, d.status().ToString().c_str());
      }
    }
    while (staged_at.size() > 8) staged_at.erase(staged_at.begin());
  }
  if (last >= start_step) {
    auto snap = client->WaitSnapshot(last);
    auto d = client->WaitDurable(last);
    if (snap.ok() && d.ok()) {
      for (uint32_t l : snap->layers) staged_step[l] = last;
      if (ack_fd >= 0) {
        nlohmann::json j;
        j["durable"] = last;
        j["layers"] = staged_step;
        std::string line = j.dump() + "\n";
        if (::write(ack_fd, line.data(), line.size()) < 0 || ::fsync(ack_fd) != 0) return 1;
      }
    } else if (!a.quiet) {
      std::fprintf(stderr, "final durable: %s\n",
                   (!snap.ok() ? snap.status() : d.status()).ToString().c_str());
    }
    uint64_t n = last - start_step + 1;
    if (!a.quiet) {
      std::printf("trained steps %" PRIu64 "..%" PRIu64 ": mean fence wait %.3f ms, mean StepDone %.3f ms%s\n",
                  start_step, last, 1e3 * fence_s / n, 1e3 * stepdone_s / n,
                  client->unprotected() ? " (ended UNPROTECTED)" : "");
    }
  }
  if (log != nullptr) std::fclose(log);
  if (ack_fd >= 0) ::close(ack_fd);
  return 0;
}
