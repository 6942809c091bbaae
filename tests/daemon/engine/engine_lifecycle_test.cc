// A registration's life in the engine (engine_test_util.h): how it ends
// (Unregister with and without drain, ReleaseRank, the trainer process's
// exit, ckptd's shutdown), what it holds until then (staged versions, rank
// directory descriptors, memfd mappings), and whose job it is (a refused
// registration creates none; another user's job reads like a missing one).
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/status.h"
#include "base/unique_fd.h"
#include "ckpt/v1/ckpt.pb.h"
#include "daemon/common/sync_point.h"
#include "daemon/engine/engine.h"
#include "gtest/gtest.h"
#include "tests/daemon/engine/engine_test_util.h"
#include "tests/lib/test_util.h"

namespace ckpt {
namespace engine_test {
namespace {

// Layers names the steps staged and not yet durable (a trainer killed while
// ckptd still writes them sees them restored): the writer is held before
// its commit, so step 2 stays staged until the test lets it go.
TEST_F(EnginePipelineTest, LayersNamesTheStepsStagedAndNotYetDurable) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(OneWriter(), /*chunks=*/16));
  TestRank a = MakeRank("staged", 2);
  CKPT_ASSERT_OK(Register(&a).status());
  CKPT_ASSERT_OK(StepDone(a, 1));
  CKPT_ASSERT_OK(WaitDurable(a, 1).status());
  sp_->LoadDependency({{kReleaseWriter, "writer.before_commit"}});
  CKPT_ASSERT_OK(StepDone(a, 2));
  CKPT_ASSERT_OK(WaitSnapshot(a, 2).status());
  v1::LayersRequest req;
  req.set_job_id("staged");
  CKPT_ASSERT_OK_AND_ASSIGN(v1::LayersReply held, engine_->Layers(req, owner_));
  EXPECT_EQ(held.latest_durable_step(), 1u);
  EXPECT_EQ(held.newest_staged_step(), 2u);
  CKPT_SYNC_POINT(kReleaseWriter);
  CKPT_ASSERT_OK(WaitDurable(a, 2).status());
  CKPT_ASSERT_OK_AND_ASSIGN(v1::LayersReply done, engine_->Layers(req, owner_));
  EXPECT_EQ(done.latest_durable_step(), 2u);
  EXPECT_EQ(done.newest_staged_step(), 0u);
}

// Regression: Unregister without drain used to forget the rank while its
// staged versions were still being written, so a new registration did not
// wait for them and both wrote the same keys.
TEST_F(EnginePipelineTest, UnregisterWithoutDrainIsDrainedByTheNextRegistration) {
  // A short drain bound: a registration that finds the old one still writing
  // gives up with UNAVAILABLE instead of waiting.
  EngineOptions o = OneWriter();
  o.drain_timeout = absl::Milliseconds(100);
  ASSERT_NO_FATAL_FAILURE(StartEngine(o, /*chunks=*/16));
  sp_->LoadDependency({{kReleaseWriter, "writer.before_commit"}});
  TestRank a = MakeRank("undrained", 2);
  CKPT_ASSERT_OK(Register(&a).status());
  for (uint64_t t = 1; t <= 3; ++t) {
    CKPT_ASSERT_OK(StepDone(a, t));
    CKPT_ASSERT_OK(WaitSnapshot(a, t).status());
  }
  CKPT_ASSERT_OK(engine_->Unregister(Ref(a), /*drain=*/false, owner_, absl::Now() + kWait));

  // The 6 staged versions are still unwritten (the writer is held): the new
  // registration must not start over them.
  TestRank b = MakeRank("undrained", 2);
  CKPT_EXPECT_CODE(Register(&b).status(), kUnavailable);
  EXPECT_EQ(engine_->GetStatus().versions_committed(), 0u);

  // Once the writer goes on, a registration retried until the old one has
  // drained sees every staged step of it durable.
  CKPT_SYNC_POINT(kReleaseWriter);
  absl::StatusOr<Registered> reg = Register(&b);
  for (const absl::Time deadline = absl::Now() + kWait;
       absl::IsUnavailable(reg.status()) && absl::Now() < deadline;) {
    reg = Register(&b);
  }
  CKPT_ASSERT_OK(reg.status());
  EXPECT_EQ(reg->latest_durable_step, 3u);
  EXPECT_EQ(engine_->GetStatus().versions_committed(), 6u);
  CKPT_EXPECT_CODE(StepDone(b, 3), kFailedPrecondition);
  CKPT_EXPECT_OK(StepDone(b, 4));
  CKPT_ASSERT_OK_AND_ASSIGN(uint64_t durable, WaitDurable(b, 4));
  EXPECT_EQ(durable, 4u);
}

// An unregistered rank is forgotten once nothing of it is left to write:
// when it is idle at once, else when its last staged version is written
// (it stayed in the engine's table, and in every walk over it, for good).
TEST_F(EnginePipelineTest, UnregisterWithoutDrainForgetsTheRankOnceItsVersionsAreWritten) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(OneWriter(), /*chunks=*/16));
  // The snapshot thread may still be finishing a durable step's snapshot
  // (it forgets the rank then): wait for the count, bounded.
  auto held_becomes = [this](size_t n) {
    for (const absl::Time deadline = absl::Now() + kWait;
         engine_->RanksHeld() != n && absl::Now() < deadline;) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    return engine_->RanksHeld();
  };
  TestRank idle = MakeRank("idle", 2);
  CKPT_ASSERT_OK(Register(&idle).status());
  CKPT_ASSERT_OK(StepDone(idle, 1));
  CKPT_ASSERT_OK(WaitSnapshot(idle, 1).status());
  CKPT_ASSERT_OK(WaitDurable(idle, 1).status());
  EXPECT_EQ(engine_->RanksHeld(), 1u);
  CKPT_ASSERT_OK(engine_->Unregister(Ref(idle), /*drain=*/false, owner_, absl::Now() + kWait));
  EXPECT_EQ(held_becomes(0), 0u);

  sp_->LoadDependency({{kReleaseWriter, "writer.before_commit"}});
  TestRank busy = MakeRank("busy", 2);
  CKPT_ASSERT_OK(Register(&busy).status());
  CKPT_ASSERT_OK(StepDone(busy, 1));
  CKPT_ASSERT_OK(WaitSnapshot(busy, 1).status());
  CKPT_ASSERT_OK(engine_->Unregister(Ref(busy), /*drain=*/false, owner_, absl::Now() + kWait));
  EXPECT_EQ(engine_->RanksHeld(), 1u);                       // its 2 versions are held back
  EXPECT_EQ(engine_->GetStatus().versions_committed(), 2u);  // the idle rank's
  CKPT_SYNC_POINT(kReleaseWriter);
  EXPECT_EQ(held_becomes(0), 0u);
  EXPECT_EQ(engine_->GetStatus().versions_committed(), 4u);
  // Its step became durable meanwhile: a new registration finds it.
  TestRank again = MakeRank("busy", 2);
  CKPT_ASSERT_OK_AND_ASSIGN(Registered reg, Register(&again));
  EXPECT_EQ(reg.latest_durable_step, 1u);
}

