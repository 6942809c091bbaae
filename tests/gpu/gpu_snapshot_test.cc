// The CUDA IPC handover end to end: a real ckptd and ckpt_gpu_trainer child
// processes whose layers live in device memory. A trainer trains (the daemon
// copies each snapshot D2H after the step's event, the trainer mutates right
// after the fence), a new process restores the composite checkpoint into
// fresh allocations and checks every layer bit-exactly against the step the
// plan names (a layer holding step t+1 means a copy raced the next optimizer
// step), and a trainer that vanishes without Unregister leaves no IPC mapping
// open in the daemon. Timings are not asserted here (ckpt_gpu_trainer
// --mode=bench measures them). Skips without a CUDA device.
#include <cuda_runtime.h>
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "ckpt/v1/ckpt.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "tests/integration/daemon_process.h"

namespace ckpt {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;
using testing::DaemonProcess;
using testing::MakeTempDir;

// The trainer's default layout: 6 layers of 4 MiB, layers 0 and 1 in one
// allocation, so 5 CUDA IPC regions.
constexpr uint32_t kRegions = 5;
// A vanished trainer's mappings must be gone within this.
constexpr auto kMappingsCloseWithin = seconds(10);

bool HaveCudaDevice(std::string* why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    *why = absl::StrCat("no CUDA device: ", cudaGetErrorString(e));
    return false;
  }
  if (n == 0) {
    *why = "no CUDA device";
    return false;
  }
  return true;
}

// CKPT_BUILD_DIR when set (ctest; run_on_gpu.sh points it at the bundle),
// else the build directory this test was built in.
std::string BuildDir() {
  const char* b = std::getenv("CKPT_BUILD_DIR");
  return b != nullptr && b[0] != '\0' ? b : CKPT_BINARY_DIR;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

bool Exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

// A child process with stdout and stderr in one log file. The destructor
// kills it if it is still running.
class Child {
 public:
  Child() = default;
  ~Child() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  bool Start(std::vector<std::string> args, const std::string& log) {
    log_ = log;
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    const int rc = ::posix_spawn(&pid_, argv[0], &fa, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0) pid_ = -1;
    return rc == 0;
  }

  // True once the child has exited (reaped; see exit_code()).
  bool Exited() {
    if (pid_ <= 0) return true;
    int st = 0;
    if (::waitpid(pid_, &st, WNOHANG) != pid_) return false;
    pid_ = -1;
    exit_code_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    return true;
  }

  // The exit code (128 + signal when killed by one); -1 after `timeout`,
  // when the child is killed.
  int Wait(std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!Exited()) {
      if (std::chrono::steady_clock::now() > deadline) {
        Kill();
        return -1;
      }
      std::this_thread::sleep_for(milliseconds(10));
    }
    return exit_code_;
  }

  void Kill() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    int st = 0;
    ::waitpid(pid_, &st, 0);
    pid_ = -1;
    exit_code_ = 128 + SIGKILL;
  }

  std::string log() const { return ReadFile(log_); }

 private:
  pid_t pid_ = -1;
  int exit_code_ = -1;
  std::string log_;
};

class GpuSnapshotTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!HaveCudaDevice(&why)) GTEST_SKIP() << why;
    ::setenv("CKPT_BUILD_DIR", BuildDir().c_str(), /*overwrite=*/0);  // DaemonProcess reads it
    ASSERT_TRUE(Exists(Trainer())) << Trainer() << " is missing";
    root_ = MakeTempDir("ckpt-gpu-");
    ASSERT_FALSE(root_.empty());
    // 256 MiB of staging holds ten 24 MiB snapshots: no step is skipped.
    daemon_ = std::make_unique<DaemonProcess>(
        root_,
        std::vector<std::string>{"--staging_pool_bytes=268435456", "--lock_staging_memory=false"});
    ASSERT_TRUE(daemon_->Start()) << "ckptd did not start from " << BuildDir();
  }

  void TearDown() override {
    daemon_.reset();
    if (!root_.empty()) std::system(("rm -rf " + root_).c_str());
  }

  static std::string Trainer() { return BuildDir() + "/tests/gpu/ckpt_gpu_trainer"; }

  std::string Path(const std::string& name) const { return root_ + "/" + name; }

  // ckpt_gpu_trainer --socket=... --job=job --mode=mode [extra...]
  std::vector<std::string> TrainerArgs(const std::string& job, const std::string& mode,
                                       std::vector<std::string> extra) const {
    std::vector<std::string> args = {Trainer(), "--socket=" + daemon_->socket(), "--job=" + job,
                                     "--mode=" + mode};
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  }

  // Runs a trainer to its end; returns its exit code and its output in *log.
  int RunTrainer(const std::string& name, std::vector<std::string> args, std::string* log) {
    Child c;
    if (!c.Start(std::move(args), Path(name + ".log"))) {
      *log = "posix_spawn failed";
      return -1;
    }
    const int rc = c.Wait(seconds(120));
    *log = c.log();
    return rc;
  }

  // Runs a trainer (`job`, `mode`, `extra`) that must exit 0 and returns the
  // JSON it wrote to <name>.json.
  void RunTrainerToJson(const std::string& name, const std::string& job, const std::string& mode,
                        std::vector<std::string> extra, nlohmann::json* out) {
    extra.push_back("--json-out=" + Path(name + ".json"));
    std::string log;
    ASSERT_EQ(RunTrainer(name, TrainerArgs(job, mode, std::move(extra)), &log), 0) << log;
    *out = ReadJson(name + ".json");
    ASSERT_TRUE(out->is_object()) << log;
  }

  nlohmann::json ReadJson(const std::string& name) {
    return nlohmann::json::parse(ReadFile(Path(name)), nullptr, /*allow_exceptions=*/false);
  }

  // Admin.Status over the daemon's socket.
  bool DaemonStatus(v1::StatusReply* reply, std::string* error) {
    auto stub = v1::Admin::NewStub(
        grpc::CreateChannel("unix:" + daemon_->socket(), grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + seconds(5));
    grpc::Status s = stub->Status(&ctx, v1::StatusRequest(), reply);
    if (!s.ok()) *error = s.error_message();
    return s.ok();
  }

  // Polls Status until open_gpu_mappings == want or `timeout`; returns the
  // last value seen (or -1 when Status never answered).
  int64_t WaitForMappings(uint32_t want, std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    int64_t seen = -1;
    for (;;) {
      v1::StatusReply r;
      std::string error;
      if (DaemonStatus(&r, &error)) seen = r.open_gpu_mappings();
      if (seen == want || std::chrono::steady_clock::now() > deadline) return seen;
      std::this_thread::sleep_for(milliseconds(50));
    }
  }

  // Waits until `path` exists; false when the child exits first or after
  // `timeout`.
  static bool WaitForFile(const std::string& path, Child* child,
                          std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!Exists(path)) {
      if (child->Exited() || std::chrono::steady_clock::now() > deadline) return Exists(path);
      std::this_thread::sleep_for(milliseconds(10));
    }
    return true;
  }

  // A trainer that runs `steps` steps, reports them (StepDone) and then
  // holds its registration, without Unregister, until the test releases it.
  void StartHoldingTrainer(const std::string& job, uint64_t steps, Child* child) {
    ASSERT_TRUE(child->Start(
        TrainerArgs(job, "train",
                    {"--policy=all", absl::StrCat("--steps=", steps), "--no-unregister",
                     "--ready-file=" + Path(job + ".ready"), "--hold-until=" + Path(job + ".go")}),
        Path(job + ".train.log")));
    ASSERT_TRUE(WaitForFile(Path(job + ".ready"), child, seconds(120)))
        << "the trainer did not get through its steps:\n"
        << child->log();
  }

  // While the holding trainer is registered, the daemon maps each of its
  // allocations once.
  void ExpectMappingsOfHoldingTrainer(const std::string& job) {
    const nlohmann::json ready =
        nlohmann::json::parse(ReadFile(Path(job + ".ready")), nullptr, false);
    ASSERT_TRUE(ready.is_object());
    EXPECT_EQ(ready["regions"].get<uint32_t>(), kRegions);
    v1::StatusReply r;
    std::string error;
    ASSERT_TRUE(DaemonStatus(&r, &error)) << error;
    EXPECT_EQ(r.open_gpu_mappings(), ready["regions"].get<uint32_t>());
    EXPECT_GE(r.open_gpu_mapping_bytes(), ready["tensor_bytes"].get<uint64_t>());
  }

  // A new process restores the job and checks every layer against the step
  // its plan names, and the guard gaps against the sentinel.
  void ExpectBitExactRestore(const std::string& job, std::vector<std::string> extra = {}) {
    extra.push_back("--json-out=" + Path(job + ".verify.json"));
    std::string log;
    ASSERT_EQ(RunTrainer(job + ".verify", TrainerArgs(job, "verify", extra), &log), 0) << log;
  }

  std::string root_;
  std::unique_ptr<DaemonProcess> daemon_;
};

