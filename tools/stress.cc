// ckpt_stress: many simulated ranks and jobs against a live ckptd, each
// checked against an in-memory oracle of what ckptd acknowledged.
//
// Each actor is one (job, rank) with a few small layers whose bytes at step t
// are a pure function of (job, rank, layer, t); every step rewrites every
// layer, so a layer restored "as of step s" must hold exactly f(s). Worker
// threads pick actors at random and run one random operation on each:
//   step        fence, write step t, StepDone(t) with a random explicit layer
//               subset (so plans mix steps)
//   durable     WaitDurable: the oracle records, per layer, the newest step
//               whose snapshot held it
//   plan        Plan: every layer's planned step >= its acknowledged step, and
//               the target >= the acknowledged durable step
//   restore     a restarted trainer: a new client registers and restores;
//               every layer holds exactly f(its planned step), and the plan
//               satisfies the oracle
//   gc          Admin.Gc of the actor's job, then the plan check
//   reregister  Unregister (drained or not) and register again
// Calls that fail for allowed reasons (a full pool, a drain still running)
// are counted as errors; a disagreement with the oracle is a violation and
// makes the exit status 1.
//
// Usage: ckpt_stress --socket=PATH [--jobs=4] [--ranks=2] [--threads=4]
//        [--layers=4] [--layer-bytes=16384] [--seconds=20] [--seed=N] [--prefix=stress]
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cinttypes>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "ckpt/client.h"
#include "ckpt/v1/ckpt.grpc.pb.h"
#include "tools/flags.h"

namespace {

using ckpt::v1::Admin;

struct Options {
  std::string socket = "/run/ckptd/ckptd.sock";
  uint32_t jobs = 4;
  uint32_t ranks = 2;
  uint32_t threads = 4;
  uint32_t layers = 4;
  uint64_t layer_bytes = 16384;
  double seconds = 20;
  uint64_t seed = 1;
  std::string prefix = "stress";
};

enum Op { kStep, kDurable, kPlan, kRestore, kGc, kReregister, kNumOps };
const char* const kOpNames[kNumOps] = {"step", "durable", "plan", "restore", "gc", "reregister"};
// Relative frequency of each operation.
const int kOpWeights[kNumOps] = {60, 12, 10, 6, 6, 6};

struct Counters {
  std::atomic<uint64_t> ops[kNumOps] = {};
  std::atomic<uint64_t> errors{0};
  std::atomic<uint64_t> violations{0};
  std::atomic<uint64_t> layers_restored{0};
};

uint32_t Value(uint32_t job, uint32_t rank, uint32_t layer, uint64_t step, uint64_t i) {
  uint64_t x = (uint64_t{job} << 48) ^ (uint64_t{rank} << 40) ^ (uint64_t{layer} << 32) ^
               (step * 0x9e3779b97f4a7c15ull) ^ (i * 0xbf58476d1ce4e5b9ull);
  x ^= x >> 31;
  x *= 0x94d049bb133111ebull;
  return static_cast<uint32_t>(x ^ (x >> 29));
}

class Actor {
 public:
  Actor(const Options& o, uint32_t job, uint32_t rank, Counters* c)
      : o_(o),
        job_(job),
        rank_(rank),
        job_id_(absl::StrCat(o.prefix, "-", job)),
        c_(c),
        staged_(o.layers, 0),
        acked_(o.layers, 0) {}

  std::mutex& mu() { return mu_; }

  void Run(Op op, std::mt19937_64* rng, Admin::Stub* admin) {
    if (client_ == nullptr && !Connect(/*restore=*/false)) return;
    switch (op) {
      case kStep:
        Step(rng);
        break;
      case kDurable:
        Durable();
        break;
      case kPlan:
        PlanCheck("plan");
        break;
      case kRestore:
        Connect(/*restore=*/true);
        break;
      case kGc: {
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
        ckpt::v1::GcRequest req;
        req.set_job_id(job_id_);
        ckpt::v1::GcReply reply;
        if (!admin->Gc(&ctx, req, &reply).ok()) c_->errors.fetch_add(1);
        PlanCheck("after gc");
        break;
      }
      case kReregister: {
        const bool drain = (*rng)() % 2 == 0;
        if (!client_->Unregister(drain).ok()) c_->errors.fetch_add(1);
        client_.reset();
        Connect(/*restore=*/false);
        break;
      }
      default:
        break;
    }
    c_->ops[op].fetch_add(1);
  }

  // At the end: everything reported is made durable once more and checked.
  void Finish() {
    if (client_ == nullptr && !Connect(false)) return;
    Durable();
    PlanCheck("final");
  }