// ReleaseRank ends a registration without its generation (an operator's
// `ckptctl release`): what was staged is written first, later calls of the
// registration find it gone, and it can be released only once.
TEST_F(EnginePipelineTest, ReleaseRankEndsTheRegistrationAfterItsStagedVersions) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(OneWriter(), /*chunks=*/16));
  TestRank r = MakeRank("released", 2);
  CKPT_ASSERT_OK(Register(&r).status());
  // The writer holds step 1 (staged, not yet committed) until the release
  // has ended the registration and is draining it.
  sp_->LoadDependency(
      {{kReleaseWriter, "writer.before_commit"}, {"engine.release_rank.drain", kReleaseWriter}});
  CKPT_ASSERT_OK(StepDone(r, 1));
  CKPT_ASSERT_OK(WaitSnapshot(r, 1).status());
  absl::StatusOr<uint64_t> gen;
  std::thread release([&] { gen = engine_->ReleaseRank("released", 0, owner_); });
  CKPT_SYNC_POINT(kReleaseWriter);
  release.join();
  sp_->LoadDependency({});
  CKPT_ASSERT_OK(gen.status());
  EXPECT_EQ(*gen, r.generation);
  // Step 1 was written before the registration ended.
  CKPT_ASSERT_OK_AND_ASSIGN(CompositePlan plan, Plan(r, 1));
  EXPECT_EQ(PlannedSteps(plan), (std::vector<uint64_t>{1, 1}));
  const absl::Status gone = StepDone(r, 2);
  CKPT_EXPECT_CODE(gone, kNotFound);
  EXPECT_EQ(ReasonOf(gone), ErrorReason::kNotRegistered);
  CKPT_EXPECT_CODE(engine_->ReleaseRank("released", 0, owner_).status(), kNotFound);
  Caller root;
  CKPT_ASSERT_OK_AND_ASSIGN(v1::JobsReply jobs, engine_->Jobs(root));
  ASSERT_EQ(jobs.jobs_size(), 1);
  EXPECT_FALSE(jobs.jobs(0).ranks(0).registered());
  // The trainer registers again and goes on.
  CKPT_ASSERT_OK(Register(&r).status());
  CKPT_ASSERT_OK(StepDone(r, 2));
  CKPT_ASSERT_OK(WaitDurable(r, 2).status());
}

