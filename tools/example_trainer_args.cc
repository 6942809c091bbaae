#include "tools/example_trainer_args.h"

#include <cctype>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "tools/flags.h"

namespace ckpt::tools::example {
uint64_t ParseBytes(const std::string& s) {
  std::string n = s;
  const int unit = n.empty() ? 0 : std::tolower(static_cast<unsigned char>(n.back()));
  const uint64_t mult = unit == 'k' ? 1 << 10 : unit == 'm' ? 1 << 20 : unit == 'g' ? 1 << 30 : 1;
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
    const auto [k, v] = ckpt::tools::SplitFlag(argv[i]);
    bool ok = true;
    if (k == "--socket")
      a->socket = v;
    else if (k == "--job")
      a->job = v;
    else if (k == "--rank")
      ok = Number(k, v, &a->rank);
    else if (k == "--layers")
      ok = Number(k, v, &a->layers);
    else if (k == "--layer-bytes") {
      a->layer_bytes.clear();
      for (absl::string_view p : absl::StrSplit(v, ','))
        a->layer_bytes.push_back(ParseBytes(std::string(p)));
    } else if (k == "--steps")
      ok = Number(k, v, &a->steps);
    else if (k == "--policy")
      a->policy = v;
    else if (k == "--restore")
      a->restore = true;
    else if (k == "--older-within")  // a lost version's layer may take one this much older
      ok = Number(k, v, &a->older_within);
    else if (k == "--log")
      a->log = v;
    else if (k == "--ack-log")
      a->ack_log = v;
    else if (k == "--verify-log")
      a->verify_log = v;
    else if (k == "--dump")
      a->dump = v;
    else if (k == "--durable-every")
      ok = Number(k, v, &a->durable_every);
    else if (k == "--job-nodes")  // the node of each rank of the job, comma-separated
      a->job_nodes = absl::StrSplit(v, ',', absl::SkipEmpty());
    else if (k == "--wait-tier")  // at the end, wait until the last step is there too
      ok = (a->wait_tier = v) == "peer" || v == "remote";
    else if (k == "--compute-ms")
      ok = Number(k, v, &a->compute_ms);
    else if (k == "--on-daemon-loss")
      a->continue_unprotected = (v == "continue");
    else if (k == "--seed")
      ok = Number(k, v, &a->seed);
    else if (k == "--quiet")
      a->quiet = true;
    else if (k == "--reconnect-ms")
      ok = Number(k, v, &a->reconnect_ms);
    else if (k == "--optimizer")
      a->adamw = (v == "adamw");
    else if (k == "--lr")
      ok = Number(k, v, &a->lr);
    else if (k == "--k0")
      ok = Number(k, v, &a->k0);
    else if (k == "--s-max")
      ok = Number(k, v, &a->s_max);
    else if (k == "--warmup")
      ok = Number(k, v, &a->warmup);
    else if (k == "--warmup-interval")
      ok = Number(k, v, &a->warmup_interval);
    else if (k == "--record-trace")
      a->record_trace = true;
    else {
      std::fprintf(
          stderr,
          "usage: ckpt_example_trainer [--socket=PATH] [--job=ID] [--rank=R] [--layers=N]\n"
          "  [--layer-bytes=SIZE[,SIZE...]] [--steps=S] [--policy=all|every_n:K|explicit|none]\n"
          "  [--restore] [--older-within=N] [--verify-log=FILE] [--dump=FILE] [--log=FILE]\n"
          "  [--ack-log=FILE] [--durable-every=K] [--compute-ms=MS] [--wait-tier=peer|remote]\n"
          "  [--job-nodes=NODE,...]\n"
          "  [--on-daemon-loss=error|continue] [--seed=N] [--reconnect-ms=MS] [--quiet]\n"
          "  [--optimizer=none|adamw] [--lr=LR] layercheck: [--k0=K] [--s-max=S] [--warmup=W]\n"
          "  [--warmup-interval=I] [--record-trace]\n");
      return false;
    }
    if (!ok) return false;
  }
  return true;
}

}  // namespace ckpt::tools::example