// every_n:3 over 31 steps: the last snapshot (step 30) was taken while the
// trainer went on to step 31, so a layer holding f(31) would show a copy that
// ran after the fence returned. Half of each step's layers are written 10 ms
// after StepDone was sent, so one holding f(29) would show a copy that did
// not wait for the step's event.
TEST_F(GpuSnapshotTest, TrainThenRestoreInNewProcessIsBitExact) {
  nlohmann::json train;
  ASSERT_NO_FATAL_FAILURE(
      RunTrainerToJson("train", "every-n", "train",
                       {"--policy=every_n:3", "--steps=31", "--step-delay-ms=10"}, &train));
  EXPECT_EQ(train["skipped"].get<uint64_t>(), 0u);
  EXPECT_EQ(train["durable_step"].get<uint64_t>(), 31u);
  EXPECT_EQ(train["regions"].get<uint32_t>(), kRegions);
  EXPECT_EQ(train["staged_steps"], nlohmann::json(std::vector<uint64_t>(6, 30)));

  // --steps makes the verifier also check each planned step against the schedule.
  ExpectBitExactRestore("every-n", {"--policy=every_n:3", "--steps=31"});
  const nlohmann::json verify = ReadJson("every-n.verify.json");
  ASSERT_TRUE(verify.is_object());
  EXPECT_EQ(verify["target_step"], train["durable_step"]);
  EXPECT_EQ(verify["layer_steps"], nlohmann::json(std::vector<uint64_t>(6, 30)));

  // Both processes unregistered and exited.
  EXPECT_EQ(WaitForMappings(0, kMappingsCloseWithin), 0);
}

// Virtual-memory-management allocations (--vmm: pages of 2 MiB, as
// PyTorch's expandable segments): each 4 MiB layer spans pages, the shared
// allocation's two layers straddle a page boundary, every page is handed over
// as a descriptor, and ckptd maps each run into one range of its own. The
// restore into fresh pages in a new process is bit-exact, and every run is
// released once both processes are gone. (Two allocations that happen to be
// adjacent form one run, so the runs are at most the allocations.)
TEST_F(GpuSnapshotTest, ExpandableSegmentPagesRestoreBitExact) {
  nlohmann::json train;
  ASSERT_NO_FATAL_FAILURE(RunTrainerToJson(
      "vmm", "vmm", "train", {"--vmm", "--policy=all", "--steps=9", "--step-delay-ms=10"}, &train));
  EXPECT_EQ(train["skipped"].get<uint64_t>(), 0u);
  EXPECT_EQ(train["durable_step"].get<uint64_t>(), 9u);
  EXPECT_GE(train["regions"].get<uint32_t>(), 1u);
  EXPECT_LE(train["regions"].get<uint32_t>(), kRegions);
  ASSERT_NO_FATAL_FAILURE(ExpectBitExactRestore("vmm", {"--vmm"}));
  const nlohmann::json verify = ReadJson("vmm.verify.json");
  ASSERT_TRUE(verify.is_object());
  EXPECT_EQ(verify["target_step"], train["durable_step"]);
  EXPECT_EQ(WaitForMappings(0, kMappingsCloseWithin), 0);
}

// An explicit per-layer schedule: the composite checkpoint mixes steps, and
// each layer must come back as of its own step.
TEST_F(GpuSnapshotTest, ExplicitScheduleRestoresEachLayerAtItsOwnStep) {
  nlohmann::json train;
  ASSERT_NO_FATAL_FAILURE(
      RunTrainerToJson("train", "explicit", "train",
                       {"--policy=explicit", "--steps=30", "--step-delay-ms=10"}, &train));
  EXPECT_EQ(train["skipped"].get<uint64_t>(), 0u);

  ExpectBitExactRestore("explicit", {"--policy=explicit", "--steps=30"});
  const nlohmann::json verify = ReadJson("explicit.verify.json");
  ASSERT_TRUE(verify.is_object());
  // Layer l is listed every (l % 5) + 2 steps: 30, 30, 28, 30, 30, 30.
  EXPECT_EQ(verify["layer_steps"], nlohmann::json(std::vector<uint64_t>{30, 30, 28, 30, 30, 30}));
}

