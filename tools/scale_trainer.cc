// ckpt_scale_trainer: synthetic ranks that measure what ckptd costs a
// trainer, for the scaling sweeps (tests/perf/sweep.py, docs/scaling.md).
//
// One process runs --ranks rank threads of one job (ranks --rank ..
// --rank + --ranks - 1); each thread is a trainer rank of its own: its own
// ckpt::Client (connection), shared-memory region and registration. Every
// rank has --layers layers of --tensors tensors of --tensor-bytes bytes.
// Per step a rank fences (WaitSnapshot of the previous step), changes one
// word of each tensor it will report, sleeps --compute-ms (the forward and
// backward pass) and reports StepDone; every --durable-every steps it waits
// for durability. Each call is timed on the trainer's side.
//
//   --policy=all           every layer every step
//   --policy=explicit:K    K layers per step, rotating through the layers
//   --policy=none          nothing is written (the bookkeeping alone)
//   --steps=S | --seconds=T   steps per rank, or run for T seconds
//   --warmup=W             steps not counted (the first persists every layer)
//   --restore              restore the composite checkpoint first (timed)
//   --restore-discard      the same with discard_later (later steps deleted)
//   --plan                 time Plan(0) after registering
//   --hold                 after the steps, print "holding" and wait for a
//                          line on stdin before unregistering (memory and
//                          descriptor figures of a daemon with these ranks)
//   --ready-file=F --go-file=G   after the warm-up, create F, and start the
//                          measured steps once G exists (a sweep's processes
//                          measure the same window)
//   --out=FILE             one JSON document: per rank the figures below
//
// Per rank: register_s, restore_s, plan_s, steps, seconds, stepdone and
// fence (and durable) latency summaries {n, mean, p50, p90, p99, max} in
// seconds, skipped versions, and errors. Exit status 0 when every call
// succeeded, 1 otherwise.
#include "tools/scale_trainer.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "ckpt/client.h"
#include "nlohmann/json.hpp"
#include "tools/flags.h"

namespace {

using ckpt_scale::Args;
using ckpt_scale::CpuSeconds;
using ckpt_scale::Parse;
using ckpt_scale::Shared;
using ckpt_scale::Since;
using ckpt_scale::Summary;

class RankRunner {
 public:
  RankRunner(const Args& a, uint32_t rank, Shared* shared) : a_(a), rank_(rank), shared_(shared) {}

  nlohmann::json Run() {
    nlohmann::json out;
    out["rank"] = rank_;
    if (!Setup(&out)) {
      shared_->failed_late.fetch_add(1);
      Arrive(false);
      shared_->done.fetch_add(1);
      return Fail(out);
    }
    Arrive(true);
    WaitStart();
    warm_ = false;
    const bool trained = Train(&out);
    if (!trained && !warm_) shared_->failed_late.fetch_add(1);
    shared_->done.fetch_add(1);
    if (a_.hold) Hold();
    if (!trained) return Fail(out);
    if (absl::Status s = client_->Unregister(/*drain=*/false); !s.ok()) {
      out["error"] = absl::StrCat("unregister: ", s.ToString());
      return Fail(out);
    }
    return out;
  }

