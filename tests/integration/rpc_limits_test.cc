// Request size caps per method and the release of memory after large calls,
// against a real ckptd process: an oversized small request is refused naming
// its limit while a trainer on the same daemon goes on, and ckptd's resident
// memory comes back down after a burst of large Register calls.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "ckpt/client.h"
#include "ckpt/v1/ckpt.grpc.pb.h"
#include "tests/integration/daemon_process.h"
#include "tests/lib/test_util.h"

namespace ckpt {
namespace {

using testing::DaemonProcess;
using testing::MakeTempDir;

constexpr int64_t kMiB = 1 << 20;

std::chrono::system_clock::time_point In(int seconds) {
  return std::chrono::system_clock::now() + std::chrono::seconds(seconds);
}

// The pid of the process serving a Unix socket (SO_PEERCRED), or -1.
pid_t ServerPid(const std::string& socket_path) {
  int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0) return -1;
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  socket_path.copy(a.sun_path, sizeof(a.sun_path) - 1);
  pid_t pid = -1;
  if (::connect(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) {
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (::getsockopt(s, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0) pid = cred.pid;
  }
  ::close(s);
  return pid;
}

// VmRSS of `pid` in bytes, or -1.
int64_t RssBytes(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (!absl::StartsWith(line, "VmRSS:")) continue;
    std::string kb = line.substr(6);
    kb = kb.substr(0, kb.find("kB"));
    int64_t v = 0;
    if (absl::SimpleAtoi(absl::StripAsciiWhitespace(kb), &v)) return v * 1024;
  }
  return -1;
}

struct HeldExport;

class RpcLimitsTest : public ::testing::Test {
 protected:
  // Starts ckptd with `flags` and one export held in it (HeldExport); null,
  // with the failure reported, when that cannot be set up.
  std::unique_ptr<HeldExport> StartWithExportHeld(std::vector<std::string> flags);

  void StartDaemon(std::vector<std::string> flags = {}) {
    root_ = MakeTempDir("ckpt-rpclim-");
    ASSERT_FALSE(root_.empty());
    daemon_ = std::make_unique<DaemonProcess>(root_, std::move(flags));
    ASSERT_TRUE(daemon_->Start());
    channel_ = grpc::CreateCustomChannel("unix:" + daemon_->socket(),
                                         grpc::InsecureChannelCredentials(), LargeArgs());
  }
  void TearDown() override {
    daemon_.reset();
    if (!root_.empty()) std::system(("rm -rf " + root_).c_str());
  }
  static grpc::ChannelArguments LargeArgs() {
    grpc::ChannelArguments args;
    args.SetMaxSendMessageSize(-1);
    args.SetMaxReceiveMessageSize(-1);
    return args;
  }
  std::unique_ptr<v1::Trainer::Stub> TrainerStub() { return v1::Trainer::NewStub(channel_); }
  void ExpectAlive() {
    grpc::ClientContext ctx;
    ctx.set_deadline(In(10));
    v1::StatusReply reply;
    ASSERT_TRUE(v1::Admin::NewStub(channel_)->Status(&ctx, v1::StatusRequest(), &reply).ok());
  }