 private:
  // A new client (a restarted trainer process): registers; with `restore`,
  // restores and checks every layer's bytes against its planned step.
  bool Connect(bool restore) {
    client_.reset();
    ckpt::ClientOptions co;
    co.socket_path = o_.socket;
    co.call_timeout = absl::Seconds(30);
    co.wait_timeout = absl::Seconds(60);
    auto client = ckpt::Client::Connect(co);
    if (!client.ok()) return Error(client.status());
    auto region = (*client)->AllocateRegion(o_.layers * o_.layer_bytes);
    if (!region.ok()) return Error(region.status());
    data_ = static_cast<uint32_t*>((*client)->RegionData(*region));
    ckpt::RankSpec spec;
    spec.job_id = job_id_;
    spec.rank = rank_;
    spec.world_size = o_.ranks;
    spec.policy.set_kind(ckpt::v1::POLICY_EXPLICIT);
    for (uint32_t l = 0; l < o_.layers; ++l) {
      ckpt::LayerDesc ld;
      ld.name = absl::StrCat("layer", l);
      ckpt::TensorDesc t;
      t.name = "w";
      t.dtype = ckpt::v1::DTYPE_U8;
      t.shape = {o_.layer_bytes};
      t.region = static_cast<uint32_t>(*region);
      t.offset = l * o_.layer_bytes;
      ld.tensors.push_back(t);
      spec.layers.push_back(ld);
    }
    if (absl::Status s = (*client)->Register(spec); !s.ok()) return Error(s);
    client_ = std::move(*client);
    // The daemon continues after its latest durable step; what was reported
    // after it and never became durable is gone (and was never acknowledged).
    step_ = std::max<uint64_t>(client_->latest_durable_step_at_register(), acked_durable_);
    staged_ = acked_;
    if (!restore || client_->latest_durable_step_at_register() == 0) return true;
    absl::StatusOr<ckpt::v1::RestoreReply> r = client_->Restore(0);
    if (!r.ok()) return Error(r.status());
    CheckPlan(r->plan(), "restore");
    for (const ckpt::v1::LayerPlan& lp : r->plan().layers()) {
      if (!lp.has_version()) continue;
      c_->layers_restored.fetch_add(1);
      if (!Holds(lp.layer(), lp.step())) {
        Violation(absl::StrCat("restore: layer ", lp.layer(), " does not hold its bytes of step ",
                               lp.step()));
      }
      staged_[lp.layer()] = lp.step();
    }
    step_ = r->plan().target_step();
    return true;
  }

  void Step(std::mt19937_64* rng) {
    if (step_ > 0 && !Fence()) return;
    const uint64_t t = step_ + 1;
    for (uint32_t l = 0; l < o_.layers; ++l) Fill(l, t);
    std::vector<uint32_t> layers;
    for (uint32_t l = 0; l < o_.layers; ++l) {
      if ((*rng)() % 3 == 0) layers.push_back(l);
    }
    if (absl::Status s = client_->StepDone(t, 1e-3, "", layers); !s.ok()) {
      Error(s);
      client_.reset();  // a restarted trainer next time
      return;
    }
    step_ = t;
  }

  // WaitSnapshot(step_): learns which layers the snapshot of step_ held.
  bool Fence() {
    absl::StatusOr<ckpt::SnapshotInfo> info = client_->WaitSnapshot(step_);
    if (!info.ok()) {
      Error(info.status());
      client_.reset();
      return false;
    }
    for (uint32_t l : info->layers) staged_[l] = std::max(staged_[l], step_);
    return true;
  }

  void Durable() {
    if (step_ == 0 || !Fence()) return;
    absl::StatusOr<uint64_t> durable = client_->WaitDurable(step_);
    if (!durable.ok()) {
      Error(durable.status());  // ABORTED: a layer was skipped; retried next step
      return;
    }
    acked_ = staged_;
    acked_durable_ = std::max(acked_durable_, step_);
  }

  void PlanCheck(const char* what) {
    if (acked_durable_ == 0) return;
    absl::StatusOr<ckpt::v1::Plan> plan = client_->Plan(0);
    if (!plan.ok()) {
      Violation(
          absl::StrCat(what, ": no plan after an acknowledged step: ", plan.status().ToString()));
      return;
    }
    CheckPlan(*plan, what);
  }

  void CheckPlan(const ckpt::v1::Plan& plan, const std::string& what) {
    if (plan.target_step() < acked_durable_) {
      Violation(absl::StrCat(what, ": plan target ", plan.target_step(), " < acknowledged ",
                             acked_durable_));
    }
    for (const ckpt::v1::LayerPlan& lp : plan.layers()) {
      if (lp.layer() < acked_.size() && acked_[lp.layer()] > 0 &&
          (!lp.has_version() || lp.step() < acked_[lp.layer()])) {
        Violation(absl::StrCat(what, ": layer ", lp.layer(), " planned at ", lp.step(),
                               ", acknowledged at ", acked_[lp.layer()]));
      }
    }
  }

  void Fill(uint32_t layer, uint64_t step) {
    uint32_t* p = data_ + layer * (o_.layer_bytes / 4);
    for (uint64_t i = 0; i < o_.layer_bytes / 4; ++i) p[i] = Value(job_, rank_, layer, step, i);
  }