  // Waits for the other ranks of this process to register, then for the
  // common start.
  void WaitStart() {
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(shared_->mu);
        if (shared_->registered + shared_->failed == a_.ranks) {
          if (!shared_->started) {
            shared_->started = true;
            shared_->start = std::chrono::steady_clock::now();
          }
          return;
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

 private:
  nlohmann::json Fail(nlohmann::json out) {
    shared_->any_error = true;
    std::fprintf(stderr, "rank %u: %s\n", rank_, out.value("error", std::string("?")).c_str());
    return out;
  }

  // Every rank has written its warm-up (a failed rank counts as done), so
  // the measured steps of all ranks start together.
  // With --ready-file/--go-file, the processes of a sweep start their
  // measured steps together too: this process says it is warm, then waits
  // for the go.
  void WarmupDone() {
    shared_->warm.fetch_add(1);
    while (shared_->warm.load() + shared_->failed_late.load() < a_.ranks) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    std::call_once(shared_->cpu_once, [this] {
      if (!a_.ready_file.empty()) {
        FILE* f = std::fopen(a_.ready_file.c_str(), "w");
        if (f != nullptr) std::fclose(f);
      }
      while (!a_.go_file.empty() && ::access(a_.go_file.c_str(), F_OK) != 0) {
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
      shared_->cpu_start = CpuSeconds(shared_->daemon_pid);
      shared_->measure_start = std::chrono::steady_clock::now();
    });
  }
  void MeasuredDone() {}
  void Drained() {
    if (shared_->drained.fetch_add(1) + 1 == a_.ranks)
      shared_->cpu_end = CpuSeconds(shared_->daemon_pid);
  }

  void Arrive(bool ok) {
    std::lock_guard<std::mutex> lock(shared_->mu);
    (ok ? shared_->registered : shared_->failed) += 1;
  }

  bool Setup(nlohmann::json* out) {
    ckpt::ClientOptions co;
    co.socket_path = a_.socket;
    co.call_timeout = absl::Seconds(120);
    co.wait_timeout = absl::Seconds(600);
    auto client = ckpt::Client::Connect(co);
    if (!client.ok()) {
      (*out)["error"] = absl::StrCat("connect: ", client.status().ToString());
      return false;
    }
    client_ = std::move(*client);
    const uint64_t layer_bytes = uint64_t{a_.tensors} * a_.tensor_bytes;
    auto region = client_->AllocateRegion(uint64_t{a_.layers} * layer_bytes);
    if (!region.ok()) {
      (*out)["error"] = absl::StrCat("allocate: ", region.status().ToString());
      return false;
    }
    base_ = static_cast<char*>(client_->RegionData(*region));
    ckpt::RankSpec spec;
    spec.job_id = a_.job;
    spec.rank = rank_;
    spec.world_size = a_.world > 0 ? a_.world : a_.rank + a_.ranks;
    spec.layers.reserve(a_.layers);
    for (uint32_t l = 0; l < a_.layers; ++l) {
      ckpt::LayerDesc ld;
      ld.name = absl::StrCat("layers.", l);
      for (uint32_t t = 0; t < a_.tensors; ++t) {
        ckpt::TensorDesc td;
        td.name = absl::StrCat("t", t);
        td.dtype = ckpt::v1::DTYPE_U8;
        td.shape = {a_.tensor_bytes};
        td.region = static_cast<uint32_t>(*region);
        td.offset = uint64_t{l} * layer_bytes + uint64_t{t} * a_.tensor_bytes;
        ld.tensors.push_back(std::move(td));
      }
      spec.layers.push_back(std::move(ld));
    }
    if (a_.policy == "all") {
      spec.policy.set_kind(ckpt::v1::POLICY_ALL);
    } else if (a_.policy == "none") {
      spec.policy.set_kind(ckpt::v1::POLICY_NONE);
    } else {
      spec.policy.set_kind(ckpt::v1::POLICY_EXPLICIT);
    }
    auto t0 = std::chrono::steady_clock::now();
    if (absl::Status s = client_->Register(spec); !s.ok()) {
      (*out)["error"] = absl::StrCat("register: ", s.ToString());
      return false;
    }
    (*out)["register_s"] = Since(t0);
    step_ = client_->latest_durable_step_at_register();
    (*out)["durable_at_register"] = step_;
    if (a_.plan) {
      t0 = std::chrono::steady_clock::now();
      auto plan = client_->Plan(0);
      (*out)["plan_s"] = Since(t0);
      if (!plan.ok() && !absl::IsNotFound(plan.status())) {
        (*out)["error"] = absl::StrCat("plan: ", plan.status().ToString());
        return false;
      }
    }
    if (a_.restore && step_ > 0) {
      t0 = std::chrono::steady_clock::now();
      auto r = client_->Restore(0, a_.restore_discard);
      (*out)["restore_s"] = Since(t0);
      if (!r.ok()) {
        (*out)["error"] = absl::StrCat("restore: ", r.status().ToString());
        return false;
      }
      (*out)["restore_daemon_s"] = r->seconds();
      (*out)["restore_bytes"] = r->bytes_restored();
      (*out)["restore_layers"] = r->plan().layers_size();
      step_ = r->plan().target_step();
    }
    return true;
  }

  // The layers reported at step t.
  void Select(uint64_t t, std::vector<uint32_t>* layers) const {
    layers->clear();
    if (a_.policy == "explicit") {
      const uint32_t k = std::min(a_.per_step, a_.layers);
      const uint64_t first = (t * k) % a_.layers;
      for (uint32_t i = 0; i < k; ++i)
        layers->push_back(static_cast<uint32_t>((first + i) % a_.layers));
    }
  }

  void Touch(uint32_t layer, uint64_t t) {
    char* p = base_ + uint64_t{layer} * a_.tensors * a_.tensor_bytes;
    for (uint32_t i = 0; i < a_.tensors; ++i) {
      std::memcpy(p + uint64_t{i} * a_.tensor_bytes, &t, sizeof(t));
    }
  }

  // What the measured steps of Train count.
  struct Figures {
    std::vector<double> stepdone, fence, durable;  // seconds per call
    uint64_t skipped = 0, reported = 0, counted = 0;
    // A StepDone refused for a quota (RESOURCE_EXHAUSTED: ckptd is behind)
    // is counted and the step goes unreported, as a trainer that keeps
    // training would do; the next step is reported instead.
    uint64_t refused = 0;
  };

  // Whether the loop ends before step index i (steps done so far): after
  // --warmup + --steps steps, or with --seconds once that long has passed
  // since the common start of the measured steps.
  bool Finished(uint64_t i) const {
    return a_.seconds > 0 ? i > a_.warmup && Since(shared_->measure_start) >= a_.seconds
                          : i >= a_.warmup + a_.steps;
  }

  // The warm-up's versions (the first step writes every layer) are written
  // before the measured steps start; then this rank waits for the others.
  bool EndWarmup(nlohmann::json* out) {
    if (unfenced_) {
      auto snap = client_->WaitSnapshot(step_);
      auto d = snap.ok() ? client_->WaitDurable(step_) : absl::StatusOr<uint64_t>(snap.status());
      if (!d.ok() && !absl::IsAborted(d.status())) {
        (*out)["error"] = absl::StrCat("warm-up wait durable: ", d.status().ToString());
        return false;
      }
      unfenced_ = false;
    }
    warm_ = true;
    WarmupDone();
    return true;
  }

  // The fence: the snapshot of the step reported last.
  bool Fence(bool measured, nlohmann::json* out) {
    auto f0 = std::chrono::steady_clock::now();
    auto snap = client_->WaitSnapshot(step_);
    const double f = Since(f0);
    if (!snap.ok()) {
      (*out)["error"] = absl::StrCat("wait snapshot ", step_, ": ", snap.status().ToString());
      return false;
    }
    unfenced_ = false;
    if (measured) {
      figures_.fence.push_back(f);
      figures_.skipped += snap->skipped;
    }
    return true;
  }

  // Step t: the layers it reports change, the compute time passes, and
  // StepDone reports it. False on an error; a refused step is counted and
  // goes unreported.
  bool Step(uint64_t t, bool measured, nlohmann::json* out) {
    Select(t, &layers_);
    if (a_.policy == "explicit") {
      for (uint32_t l : layers_) Touch(l, t);
    } else {
      for (uint32_t l = 0; l < a_.layers; ++l) Touch(l, t);
    }
    if (a_.compute_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(a_.compute_ms));
    auto s0 = std::chrono::steady_clock::now();
    absl::Status s = client_->StepDone(t, 1e-4, "", layers_);
    const double sd = Since(s0);
    if (absl::IsResourceExhausted(s)) {
      if (measured) ++figures_.refused;
      return true;
    }
    if (!s.ok()) {
      (*out)["error"] = absl::StrCat("step done ", t, ": ", s.ToString());
      return false;
    }
    step_ = t;
    unfenced_ = true;
    if (measured) {
      figures_.stepdone.push_back(sd);
      ++figures_.counted;
      figures_.reported +=
          a_.policy == "explicit" ? layers_.size() : (a_.policy == "all" ? a_.layers : 0);
    }
    if (a_.durable_every > 0 && t % a_.durable_every == 0) {
      auto d0 = std::chrono::steady_clock::now();
      auto d = client_->WaitDurable(t);
      if (measured) figures_.durable.push_back(Since(d0));
      if (!d.ok() && !absl::IsAborted(d.status())) {
        (*out)["error"] = absl::StrCat("wait durable ", t, ": ", d.status().ToString());
        return false;
      }
    }
    return true;
  }

  // Everything reported becomes durable (a layer skipped for a full pool
  // makes this ABORTED: counted, not an error).
  bool Drain(nlohmann::json* out) {
    auto d0 = std::chrono::steady_clock::now();
    auto snap = client_->WaitSnapshot(step_);
    absl::StatusOr<uint64_t> d =
        snap.ok() ? absl::StatusOr<uint64_t>(uint64_t{0}) : absl::StatusOr<uint64_t>(snap.status());
    // ckptd bounds one wait (30 s); a long backlog takes several.
    while (snap.ok()) {
      d = client_->WaitDurable(step_);
      if (!absl::IsDeadlineExceeded(d.status()) || Since(d0) > 900) break;
    }
    (*out)["drain_s"] = Since(d0);
    if (!d.ok() && !absl::IsAborted(d.status())) {
      (*out)["error"] = absl::StrCat("final wait durable: ", d.status().ToString());
      return false;
    }
    (*out)["final_durable_ok"] = d.ok();
    return true;
  }

  // The warm-up, the measured steps and the drain; the figures go to `out`.
  bool Train(nlohmann::json* out) {
    const uint64_t first = step_ + 1;
    auto t_measure = std::chrono::steady_clock::now();
    for (uint64_t t = first;; ++t) {
      const uint64_t i = t - first;  // steps done so far
      if (Finished(i)) break;
      if (i == a_.warmup) {
        if (!EndWarmup(out)) return false;
        t_measure = shared_->measure_start;
      }
      const bool measured = i >= a_.warmup;
      if (unfenced_ && !Fence(measured, out)) return false;
      if (!Step(t, measured, out)) return false;
    }
    const double train_s = Since(t_measure);
    MeasuredDone();
    if (!Drain(out)) return false;
    Drained();
    (*out)["last_step"] = step_;
    (*out)["steps"] = figures_.counted;
    (*out)["seconds"] = train_s;
    (*out)["steps_per_s"] = train_s > 0 ? static_cast<double>(figures_.counted) / train_s : 0.0;
    (*out)["versions_reported"] = figures_.reported;
    (*out)["skipped"] = figures_.skipped;
    (*out)["refused"] = figures_.refused;
    (*out)["stepdone"] = Summary(figures_.stepdone);
    (*out)["fence"] = Summary(figures_.fence);
    (*out)["durable"] = Summary(figures_.durable);
    return true;
  }

  void Hold() {
    // One thread reads stdin for the whole process (main); the others wait
    // for it through the flag.
    std::lock_guard<std::mutex> lock(hold_mu_);
  }

 public:
  static std::mutex hold_mu_;

 private:
  const Args& a_;
  const uint32_t rank_;
  Shared* const shared_;
  std::unique_ptr<ckpt::Client> client_;
  char* base_ = nullptr;
  uint64_t step_ = 0;
  bool warm_ = false;
  // Train's state: step_ was reported and not fenced yet; the layers the
  // step reports; the figures of the measured steps.
  bool unfenced_ = false;
  std::vector<uint32_t> layers_;
  Figures figures_;
};

std::mutex RankRunner::hold_mu_;

}  // namespace

int main(int argc, char** argv) {
  Args a;
  if (!Parse(argc, argv, &a)) {
    std::fprintf(stderr,
                 "usage: ckpt_scale_trainer --socket=PATH --job=ID [--rank=R] [--ranks=K] "
                 "[--world=N] [--layers=N] [--tensors=T] [--tensor-bytes=B] "
                 "[--policy=all|none|explicit:K] [--steps=S | --seconds=T] [--warmup=W] "
                 "[--compute-ms=MS] [--durable-every=D] [--restore] [--restore-discard] [--plan] "
                 "[--hold] [--daemon-pid=PID] [--ready-file=F --go-file=G] [--out=FILE]\n");
    return 2;
  }
  Shared shared;
  shared.daemon_pid = a.daemon_pid;
  // Holding: the rank threads block on hold_mu_ until stdin has a line.
  std::unique_lock<std::mutex> hold(RankRunner::hold_mu_, std::defer_lock);
  if (a.hold) hold.lock();
  std::vector<nlohmann::json> results(a.ranks);
  std::vector<std::thread> threads;
  for (uint32_t i = 0; i < a.ranks; ++i) {
    threads.emplace_back([&, i] {
      RankRunner runner(a, a.rank + i, &shared);
      results[i] = runner.Run();
    });
  }
  if (a.hold) {
    // Every rank has trained and waits in Hold (or failed).
    while (shared.done.load() < a.ranks) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    std::printf("holding\n");
    std::fflush(stdout);
    std::string line;
    std::getline(std::cin, line);
    hold.unlock();
  }
  for (std::thread& t : threads) t.join();
  nlohmann::json doc;
  doc["job"] = a.job;
  doc["layers"] = a.layers;
  doc["tensors"] = a.tensors;
  doc["tensor_bytes"] = a.tensor_bytes;
  doc["policy"] = a.policy;
  doc["ranks"] = results;
  if (shared.cpu_start >= 0 && shared.cpu_end >= 0) {
    doc["daemon_cpu_s"] = shared.cpu_end - shared.cpu_start;  // measured steps, all ranks
  }
  const std::string text = doc.dump();
  if (!a.out.empty()) {
    FILE* f = std::fopen(a.out.c_str(), "w");
    if (f == nullptr || std::fputs(text.c_str(), f) < 0 || std::fclose(f) != 0) {
      std::fprintf(stderr, "ckpt_scale_trainer: cannot write %s\n", a.out.c_str());
      return 1;
    }
  } else {
    std::printf("%s\n", text.c_str());
  }
  return shared.any_error ? 1 : 0;
}
