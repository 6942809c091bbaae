// Sync points: named places in the daemon's code where a test running the
// daemon's classes in its own process orders threads deterministically
// (RocksDB's test_util/sync_point.h is the model), instead of sleeping and
// hoping the other thread got there first.
//
// A point is written CKPT_SYNC_POINT("stage.place") in the code. A test
//   - makes one point wait for another: LoadDependency({{"A", "B"}}) means
//     that a thread reaching B blocks until some thread has passed A (a test
//     thread passes its own points with CKPT_SYNC_POINT too);
//   - runs code at a point: SetCallBack("A", fn) calls fn(arg) each time a
//     thread passes A (arg is the pointer given to
//     CKPT_SYNC_POINT_CALLBACK, null for CKPT_SYNC_POINT);
//   - observes the points: arrivals() and passes() count them, and
//     WaitForArrivals() / WaitForPasses() wait for a count (with a deadline).
// Nothing happens until EnableProcessing(); after DisableProcessing() every
// point is a no-op again and threads blocked at a point go on.
//
// Every kill and delay point (kill_point.h) is also a sync point of the same
// name, so the points the crash tests know are available to tests too.
//
// Deadlines: a thread never blocks at a point longer than wait_timeout()
// (30 s unless SetWaitTimeout changes it). When the deadline passes, the
// point logs an ERROR naming itself and the predecessors it still waits for,
// counts the miss in timeouts() and proceeds as if the dependency were met.
// Proceeding (rather than aborting) keeps the process alive so the test's own
// assertions report what went wrong; a test fixture should still expect
// timeouts() == 0 at its end, since a miss means the ordering it wanted did
// not happen.
//
// Compiled in when CKPT_KILL_POINTS is defined (normal and test builds);
// without it the macros expand to nothing and kSyncPointsCompiled is false
// (tests that need the daemon's points GTEST_SKIP then). The class itself is
// always built, so tests of it compile everywhere. The cost of a point while
// processing is off is one atomic load.
//
// Thread-safety: every method is thread-safe. Callbacks run on the thread
// that passes the point, without the sync point's lock held, so they may
// pass other points or call any method here.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace ckpt {

#ifdef CKPT_KILL_POINTS
inline constexpr bool kSyncPointsCompiled = true;
#else
inline constexpr bool kSyncPointsCompiled = false;
#endif

class SyncPoint {
 public:
  // `successor` may not proceed until `predecessor` has been passed.
  struct Dependency {
    std::string predecessor;
    std::string successor;
  };

  // The process-wide instance (never destroyed).
  static SyncPoint* GetInstance();

  SyncPoint() = default;
  SyncPoint(const SyncPoint&) = delete;
  SyncPoint& operator=(const SyncPoint&) = delete;

  // Replaces every dependency with `deps` and clears the trace (what has been
  // passed so far), so the new order starts from nothing. Threads blocked
  // under the old dependencies re-check against the new ones.
  void LoadDependency(const std::vector<Dependency>& deps);

  // Calls `callback(arg)` whenever a thread passes `point` (after its
  // dependencies are met, before it counts as passed). Replaces an earlier
  // callback of the point.
  void SetCallBack(const std::string& point, std::function<void(void*)> callback);
  void ClearCallBack(const std::string& point);
  void ClearAllCallBacks();

  // Turns processing on or off for every point. DisableProcessing wakes the
  // threads blocked at a point; they go on without running callbacks.
  void EnableProcessing();
  void DisableProcessing();
  bool processing() const { return enabled_.load(std::memory_order_acquire); }

  // A test's start: no dependencies, callbacks or trace, waits bounded by
  // `wait_timeout`, processing on. A test's end: processing off (releasing
  // any parked thread), and no dependency or callback left for the next one.
  void StartTest(absl::Duration wait_timeout);
  void EndTest();

  // Forgets which points were passed and the arrival and pass counts; keeps
  // the dependencies and callbacks.
  void ClearTrace();

  // How long a thread waits at a point for its predecessors.
  // REQUIRES: timeout > 0.
  void SetWaitTimeout(absl::Duration timeout);
  absl::Duration wait_timeout() const;

  // Times a thread reached `point` (counted before it waits), and times one
  // passed it (after its callback), since the last ClearTrace.
  uint64_t arrivals(const std::string& point) const;
  uint64_t passes(const std::string& point) const;
  // Wait until arrivals(point) / passes(point) >= n. False when `deadline`
  // passed first; never waits past it.
  bool WaitForArrivals(const std::string& point, uint64_t n, absl::Time deadline) const;
  bool WaitForPasses(const std::string& point, uint64_t n, absl::Time deadline) const;

  // Waits that reached wait_timeout() since the last EnableProcessing.
  uint64_t timeouts() const;

  // What CKPT_SYNC_POINT expands to. `point` must stay valid for the call.
  static void Process(const char* point, void* arg = nullptr) {
    SyncPoint* self = GetInstance();
    if (self->processing()) self->ProcessSlow(point, arg);
  }

 private:
  using Callback = std::shared_ptr<const std::function<void(void*)>>;

  void ProcessSlow(const char* point, void* arg);
  // The predecessors of `point` not yet passed.
  std::vector<std::string> MissingLocked(const std::string& point) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);

  // Mirrors enabled_locked_ for the lock-free check in Process; written under
  // mu_ (release), read without it (acquire).
  std::atomic<bool> enabled_{false};

  mutable absl::Mutex mu_;
  bool enabled_locked_ ABSL_GUARDED_BY(mu_) = false;
  absl::Duration wait_timeout_ ABSL_GUARDED_BY(mu_) = absl::Seconds(30);
  std::map<std::string, std::vector<std::string>> predecessors_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Callback> callbacks_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, uint64_t> arrivals_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, uint64_t> passes_ ABSL_GUARDED_BY(mu_);
  uint64_t timeouts_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace ckpt

#ifdef CKPT_KILL_POINTS
#define CKPT_SYNC_POINT(name) ::ckpt::SyncPoint::Process(name)
#define CKPT_SYNC_POINT_CALLBACK(name, arg) ::ckpt::SyncPoint::Process(name, arg)
#else
#define CKPT_SYNC_POINT(name) \
  do {                        \
  } while (0)
#define CKPT_SYNC_POINT_CALLBACK(name, arg) \
  do {                                      \
  } while (0)
#endif