  bool Holds(uint32_t layer, uint64_t step) const {
    const uint32_t* p = data_ + layer * (o_.layer_bytes / 4);
    for (uint64_t i = 0; i < o_.layer_bytes / 4; ++i) {
      if (p[i] != Value(job_, rank_, layer, step, i)) return false;
    }
    return true;
  }

  bool Error(const absl::Status& s) {
    c_->errors.fetch_add(1);
    if (std::getenv("CKPT_STRESS_VERBOSE") != nullptr) {
      std::fprintf(stderr, "error job %s rank %u: %s\n", job_id_.c_str(), rank_,
                   s.ToString().c_str());
    }
    return false;
  }

  void Violation(const std::string& what) {
    c_->violations.fetch_add(1);
    std::fprintf(stderr, "VIOLATION job %s rank %u: %s\n", job_id_.c_str(), rank_, what.c_str());
  }

  const Options& o_;
  const uint32_t job_;
  const uint32_t rank_;
  const std::string job_id_;
  Counters* c_;
  std::mutex mu_;
  std::unique_ptr<ckpt::Client> client_;
  uint32_t* data_ = nullptr;
  uint64_t step_ = 0;             // last step reported
  std::vector<uint64_t> staged_;  // per layer: newest step whose snapshot held it
  std::vector<uint64_t> acked_;   // per layer: acknowledged (durable) step
  uint64_t acked_durable_ = 0;
};

bool Parse(int argc, char** argv, Options* o) {
  for (int i = 1; i < argc; ++i) {
    const auto [k, v] = ckpt::tools::SplitFlag(argv[i]);
    bool ok = true;
    if (k == "--socket")
      o->socket = v;
    else if (k == "--jobs")
      ok = absl::SimpleAtoi(v, &o->jobs) && o->jobs > 0;
    else if (k == "--ranks")
      ok = absl::SimpleAtoi(v, &o->ranks) && o->ranks > 0;
    else if (k == "--threads")
      ok = absl::SimpleAtoi(v, &o->threads) && o->threads > 0;
    else if (k == "--layers")
      ok = absl::SimpleAtoi(v, &o->layers) && o->layers > 0;
    else if (k == "--layer-bytes")
      ok = absl::SimpleAtoi(v, &o->layer_bytes) && o->layer_bytes % 4 == 0 && o->layer_bytes > 0;
    else if (k == "--seconds")
      ok = absl::SimpleAtod(v, &o->seconds);
    else if (k == "--seed")
      ok = absl::SimpleAtoi(v, &o->seed);
    else if (k == "--prefix")
      o->prefix = v;
    else
      ok = false;
    if (!ok) {
      std::fprintf(stderr, "ckpt_stress: bad argument '%s'\n", argv[i]);
      return false;
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (!Parse(argc, argv, &o)) {
    std::fprintf(stderr,
                 "usage: ckpt_stress --socket=PATH [--jobs=N] [--ranks=N] [--threads=N] "
                 "[--layers=N] [--layer-bytes=N] [--seconds=S] [--seed=N] [--prefix=P]\n");
    return 2;
  }
  std::printf("ckpt_stress seed=%" PRIu64 " jobs=%u ranks=%u threads=%u seconds=%.0f\n", o.seed,
              o.jobs, o.ranks, o.threads, o.seconds);
  std::fflush(stdout);
  Counters counters;
  std::vector<std::unique_ptr<Actor>> actors;
  for (uint32_t j = 0; j < o.jobs; ++j) {
    for (uint32_t r = 0; r < o.ranks; ++r)
      actors.push_back(std::make_unique<Actor>(o, j, r, &counters));
  }
  const absl::Time end = absl::Now() + absl::Seconds(o.seconds);
  std::vector<std::thread> threads;
  for (uint32_t t = 0; t < o.threads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(o.seed * 1000003 + t);
      auto admin = Admin::NewStub(
          grpc::CreateChannel("unix:" + o.socket, grpc::InsecureChannelCredentials()));
      std::discrete_distribution<int> pick_op(std::begin(kOpWeights), std::end(kOpWeights));
      while (absl::Now() < end) {
        Actor& a = *actors[rng() % actors.size()];
        std::unique_lock<std::mutex> lock(a.mu(), std::try_to_lock);
        if (!lock.owns_lock()) continue;
        a.Run(static_cast<Op>(pick_op(rng)), &rng, admin.get());
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (auto& a : actors) a->Finish();

  std::printf("ops:");
  uint64_t total = 0;
  for (int i = 0; i < kNumOps; ++i) {
    std::printf(" %s=%" PRIu64, kOpNames[i], counters.ops[i].load());
    total += counters.ops[i].load();
  }
  std::printf(" total=%" PRIu64 "\nlayers restored and compared=%" PRIu64 " allowed errors=%" PRIu64
              " violations=%" PRIu64 "\n",
              total, counters.layers_restored.load(), counters.errors.load(),
              counters.violations.load());
  return counters.violations.load() == 0 ? 0 : 1;
}