// Regression: a plain release did not stick: the squatting trainer
// registered again at once, so the job could not be deleted. Root's
// EvictJob ends every registration of the job and refuses new ones (the
// mark is in the job's record) until the job is deleted; nobody else may
// evict.
TEST_F(EnginePipelineTest, AnEvictedJobRegistersAgainOnlyOnceDeleted) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(OneWriter(), /*chunks=*/16));
  TestRank a = MakeRank("squat", 1), other = MakeRank("bystander", 1);
  CKPT_ASSERT_OK(Register(&a).status());
  CKPT_ASSERT_OK(Register(&other).status());
  CKPT_ASSERT_OK(StepDone(a, 1));
  CKPT_ASSERT_OK(WaitDurable(a, 1).status());
  absl::StatusOr<uint32_t> by_owner = engine_->EvictJob("squat", owner_);
  CKPT_EXPECT_CODE(by_owner, kPermissionDenied);
  EXPECT_NE(by_owner.status().message().find("ckptctl release squat --rank=R"), std::string::npos)
      << by_owner.status();
  const Caller root;
  CKPT_ASSERT_OK_AND_ASSIGN(uint32_t released, engine_->EvictJob("squat", root));
  EXPECT_EQ(released, 1u);
  CKPT_EXPECT_CODE(StepDone(a, 2), kNotFound);
  CKPT_EXPECT_OK(StepDone(other, 1)) << "another job is not touched";
  const absl::StatusOr<Registered> again = Register(&a);
  CKPT_EXPECT_CODE(again, kFailedPrecondition);
  EXPECT_NE(again.status().message().find("ckptctl delete squat"), std::string::npos)
      << again.status();
  CKPT_EXPECT_CODE(Register(&a, root).status(), kFailedPrecondition) << "root's too";
  // Evicting again is harmless; deleting the job frees the id.
  CKPT_ASSERT_OK_AND_ASSIGN(released, engine_->EvictJob("squat", root));
  EXPECT_EQ(released, 0u);
  CKPT_ASSERT_OK(engine_->DeleteJob("squat", owner_).status());
  CKPT_ASSERT_OK_AND_ASSIGN(Registered fresh, Register(&a));
  EXPECT_EQ(fresh.latest_durable_step, 0u) << "a new job, without the old history";
}

// Regression: ckptd kept an open descriptor of every rank directory it had
// ever written, so a long-lived node's descriptors grew with every job it
// served (846 after 846 ranks had come and gone, docs/scaling.md). A rank's
// goes when its registration ends, and comes back when it writes again.
TEST_F(EnginePipelineTest, RankDirectoryDescriptorGoesWithTheRegistration) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(OneWriter(), /*chunks=*/16));
  TestRank a = MakeRank("dirs_a", 1);
  TestRank b = MakeRank("dirs_b", 1);
  CKPT_ASSERT_OK(Register(&a).status());
  CKPT_ASSERT_OK(Register(&b).status());
  for (TestRank* r : {&a, &b}) {
    WriteStep(*r, 1);
    CKPT_ASSERT_OK(StepDone(*r, 1));
    CKPT_ASSERT_OK(WaitDurable(*r, 1).status());
  }
  EXPECT_EQ(store_->open_rank_dirs(), 2u);
  CKPT_ASSERT_OK(engine_->Unregister(Ref(a), /*drain=*/true, owner_, absl::Now() + kWait));
  EXPECT_EQ(store_->open_rank_dirs(), 1u);
  CKPT_ASSERT_OK(engine_->Unregister(Ref(b), /*drain=*/false, owner_, absl::Now() + kWait));
  EXPECT_EQ(store_->open_rank_dirs(), 0u);
  // Registered again, the rank writes into its directory as before.
  CKPT_ASSERT_OK(Register(&a).status());
  WriteStep(a, 2);
  CKPT_ASSERT_OK(StepDone(a, 2));
  CKPT_ASSERT_OK_AND_ASSIGN(uint64_t durable, WaitDurable(a, 2));
  EXPECT_EQ(durable, 2u);
  EXPECT_EQ(store_->open_rank_dirs(), 1u);
  WriteStep(a, 0);
  CKPT_ASSERT_OK_AND_ASSIGN(Restored restored, engine_->Restore(Ref(a), 2, owner_));
  EXPECT_EQ(restored.plan.target_step, 2u);
  EXPECT_TRUE(HoldsStep(a, 2));
}

