// The command line of ckpt_example_trainer (tools/example_trainer.cc).
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/strings/numbers.h"

namespace ckpt::tools::example {

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
  uint64_t durable_every = 0, compute_ms = 0, older_within = 0;
  std::string wait_tier;               // "", "peer" or "remote"
  std::vector<std::string> job_nodes;  // as a trainer would gather them (--job-nodes)
  bool continue_unprotected = false;
  uint64_t seed = 1, reconnect_ms = 300;
  bool quiet = false;
  bool adamw = false;  // --optimizer=adamw: real AdamW steps on w, exp_avg, exp_avg_sq
  double lr = 1e-4;
  double k0 = 0;  // layercheck overrides (0 = daemon default)
  uint64_t s_max = 0;
  int64_t warmup = -1;
  uint64_t warmup_interval = 0;
  bool record_trace = false;
};

// "4M", "512K", "1G" or a number of bytes; anything else ends the program
// with exit 2.
uint64_t ParseBytes(const std::string& s);

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
  if (!ok) {
    std::fprintf(stderr, "ckpt_example_trainer: %s: '%s' is not a number\n", k.c_str(), v.c_str());
  }
  return ok;
}
// Fills `a` from argv; false (after printing why, or the usage) on an
// unknown flag or a bad value.
bool ParseArgs(int argc, char** argv, Args* a);

}  // namespace ckpt::tools::example