  std::string root_;
  std::unique_ptr<DaemonProcess> daemon_;
  std::shared_ptr<grpc::Channel> channel_;
};

// A trainer rank with `layers` small f32 layers in one memfd region.
struct TestRank {
  std::unique_ptr<Client> client;
  RankSpec spec;
};

TestRank MakeTrainer(const std::string& socket, const std::string& job, int layers) {
  TestRank t;
  ClientOptions o;
  o.socket_path = socket;
  o.call_timeout = absl::Seconds(10);
  o.wait_timeout = absl::Seconds(30);
  t.client = std::move(Client::Connect(o).value());
  const uint64_t floats = 1024;
  size_t region = t.client->AllocateRegion(layers * floats * 4).value();
  t.spec.job_id = job;
  t.spec.policy.set_kind(v1::POLICY_ALL);
  for (int l = 0; l < layers; ++l) {
    LayerDesc ld;
    ld.name = absl::StrCat("layer", l);
    TensorDesc td;
    td.name = absl::StrCat("layer", l, ".w");
    td.shape = {floats};
    td.region = static_cast<uint32_t>(region);
    td.offset = l * floats * 4;
    ld.tensors.push_back(td);
    t.spec.layers.push_back(ld);
  }
  return t;
}

// A Register request of about `bytes` bytes: a table of many layers, each a
// separate message with its own strings, like a big model's (no handover
// token, so ckptd refuses it once it has read it).
v1::RegisterRequest LargeRegister(int64_t bytes) {
  v1::RegisterRequest req;
  req.set_job_id("large");
  req.set_world_size(1);
  const std::string pad(900, 'p');
  int64_t size = static_cast<int64_t>(req.ByteSizeLong());
  for (int l = 0; size < bytes; ++l) {
    v1::LayerSpec* layer = req.add_layers();
    layer->set_name(absl::StrCat("model.layers.", l, ".", pad));
    for (int t = 0; t < 4; ++t) {
      v1::TensorSpec* tensor = layer->add_tensors();
      tensor->set_name(absl::StrCat("model.layers.", l, ".weight", t));
      tensor->add_shape(4096);
    }
    size += static_cast<int64_t>(layer->ByteSizeLong()) + 4;  // + tag and length
  }
  return req;
}

TEST_F(RpcLimitsTest, OversizedSmallRequestsAreRefusedNamingTheLimitWhileATrainerContinues) {
  StartDaemon();
  TestRank t = MakeTrainer(daemon_->socket(), "steady", 4);
  ASSERT_TRUE(t.client->Register(t.spec).ok());
  ASSERT_TRUE(t.client->StepDone(1, 0.1).ok());
  ASSERT_EQ(t.client->WaitDurable(1).value(), 1u);

  // StepDone with 8 MiB of aux, above the 4 MiB default for every method
  // but Register (and below the 64 MiB message cap, so gRPC lets it in).
  {
    v1::StepDoneRequest req;
    req.set_job_id("steady");
    req.set_generation(t.client->generation());
    req.set_step(2);
    req.set_aux(std::string(8 * kMiB, 'a'));
    grpc::ClientContext ctx;
    ctx.set_deadline(In(30));
    v1::StepDoneReply reply;
    grpc::Status s = TrainerStub()->StepDone(&ctx, req, &reply);
    std::printf("oversized StepDone (%zu bytes): %d %s\n", req.ByteSizeLong(), s.error_code(),
                s.error_message().c_str());
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
    EXPECT_TRUE(absl::StrContains(s.error_message(), "max_request_bytes")) << s.error_message();
  }
  // Plan with a 6 MiB job id: refused for its size before the id is read.
  {
    v1::PlanRequest req;
    req.set_job_id(std::string(6 * kMiB, 'j'));
    grpc::ClientContext ctx;
    ctx.set_deadline(In(30));
    v1::Plan reply;
    grpc::Status s = TrainerStub()->Plan(&ctx, req, &reply);
    std::printf("oversized Plan (%zu bytes): %d %s\n", req.ByteSizeLong(), s.error_code(),
                s.error_message().c_str());
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
    EXPECT_TRUE(absl::StrContains(s.error_message(), "max_request_bytes")) << s.error_message();
  }
  // A Register of 8 MiB is within its own cap: refused by validation (no
  // handover token), not for its size.
  {
    v1::RegisterRequest req = LargeRegister(8 * kMiB);
    grpc::ClientContext ctx;
    ctx.set_deadline(In(30));
    v1::RegisterReply reply;
    grpc::Status s = TrainerStub()->Register(&ctx, req, &reply);
    std::printf("8 MiB Register: %d %s\n", s.error_code(), s.error_message().c_str());
    EXPECT_FALSE(s.ok());
    EXPECT_FALSE(absl::StrContains(s.error_message(), "max_request_bytes")) << s.error_message();
  }
  // The trainer goes on with the next step.
  ASSERT_TRUE(t.client->StepDone(2, 0.1).ok());
  ASSERT_EQ(t.client->WaitDurable(2).value(), 2u);
  ExpectAlive();
}

TEST_F(RpcLimitsTest, MemoryOfLargeRegistersIsReleasedAfterwards) {
  if (testing::kSanitizerBuild)
    GTEST_SKIP() << "a sanitizer's allocator holds freed memory by design";
  StartDaemon();
  const pid_t pid = ServerPid(daemon_->socket());
  ASSERT_GT(pid, 0);
  // A first small call and a trainer step, so the baseline includes
  // gRPC's and the engine's warm state.
  TestRank t = MakeTrainer(daemon_->socket(), "steady", 4);
  ASSERT_TRUE(t.client->Register(t.spec).ok());
  ASSERT_TRUE(t.client->StepDone(1, 0.1).ok());
  ASSERT_EQ(t.client->WaitDurable(1).value(), 1u);
  const int64_t before = RssBytes(pid);
  ASSERT_GT(before, 0);

  constexpr int kCalls = 16;
  const v1::RegisterRequest req = LargeRegister(60 * kMiB);
  std::printf("request: %zu bytes, %d layers\n", req.ByteSizeLong(), req.layers_size());
  std::vector<grpc::StatusCode> codes(kCalls);
  std::vector<std::string> messages(kCalls);
  std::vector<std::thread> threads;
  for (int i = 0; i < kCalls; ++i) {
    threads.emplace_back([&, i] {
      // One channel (one connection) per call, as separate trainers would.
      auto channel = grpc::CreateCustomChannel("unix:" + daemon_->socket(),
                                               grpc::InsecureChannelCredentials(), LargeArgs());
      grpc::ClientContext ctx;
      ctx.set_deadline(In(120));
      v1::RegisterReply reply;
      grpc::Status s = v1::Trainer::NewStub(channel)->Register(&ctx, req, &reply);
      codes[i] = s.error_code();
      messages[i] = s.error_message();
    });
  }
  for (std::thread& th : threads) th.join();
  int received = 0;
  for (int i = 0; i < kCalls; ++i) {
    // Refused by ckptd's own checks (no handover token, or max_large_calls),
    // not by gRPC's message cap nor a deadline: every request was read.
    if (codes[i] != grpc::StatusCode::DEADLINE_EXCEEDED &&
        !absl::StrContains(messages[i], "larger than max")) {
      ++received;
    }
    if (i < 2) std::printf("call %d: %d %s\n", i, codes[i], messages[i].c_str());
  }
  EXPECT_EQ(received, kCalls);
  // The trainer still works.
  ASSERT_TRUE(t.client->StepDone(2, 0.1).ok());
  ASSERT_EQ(t.client->WaitDurable(2).value(), 2u);
  const int64_t after = RssBytes(pid);
  std::printf("ckptd VmRSS: before %.1f MiB, after %d x %.0f MiB Registers %.1f MiB (%+.1f MiB)\n",
              before / double(kMiB), kCalls, req.ByteSizeLong() / double(kMiB),
              after / double(kMiB), (after - before) / double(kMiB));
  EXPECT_LE(after - before, 64 * kMiB);
  ExpectAlive();
}

// The lines of `path` (0 when it does not exist yet).
int LinesIn(const std::string& path) {
  std::ifstream in(path);
  int n = 0;
  for (std::string line; std::getline(in, line);) ++n;
  return n;
}

// One export of the job "exported" (two layers, one durable step) held at
// the delay point rpc.heavy_call (CKPT_DELAY_UNTIL) until Release(): it
// holds a heavy slot and one of its uid's calls. `trainer` is the job's
// registered rank, `sink` takes an export's bytes and drops them.
struct HeldExport {
  std::string held_log;
  std::string release;
  TestRank trainer;
  Client::ExportSink sink;
  std::unique_ptr<Client> holder;
  absl::Status status;
  std::thread thread;