// How many mappings of the memfd named `name` this process holds.
int MemfdMappings(const std::string& name) {
  std::ifstream maps("/proc/self/maps");
  int n = 0;
  for (std::string line; std::getline(maps, line);) {
    if (line.find("/memfd:" + name + " ") != std::string::npos) ++n;
  }
  return n;
}

// Regression: a host trainer that exited stayed registered and its memfd
// regions stayed mapped in ckptd until the rank registered again. The
// registering process is now watched for host ranks too.
TEST_F(EnginePipelineTest, HostMemoryIsReleasedWhenTheTrainerProcessExits) {
  EngineOptions options = OneWriter();
  options.trainer_watch_interval = absl::Milliseconds(10);
  ASSERT_NO_FATAL_FAILURE(StartEngine(options, /*chunks=*/16));
  TestRank r = MakeRank("exiting", 2);
  const pid_t trainer = ::fork();
  ASSERT_GE(trainer, 0);
  if (trainer == 0) {
    ::pause();  // the "trainer": lives until the test kills it
    ::_exit(0);
  }
  Caller caller;
  caller.pid = trainer;
  CKPT_ASSERT_OK(Register(&r, caller).status());
  CKPT_ASSERT_OK(StepDone(r, 1));
  CKPT_ASSERT_OK(WaitDurable(r, 1).status());
  EXPECT_EQ(MemfdMappings("exiting"), 2);  // the test's and the engine's

  ASSERT_EQ(::kill(trainer, SIGKILL), 0);
  int status = 0;
  ASSERT_EQ(::waitpid(trainer, &status, 0), trainer);
  const absl::Time deadline = absl::Now() + kWait;
  while (MemfdMappings("exiting") != 1 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));  // a poll with a deadline
  }
  EXPECT_EQ(MemfdMappings("exiting"), 1) << "the engine still maps the exited trainer's region";
  const absl::Status s = StepDone(r, 2);
  CKPT_EXPECT_CODE(s, kFailedPrecondition);
  EXPECT_NE(std::string(s.message()).find("trainer process exited"), std::string::npos) << s;
  // What was durable before the exit stays restorable.
  CKPT_ASSERT_OK_AND_ASSIGN(CompositePlan plan, Plan(r, 1));
  EXPECT_EQ(PlannedSteps(plan), (std::vector<uint64_t>{1, 1}));
}

// Regression: during a shutdown (systemctl stop) StepDone was refused as
// UNAVAILABLE, but the fence for that step then failed with
// FAILED_PRECONDITION ("never reported"), which the client does not take for
// the loss of ckptd, so a trainer set to continue unprotected died. Held
// right after the engine starts stopping, every call of the registration
// must carry kShuttingDown.
TEST_F(EnginePipelineTest, EveryCallDuringShutdownSaysShuttingDown) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(OneWriter(), /*chunks=*/16));
  TestRank r = MakeRank("stopping", 2);
  CKPT_ASSERT_OK(Register(&r).status());
  CKPT_ASSERT_OK(StepDone(r, 1));
  CKPT_ASSERT_OK(WaitSnapshot(r, 1).status());
  CKPT_ASSERT_OK(WaitDurable(r, 1).status());

  constexpr char kChecked[] = "PipelineTest:checked_during_shutdown";
  sp_->LoadDependency({{kChecked, "engine.shutdown.stopping"}});
  std::thread stopper([this] { engine_->Shutdown(absl::Seconds(10)); });
  ASSERT_TRUE(sp_->WaitForArrivals("engine.shutdown.stopping", 1, absl::Now() + kWait));
  auto shutting_down = [](const absl::Status& s) {
    return ReasonOf(s) == ErrorReason::kShuttingDown;
  };
  const absl::Status step = StepDone(r, 2);
  EXPECT_TRUE(absl::IsUnavailable(step) && shutting_down(step)) << step;
  const absl::Status fence = WaitSnapshot(r, 2).status();  // step 2 was never reported
  EXPECT_TRUE(shutting_down(fence)) << fence;
  const absl::Status durable = WaitDurable(r, 1).status();
  EXPECT_TRUE(shutting_down(durable)) << durable;
  CKPT_SYNC_POINT(kChecked);
  stopper.join();
}

