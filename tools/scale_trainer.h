// What ckpt_scale_trainer's files share: its flags, the state its rank
// threads share, and small helpers (scale_trainer.cc has the ranks).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"

namespace ckpt_scale {

struct Args {
  std::string socket = "/run/ckptd/ckptd.sock";
  std::string job = "scale";
  uint32_t rank = 0;
  uint32_t ranks = 1;
  uint32_t world = 0;  // 0 = rank + ranks
  uint32_t layers = 8;
  uint32_t tensors = 1;
  uint64_t tensor_bytes = 256;
  std::string policy = "all";
  uint32_t per_step = 0;  // explicit:K
  uint64_t steps = 20;
  double seconds = 0;
  uint64_t warmup = 2;
  uint64_t compute_ms = 0;
  uint64_t durable_every = 0;
  bool restore = false;
  bool restore_discard = false;  // RestoreRequest.discard_later
  bool plan = false;
  bool hold = false;
  int daemon_pid = 0;               // ckptd's CPU time is read from /proc around the measured steps
  std::string ready_file, go_file;  // a sweep's processes start measuring together
  std::string out;
};

// Parses the flags into `a`; false (after a message) on a bad one.
bool Parse(int argc, char** argv, Args* a);
// The CPU seconds process `pid` has used (user + system); -1 when unknown.
double CpuSeconds(int pid);
// Seconds since `t0`.
double Since(std::chrono::steady_clock::time_point t0);
// {n, mean, p50, p90, p99, max} of `v`.
nlohmann::json Summary(std::vector<double> v);

struct Shared {
  std::mutex mu;
  uint32_t registered = 0;
  uint32_t failed = 0;
  std::chrono::steady_clock::time_point start;
  bool started = false;
  std::atomic<bool> any_error{false};
  std::atomic<uint32_t> done{0};  // ranks that finished training (or failed)
  // ckptd's CPU seconds when the first rank starts its measured steps, and
  // when the last rank has drained them.
  int daemon_pid = 0;
  std::once_flag cpu_once;
  double cpu_start = -1;
  std::chrono::steady_clock::time_point measure_start;  // set once, before any rank reads it
  std::atomic<uint32_t> drained{0};
  std::atomic<uint32_t> warm{0};         // ranks past their warm-up
  std::atomic<uint32_t> failed_late{0};  // ranks that failed before the end of theirs
  double cpu_end = -1;
};

}  // namespace ckpt_scale