  ~HeldExport() {
    if (thread.joinable()) Release();
  }
  // Lets the held export go on and waits for it.
  void Release() {
    std::ofstream(release).close();
    thread.join();
  }
};

std::unique_ptr<HeldExport> RpcLimitsTest::StartWithExportHeld(std::vector<std::string> flags) {
  root_ = MakeTempDir("ckpt-rpclim-");
  EXPECT_FALSE(root_.empty());
  if (root_.empty()) return nullptr;
  auto h = std::make_unique<HeldExport>();
  h->held_log = root_ + "/held.log";
  h->release = root_ + "/release";
  daemon_ = std::make_unique<DaemonProcess>(
      root_, std::move(flags),
      std::vector<std::string>{"CKPT_DELAY_AT=rpc.heavy_call:60000",
                               "CKPT_DELAY_LOG=" + h->held_log, "CKPT_DELAY_UNTIL=" + h->release});
  EXPECT_TRUE(daemon_->Start());
  h->trainer = MakeTrainer(daemon_->socket(), "exported", 2);
  const bool ready = h->trainer.client->Register(h->trainer.spec).ok() &&
                     h->trainer.client->StepDone(1, 0.1).ok() &&
                     h->trainer.client->WaitDurable(1).ok();
  EXPECT_TRUE(ready) << "the job to export has a durable step";
  if (!ready) return nullptr;
  h->sink.header = [](const v1::ExportHeader&) { return absl::OkStatus(); };
  h->sink.data = [](const v1::ExportTensor&, uint64_t, std::string_view) {
    return absl::OkStatus();
  };
  ClientOptions o;
  o.socket_path = daemon_->socket();
  h->holder = std::move(Client::Connect(o).value());
  HeldExport* raw = h.get();
  h->thread =
      std::thread([raw] { raw->status = raw->holder->Export("exported", 0, 0, raw->sink); });
  for (int i = 0; i < 3000 && LinesIn(h->held_log) < 1; ++i) ::usleep(10000);
  EXPECT_EQ(LinesIn(h->held_log), 1) << "the export is held";
  if (LinesIn(h->held_log) != 1) return nullptr;
  return h;
}

// An export refused before it runs (here by max_heavy_calls) gives back the
// region its reader handed over at once. Readers retry such refusals, each
// time with a new region; the tokens used to wait until they expired,
// pinning each window and filling the uid's handover_max_pending_per_uid,
// so that the same uid's next Register was refused. One export is held at
// the delay point rpc.heavy_call (CKPT_DELAY_UNTIL) while the others come.
TEST_F(RpcLimitsTest, ARefusedExportGivesItsRegionBackAtOnce) {
  std::unique_ptr<HeldExport> first =
      StartWithExportHeld({"--max_heavy_calls=1", "--handover_max_pending_per_uid=2"});
  ASSERT_NE(first, nullptr) << "the first export holds the only heavy slot";

  Client::ExportSink windowed = first->sink;
  windowed.region_bytes = 1 << 20;
  for (int i = 0; i < 3; ++i) {
    const absl::Status s = first->trainer.client->Export("exported", 0, 0, windowed);
    EXPECT_TRUE(absl::IsResourceExhausted(s)) << i << ": " << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "max_heavy_calls")) << s;
  }
  TestRank next = MakeTrainer(daemon_->socket(), "next", 1);
  const absl::Status registered = next.client->Register(next.spec);
  EXPECT_TRUE(registered.ok()) << "the uid's handovers are not held up: " << registered;

