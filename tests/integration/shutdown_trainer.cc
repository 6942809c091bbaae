// ckpt_shutdown_trainer: a C++ trainer for test_shutdown.py that stops at
// named points of the per-step protocol so the test can stop, kill or restart
// ckptd exactly there.
//
//   --pause=POINT:STEP   (repeatable) at POINT of step STEP, print
//                        "pause POINT STEP" and wait for a line on stdin.
//                        POINT is before_step_done (the optimizer step ran,
//                        StepDone(STEP) not yet called) or before_fence
//                        (StepDone(STEP) returned; WaitSnapshot(STEP) is the
//                        next call, as during forward/backward).
//   --on-daemon-loss=error|continue, --steps=N, --reconnect-ms=MS
//
// Every call that does not simply succeed prints "call NAME STEP STATUS".
// At the end (continue mode, or no loss) it prints one line
// "done {json}" with the steps trained, how many fences found no snapshot,
// whether the client is still unprotected and the final durable step.
//
// Exit codes: 0 trained every step; 3 a call failed with UNAVAILABLE (the
// documented error of OnDaemonLoss::kError; the trainer stops cleanly);
// 1 any other failure (the defect this driver exists to catch).
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <set>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "ckpt/client.h"

namespace {

constexpr int kStoppedOnLoss = 3;

struct Args {
  std::string socket;
  std::string job = "shutdown";
  uint64_t steps = 12;
  bool continue_unprotected = false;
  int64_t reconnect_ms = 100;
  std::set<std::pair<std::string, uint64_t>> pauses;
};

bool ParseArgs(int argc, char** argv, Args* a) {
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    const auto eq = s.find('=');
    const std::string k = s.substr(0, eq), v = eq == std::string::npos ? "" : s.substr(eq + 1);
    bool ok = true;
    if (k == "--socket") {
      a->socket = v;
    } else if (k == "--job") {
      a->job = v;
    } else if (k == "--steps") {
      ok = absl::SimpleAtoi(v, &a->steps);
    } else if (k == "--reconnect-ms") {
      ok = absl::SimpleAtoi(v, &a->reconnect_ms);
    } else if (k == "--on-daemon-loss" && (v == "error" || v == "continue")) {
      a->continue_unprotected = v == "continue";
    } else if (k == "--pause") {
      const auto colon = v.rfind(':');
      uint64_t step = 0;
      const std::string point = v.substr(0, colon);
      ok = colon != std::string::npos && absl::SimpleAtoi(v.substr(colon + 1), &step) &&
           (point == "before_step_done" || point == "before_fence");
      a->pauses.emplace(point, step);
    } else {
      ok = false;
    }
    if (!ok) {
      std::fprintf(stderr, "ckpt_shutdown_trainer: bad argument '%s'\n", s.c_str());
      return false;
    }
  }
  return !a->socket.empty();
}

// Stops at (point, step) when asked to, until the test writes a line.
void MaybePause(const Args& a, const char* point, uint64_t step) {
  if (a.pauses.count({point, step}) == 0) return;
  std::printf("pause %s %" PRIu64 "\n", point, step);
  std::fflush(stdout);
  std::string line;
  std::getline(std::cin, line);
}

// What a failed call means: exit 3 for the documented daemon-loss error,
// exit 1 for anything else.
int Failed(const char* call, uint64_t step, const absl::Status& s) {
  std::printf("call %s %" PRIu64 " %s\n", call, step, s.ToString().c_str());
  std::fflush(stdout);
  return absl::IsUnavailable(s) ? kStoppedOnLoss : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  if (!ParseArgs(argc, argv, &a)) return 2;
  ckpt::ClientOptions co;
  co.socket_path = a.socket;
  co.on_daemon_loss = a.continue_unprotected ? ckpt::OnDaemonLoss::kContinueUnprotected
                                             : ckpt::OnDaemonLoss::kError;
  co.reconnect_interval = absl::Milliseconds(a.reconnect_ms);
  co.wait_timeout = absl::Seconds(60);
  auto client_or = ckpt::Client::Connect(co);
  if (!client_or.ok()) return Failed("connect", 0, client_or.status());
  std::unique_ptr<ckpt::Client> client = std::move(*client_or);

  constexpr uint32_t kLayers = 4;
  constexpr uint64_t kLayerBytes = 64 << 10;
  auto region = client->AllocateRegion(kLayers * kLayerBytes);
  if (!region.ok()) return Failed("allocate", 0, region.status());
  auto* words = static_cast<uint64_t*>(client->RegionData(*region));
  ckpt::RankSpec spec;
  spec.job_id = a.job;
  spec.policy.set_kind(ckpt::v1::POLICY_ALL);
  for (uint32_t l = 0; l < kLayers; ++l) {
    ckpt::LayerDesc layer;
    layer.name = absl::StrCat("layers.", l);
    ckpt::TensorDesc t;
    t.name = absl::StrCat(layer.name, ".weight");
    t.shape = {kLayerBytes / 4};
    t.region = static_cast<uint32_t>(*region);
    t.offset = l * kLayerBytes;
    layer.tensors.push_back(t);
    spec.layers.push_back(layer);
  }
  if (absl::Status s = client->Register(spec); !s.ok()) return Failed("register", 0, s);

  uint64_t lost_fences = 0;
  for (uint64_t t = 1; t <= a.steps; ++t) {
    if (t > 1) {
      MaybePause(a, "before_fence", t - 1);
      auto snap = client->WaitSnapshot(t - 1);
      if (!snap.ok()) return Failed("WaitSnapshot", t - 1, snap.status());
      if (snap->lost) {
        ++lost_fences;
        std::printf("call WaitSnapshot %" PRIu64 " lost\n", t - 1);
      }
    }
    for (uint64_t i = 0; i < kLayers * kLayerBytes / 8; ++i) words[i] = words[i] * 31 + t + i;
    MaybePause(a, "before_step_done", t);
    if (absl::Status s = client->StepDone(t, 1e-3); !s.ok()) return Failed("StepDone", t, s);
    std::fflush(stdout);
  }
  MaybePause(a, "before_fence", a.steps);
  auto snap = client->WaitSnapshot(a.steps);
  if (!snap.ok()) return Failed("WaitSnapshot", a.steps, snap.status());
  if (snap->lost) ++lost_fences;
  // ABORTED is WaitDurable's documented answer for a step whose snapshot was
  // lost with ckptd; the trainer goes on.
  std::string durable = "null";
  auto d = client->WaitDurable(a.steps);
  if (d.ok()) {
    durable = absl::StrCat(*d);
  } else if (!absl::IsAborted(d.status())) {
    return Failed("WaitDurable", a.steps, d.status());
  } else {
    std::printf("call WaitDurable %" PRIu64 " %s\n", a.steps, d.status().ToString().c_str());
  }
  const bool unprotected = client->unprotected();
  if (absl::Status s = client->Unregister(); !s.ok()) return Failed("Unregister", a.steps, s);
  std::printf("done {\"steps\": %" PRIu64 ", \"lost_fences\": %" PRIu64
              ", \"unprotected\": %s, \"durable\": %s, \"generation\": %" PRIu64 "}\n",
              a.steps, lost_fences, unprotected ? "true" : "false", durable.c_str(),
              client->generation());
  return 0;
}
