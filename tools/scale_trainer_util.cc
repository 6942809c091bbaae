// ckpt_scale_trainer's flags and helpers (scale_trainer.h).
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "tools/flags.h"
#include "tools/scale_trainer.h"

namespace ckpt_scale {

bool Parse(int argc, char** argv, Args* a) {
  for (int i = 1; i < argc; ++i) {
    const auto [k, v] = ckpt::tools::SplitFlag(argv[i]);
    bool ok = true;
    if (k == "--socket")
      a->socket = v;
    else if (k == "--job")
      a->job = v;
    else if (k == "--rank")
      ok = absl::SimpleAtoi(v, &a->rank);
    else if (k == "--ranks")
      ok = absl::SimpleAtoi(v, &a->ranks) && a->ranks > 0;
    else if (k == "--world")
      ok = absl::SimpleAtoi(v, &a->world);
    else if (k == "--layers")
      ok = absl::SimpleAtoi(v, &a->layers) && a->layers > 0;
    else if (k == "--tensors")
      ok = absl::SimpleAtoi(v, &a->tensors) && a->tensors > 0;
    else if (k == "--tensor-bytes")
      ok = absl::SimpleAtoi(v, &a->tensor_bytes) && a->tensor_bytes >= 8;
    else if (k == "--policy") {
      a->policy = v;
      if (v.rfind("explicit:", 0) == 0) {
        a->policy = "explicit";
        ok = absl::SimpleAtoi(v.substr(9), &a->per_step) && a->per_step > 0;
      } else {
        ok = v == "all" || v == "none";
      }
    } else if (k == "--steps")
      ok = absl::SimpleAtoi(v, &a->steps);
    else if (k == "--seconds")
      ok = absl::SimpleAtod(v, &a->seconds);
    else if (k == "--warmup")
      ok = absl::SimpleAtoi(v, &a->warmup);
    else if (k == "--compute-ms")
      ok = absl::SimpleAtoi(v, &a->compute_ms);
    else if (k == "--durable-every")
      ok = absl::SimpleAtoi(v, &a->durable_every);
    else if (k == "--restore")
      a->restore = true;
    else if (k == "--restore-discard")
      a->restore = a->restore_discard = true;
    else if (k == "--plan")
      a->plan = true;
    else if (k == "--hold")
      a->hold = true;
    else if (k == "--daemon-pid")
      ok = absl::SimpleAtoi(v, &a->daemon_pid);
    else if (k == "--ready-file")
      a->ready_file = v;
    else if (k == "--go-file")
      a->go_file = v;
    else if (k == "--out")
      a->out = v;
    else
      ok = false;
    if (!ok) {
      std::fprintf(stderr, "ckpt_scale_trainer: bad argument '%s'\n", argv[i]);
      return false;
    }
  }
  return true;
}

// utime + stime of process `pid` in seconds (-1 when unreadable).
double CpuSeconds(int pid) {
  if (pid <= 0) return -1;
  FILE* f = std::fopen(absl::StrCat("/proc/", pid, "/stat").c_str(), "r");
  if (f == nullptr) return -1;
  char buf[4096];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* p = std::strrchr(buf, ')');  // the command name may hold spaces
  if (p == nullptr) return -1;
  unsigned long long utime = 0, stime = 0;
  // Fields after the name: state (3) .. utime (14), stime (15).
  if (std::sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &utime, &stime) !=
      2) {
    return -1;
  }
  return static_cast<double>(utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

double Since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

nlohmann::json Summary(std::vector<double> v) {
  nlohmann::json j;
  j["n"] = v.size();
  if (v.empty()) return j;
  std::sort(v.begin(), v.end());
  double sum = 0;
  for (double x : v) sum += x;
  auto q = [&v](double p) {
    const size_t i = static_cast<size_t>(p * static_cast<double>(v.size() - 1) + 0.5);
    return v[std::min(i, v.size() - 1)];
  };
  j["mean"] = sum / static_cast<double>(v.size());
  j["p50"] = q(0.50);
  j["p90"] = q(0.90);
  j["p99"] = q(0.99);
  j["max"] = v.back();
  return j;
}

// Rank threads start their steps together and stop at one deadline.

}  // namespace ckpt_scale