  first->Release();
  EXPECT_TRUE(first->status.ok()) << first->status;
  EXPECT_EQ(LinesIn(first->held_log), 1);
}

// A Register refused before it runs (here by max_calls_per_uid, while an
// export of the same uid holds its one call) gives back the regions it
// handed over at once, as a refused export does: they used to wait until
// their token expired, so that a trainer retrying its registration filled
// handover_max_pending_per_uid and was refused after the cap had cleared.
TEST_F(RpcLimitsTest, ARefusedRegisterGivesItsHandoverBackAtOnce) {
  std::unique_ptr<HeldExport> first =
      StartWithExportHeld({"--max_calls_per_uid=1", "--handover_max_pending_per_uid=2"});
  ASSERT_NE(first, nullptr) << "the export holds the uid's only call";

  for (int i = 0; i < 3; ++i) {
    TestRank refused = MakeTrainer(daemon_->socket(), absl::StrCat("refused-", i), 1);
    const absl::Status s = refused.client->Register(refused.spec);
    EXPECT_TRUE(absl::IsResourceExhausted(s)) << i << ": " << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "max_calls_per_uid")) << i << ": " << s;
  }
  first->Release();
  EXPECT_TRUE(first->status.ok()) << first->status;
  TestRank next = MakeTrainer(daemon_->socket(), "next", 1);
  const absl::Status registered = next.client->Register(next.spec);
  EXPECT_TRUE(registered.ok()) << "the uid's handovers are not held up: " << registered;
}

}  // namespace
}  // namespace ckpt