// Regression: a failed registration still created the job, so the first uid
// to use an id owned it forever even when its registration was refused
// (job-id squatting).
TEST_F(EnginePipelineTest, ARefusedRegistrationCreatesNoJob) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(OneWriter(), /*chunks=*/16));
  TestRank r = MakeRank("contested", 2, PolicyKind::kLayerCheck);  // no optimizer: refused
  const absl::Status refused = Register(&r).status();
  CKPT_ASSERT_CODE(refused, kInvalidArgument);
  Caller root;
  CKPT_ASSERT_OK_AND_ASSIGN(v1::JobsReply jobs, engine_->Jobs(root));
  EXPECT_EQ(jobs.jobs_size(), 0);
  // Another user can now take the id.
  Caller other;
  other.uid = owner_.uid + 1;
  TestRank mine = MakeRank("contested", 2);
  std::vector<UniqueFd> fds;
  fds.emplace_back(::fcntl(mine.region.fd(), F_DUPFD_CLOEXEC, 0));
  CKPT_ASSERT_OK(engine_->Register(RegistrationOf(mine), std::move(fds), other).status());
  CKPT_ASSERT_OK_AND_ASSIGN(jobs, engine_->Jobs(root));
  ASSERT_EQ(jobs.jobs_size(), 1);
  EXPECT_EQ(jobs.jobs(0).owner_uid(), other.uid);
  // And the first user is now refused.
  CKPT_EXPECT_CODE(Register(&r).status(), kPermissionDenied);
}

// Another user's job must read exactly like a job that does not exist:
// NOT_FOUND with the same words, for the admin queries and the per-step
// calls alike, so no uid learns which job ids are in use.
TEST_F(EnginePipelineTest, AnotherUsersJobReadsLikeAMissingOne) {
  ASSERT_NO_FATAL_FAILURE(StartEngine(OneWriter(), /*chunks=*/16));
  TestRank r = MakeRank("hidden", 2);
  CKPT_ASSERT_OK(Register(&r).status());
  CKPT_ASSERT_OK(StepDone(r, 1));
  CKPT_ASSERT_OK(WaitDurable(r, 1).status());
  const Caller other{owner_.uid + 1, 0};
  auto words = [](const absl::Status& s, const std::string& job) {
    std::string m(s.message());
    const size_t at = m.find(job);
    if (at != std::string::npos) m.replace(at, job.size(), "JOB");
    return m;
  };
  const absl::Status theirs = engine_->Plan("hidden", 0, 0, other).status();
  const absl::Status missing = engine_->Plan("nosuchjob", 0, 0, other).status();
  CKPT_EXPECT_CODE(theirs, kNotFound);
  CKPT_EXPECT_CODE(missing, kNotFound);
  EXPECT_EQ(words(theirs, "hidden"), words(missing, "nosuchjob"));
  CKPT_EXPECT_CODE(engine_->DeleteJob("hidden", other).status(), kNotFound);
  CKPT_EXPECT_CODE(engine_->ReleaseRank("hidden", 0, other).status(), kNotFound);
  StepReport report;
  report.rank = Ref(r);
  report.step = 2;
  const absl::Status step = engine_->StepDone(report, other);
  CKPT_EXPECT_CODE(step, kNotFound);
  EXPECT_EQ(ReasonOf(step), ErrorReason::kNotRegistered);
  // Status counts only the caller's own jobs and trainers.
  EXPECT_EQ(engine_->GetStatus(other).jobs(), 0u);
  EXPECT_EQ(engine_->GetStatus(other).registered_ranks(), 0u);
  EXPECT_EQ(engine_->GetStatus(owner_).jobs(), 1u);
  EXPECT_EQ(engine_->GetStatus(owner_).registered_ranks(), 1u);
  EXPECT_EQ(engine_->GetStatus(Caller{0, 0}).jobs(), 1u);  // root: every job
  // The owner still sees it all.
  CKPT_EXPECT_OK(engine_->Plan("hidden", 0, 0, owner_).status());
}

}  // namespace
}  // namespace engine_test
}  // namespace ckpt
