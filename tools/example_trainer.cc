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
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
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
  std::string log, ack_log, verify_log;
  uint64_t durable_every = 0;
  uint64_t compute_ms = 0;
  bool continue_unprotected = false;
  uint64_t seed = 1;
  bool quiet = false;
  uint64_t reconnect_ms = 300;
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

bool ParseArgs(int argc, char** argv, Args* a) {
  for (int i = 1; i < argc; ++i) {
    std::string s = argv[i];
    auto eq = s.find('=');
    std::string k = s.substr(0, eq), v = eq == std::string::npos ? "" : s.substr(eq + 1);
    if (k == "--socket") a->socket = v;
    else if (k == "--job") a->job = v;
    else if (k == "--rank") a->rank = static_cast<uint32_t>(std::stoul(v));
    else if (k == "--layers") a->layers = static_cast<uint32_t>(std::stoul(v));
    else if (k == "--layer-bytes") {
      a->layer_bytes.clear();
      for (absl::string_view p : absl::StrSplit(v, ',')) a->layer_bytes.push_back(ParseBytes(std::string(p)));
    } else if (k == "--steps") a->steps = std::stoull(v);
    else if (k == "--policy") a->policy = v;
    else if (k == "--restore") a->restore = true;
    else if (k == "--log") a->log = v;
    else if (k == "--ack-log") a->ack_log = v;
    else if (k == "--verify-log") a->verify_log = v;
    else if (k == "--durable-every") a->durable_every = std::stoull(v);
    else if (k == "--compute-ms") a->compute_ms = std::stoull(v);
    else if (k == "--on-daemon-loss") a->continue_unprotected = (v == "continue");
    else if (k == "--seed") a->seed = std::stoull(v);
    else if (k == "--quiet") a->quiet = true;
    else if (k == "--reconnect-ms") a->reconnect_ms = std::stoull(v);
    else {
      std::fprintf(stderr,
                   "usage: ckpt_example_trainer [--socket=PATH] [--job=ID] [--rank=R] [--layers=N]\n"
                   "  [--layer-bytes=SIZE[,SIZE...]] [--steps=S] [--policy=all|every_n:K|explicit|none]\n"
                   "  [--restore] [--verify-log=FILE] [--log=FILE] [--ack-log=FILE]\n"
                   "  [--durable-every=K] [--compute-ms=MS] [--on-daemon-loss=error|continue] [--seed=N]\n"
                   "  [--reconnect-ms=MS] [--quiet]\n");
      return false;
    }
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

  // One region holds every layer; each layer is one f32 "weight" tensor.
  std::vector<uint64_t> bytes(a.layers);
  uint64_t total = 0;
  for (uint32_t l = 0; l < a.layers; ++l) {
    bytes[l] = a.layer_bytes[l % a.layer_bytes.size()] / 64 * 64;
    if (bytes[l] == 0) bytes[l] = 64;
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
    ckpt::TensorDesc td;
    td.name = absl::StrCat(ld.name, ".weight");
    td.dtype = ckpt::v1::DTYPE_F32;
    td.shape = {bytes[l] / 4};
    td.region = static_cast<uint32_t>(*region);
    td.offset = off;
    ld.tensors.push_back(td);
    spec.layers.push_back(ld);
    words[l] = reinterpret_cast<uint64_t*>(base + off);
    for (uint64_t i = 0; i < bytes[l] / 8; ++i) words[l][i] = Mix(a.seed * 1000003 + l * 7919 + i);
    off += bytes[l];
  }
  if (a.policy == "all") {
    spec.policy.set_kind(ckpt::v1::POLICY_ALL);
  } else if (a.policy == "explicit") {
    spec.policy.set_kind(ckpt::v1::POLICY_EXPLICIT);
  } else if (a.policy == "none") {
    spec.policy.set_kind(ckpt::v1::POLICY_NONE);
  } else if (a.policy.rfind("every_n:", 0) == 0) {
    spec.policy.set_kind(ckpt::v1::POLICY_EVERY_N);
    spec.policy.set_every_n(std::stoull(a.policy.substr(8)));
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
                ", size-weighted staleness %.2f, restore time %.3f s (%.2f GB/s)\n",
                r->bytes_restored(), plan.max_staleness(), plan.size_weighted_staleness(), r->seconds(),
                r->seconds() > 0 ? r->bytes_restored() / r->seconds() / 1e9 : 0.0);
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
    absl::Status s = client->StepDone(t, 1e-3, absl::StrCat("{\"step\":", t, "}"), layers);
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