// LayerCheck on GPU memory: ckptd's CUDA drift kernel reads the trainer's
// AdamW state through its IPC mappings after waiting on the step event; its
// per-layer normalized drift (the rank's drift.jsonl) must equal what the CPU
// reference computes from the same tensors copied back by the trainer.
TEST_F(GpuSnapshotTest, DriftOnMappedBuffersMatchesTheCpuReference) {
  nlohmann::json cpu;
  ASSERT_NO_FATAL_FAILURE(RunTrainerToJson("drift", "drift", "drift",
                                           {"--layers=4", "--layer-bytes=1M", "--steps=12"}, &cpu));
  const std::string trace_path = root_ + "/data/jobs/drift/rank-00000000/drift.jsonl";
  std::ifstream trace(trace_path);
  ASSERT_TRUE(trace.good()) << trace_path;
  std::map<uint64_t, std::vector<double>> daemon_d;
  for (std::string line; std::getline(trace, line);) {
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_object() && j.contains("step")) {
      daemon_d[j["step"].get<uint64_t>()] = j["d"].get<std::vector<double>>();
    }
  }
  ASSERT_EQ(daemon_d.size(), 12u);
  double max_rel = 0;
  for (const nlohmann::json& s : cpu["cpu"]) {
    const uint64_t step = s["step"].get<uint64_t>();
    const std::vector<double> want = s["d"].get<std::vector<double>>();
    ASSERT_EQ(daemon_d[step].size(), want.size()) << "step " << step;
    for (size_t l = 0; l < want.size(); ++l) {
      ASSERT_GT(want[l], 0) << "step " << step << " layer " << l;
      const double rel = std::abs(daemon_d[step][l] - want[l]) / want[l];
      max_rel = std::max(max_rel, rel);
      EXPECT_LE(rel, 1e-9) << "step " << step << " layer " << l << ": ckptd " << daemon_d[step][l]
                           << ", cpu reference " << want[l];
    }
  }
  std::printf("GPU drift on IPC mappings vs CPU reference: max relative difference %.3g\n",
              max_rel);
  EXPECT_EQ(WaitForMappings(0, kMappingsCloseWithin), 0);
}

// A registered trainer's allocations are mapped in the daemon (one mapping per
// allocation, shared by the two layers in one); when the trainer exits
// without Unregister they are closed, and its checkpoint still restores.
TEST_F(GpuSnapshotTest, MappingsOpenWhileRegisteredClosedWhenTrainerExitsWithoutUnregister) {
  Child trainer;
  ASSERT_NO_FATAL_FAILURE(StartHoldingTrainer("vanish", 8, &trainer));
  ASSERT_NO_FATAL_FAILURE(ExpectMappingsOfHoldingTrainer("vanish"));

  std::ofstream(Path("vanish.go")).put('\n');
  ASSERT_EQ(trainer.Wait(seconds(60)), 0) << trainer.log();
  EXPECT_EQ(WaitForMappings(0, kMappingsCloseWithin), 0);
  ASSERT_TRUE(daemon_->alive());
  ExpectBitExactRestore("vanish");
}

TEST_F(GpuSnapshotTest, MappingsClosedWhenTrainerIsKilled) {
  Child trainer;
  ASSERT_NO_FATAL_FAILURE(StartHoldingTrainer("killed", 8, &trainer));
  ASSERT_NO_FATAL_FAILURE(ExpectMappingsOfHoldingTrainer("killed"));

  trainer.Kill();
  EXPECT_EQ(WaitForMappings(0, kMappingsCloseWithin), 0);
  ASSERT_TRUE(daemon_->alive());
  ExpectBitExactRestore("killed");
}

// The trainer exits right after its last StepDone, while the daemon may still
// be waiting on the step's event or copying from the allocations.
TEST_F(GpuSnapshotTest, TrainerExitingRightAfterStepDoneLeavesNoMappings) {
  std::string log;
  ASSERT_EQ(
      RunTrainer("train",
                 TrainerArgs("abrupt", "train", {"--policy=all", "--steps=12", "--no-unregister"}),
                 &log),
      0)
      << log;
  EXPECT_EQ(WaitForMappings(0, kMappingsCloseWithin), 0);
  ASSERT_TRUE(daemon_->alive());
  ExpectBitExactRestore("abrupt");
}

}  // namespace
}  // namespace ckpt
