// Trains a two-layer job for a few steps against a running ckptd, then
// restores it in a second connection and checks every restored byte.
// Built from the installed headers and libraries only (tests/install).
//
//   ckpt_consumer --socket=PATH [--job=NAME]
// Exit status: 0 when the restored bytes match step `kSteps`, 1 otherwise.
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "ckpt/client.h"

namespace {

constexpr uint64_t kSteps = 4;
constexpr uint64_t kLayerBytes = 64 << 10;
constexpr uint32_t kLayers = 2;

// The value of word i of a layer after step `step`.
uint32_t Word(uint64_t step, uint32_t layer, uint64_t i) {
  uint64_t x = step * 0x9E3779B97F4A7C15ull + layer * 0xBF58476D1CE4E5B9ull + i;
  x ^= x >> 31;
  x *= 0x94D049BB133111EBull;
  return static_cast<uint32_t>(x ^ (x >> 29));
}

void Fill(char* base, uint64_t step) {
  for (uint32_t l = 0; l < kLayers; ++l) {
    auto* w = reinterpret_cast<uint32_t*>(base + l * kLayerBytes);
    for (uint64_t i = 0; i < kLayerBytes / 4; ++i) w[i] = Word(step, l, i);
  }
}

struct Session {
  std::unique_ptr<ckpt::Client> client;
  char* base = nullptr;
};

// Connects, allocates one region with both layers in it and registers them.
bool Open(const ckpt::ClientOptions& opts, const std::string& job, Session* s) {
  auto client = ckpt::Client::Connect(opts);
  if (!client.ok()) {
    std::fprintf(stderr, "connect: %s\n", client.status().ToString().c_str());
    return false;
  }
  s->client = std::move(*client);
  auto region = s->client->AllocateRegion(kLayers * kLayerBytes);
  if (!region.ok()) {
    std::fprintf(stderr, "allocate: %s\n", region.status().ToString().c_str());
    return false;
  }
  s->base = static_cast<char*>(s->client->RegionData(*region));
  ckpt::RankSpec spec;
  spec.job_id = job;
  spec.policy.set_kind(ckpt::v1::POLICY_ALL);
  for (uint32_t l = 0; l < kLayers; ++l) {
    ckpt::LayerDesc layer;
    layer.name = "layers." + std::to_string(l);
    ckpt::TensorDesc t;
    t.name = layer.name + ".weight";
    t.dtype = ckpt::v1::DTYPE_F32;
    t.shape = {kLayerBytes / ckpt::DTypeBytes(t.dtype)};
    t.region = static_cast<uint32_t>(*region);
    t.offset = l * kLayerBytes;
    layer.tensors.push_back(t);
    spec.layers.push_back(layer);
  }
  if (absl::Status st = s->client->Register(spec); !st.ok()) {
    std::fprintf(stderr, "register: %s\n", st.ToString().c_str());
    return false;
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  ckpt::ClientOptions opts;
  opts.wait_timeout = absl::Seconds(30);
  opts.restore_timeout = absl::Seconds(60);
  std::string job = "install-check";
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--socket=", 0) == 0) {
      opts.socket_path = a.substr(9);
    } else if (a.rfind("--job=", 0) == 0) {
      job = a.substr(6);
    } else {
      std::fprintf(stderr, "usage: %s --socket=PATH [--job=NAME]\n", argv[0]);
      return 2;
    }
  }

  Session train;
  if (!Open(opts, job, &train)) return 1;
  std::printf("registered job %s: %u layers of %" PRIu64 " bytes\n", job.c_str(), kLayers,
              kLayerBytes);
  for (uint64_t t = 1; t <= kSteps; ++t) {
    if (t > 1) {
      auto snap = train.client->WaitSnapshot(t - 1);
      if (!snap.ok()) {
        std::fprintf(stderr, "wait snapshot %" PRIu64 ": %s\n", t - 1,
                     snap.status().ToString().c_str());
        return 1;
      }
    }
    Fill(train.base, t);
    if (absl::Status st = train.client->StepDone(t, 1e-3, "step " + std::to_string(t)); !st.ok()) {
      std::fprintf(stderr, "step %" PRIu64 ": %s\n", t, st.ToString().c_str());
      return 1;
    }
  }
  auto durable = train.client->WaitDurable(kSteps);
  if (!durable.ok()) {
    std::fprintf(stderr, "wait durable: %s\n", durable.status().ToString().c_str());
    return 1;
  }
  std::printf("steps 1..%" PRIu64 " done, durable step %" PRIu64 "\n", kSteps, *durable);
  if (absl::Status st = train.client->Unregister(true); !st.ok()) {
    std::fprintf(stderr, "unregister: %s\n", st.ToString().c_str());
    return 1;
  }
  train = Session();

  Session restore;
  if (!Open(opts, job, &restore)) return 1;
  auto reply = restore.client->Restore(0);
  if (!reply.ok()) {
    std::fprintf(stderr, "restore: %s\n", reply.status().ToString().c_str());
    return 1;
  }
  std::printf("restored %" PRIu64 " bytes to step %" PRIu64 " in a new connection\n",
              reply->bytes_restored(), reply->plan().target_step());
  std::vector<char> want(kLayers * kLayerBytes);
  Fill(want.data(), kSteps);
  bool ok = reply->plan().target_step() == kSteps &&
            reply->bytes_restored() == kLayers * kLayerBytes &&
            std::memcmp(want.data(), restore.base, want.size()) == 0 &&
            reply->plan().aux() == "step " + std::to_string(kSteps);
  std::printf("restored bytes and aux %s step %" PRIu64 "\n", ok ? "match" : "DO NOT match",
              kSteps);
  return ok ? 0 : 1;
}
