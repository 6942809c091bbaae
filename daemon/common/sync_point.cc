#include "daemon/common/sync_point.h"

#include <utility>

#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "base/logging.h"

namespace ckpt {

SyncPoint* SyncPoint::GetInstance() {
  static SyncPoint* const instance = new SyncPoint();
  return instance;
}

void SyncPoint::LoadDependency(const std::vector<Dependency>& deps) {
  absl::MutexLock lock(&mu_);
  predecessors_.clear();
  for (const Dependency& d : deps) predecessors_[d.successor].push_back(d.predecessor);
  arrivals_.clear();
  passes_.clear();
}

void SyncPoint::SetCallBack(const std::string& point, std::function<void(void*)> callback) {
  auto shared = std::make_shared<const std::function<void(void*)>>(std::move(callback));
  absl::MutexLock lock(&mu_);
  callbacks_[point] = std::move(shared);
}

void SyncPoint::ClearCallBack(const std::string& point) {
  absl::MutexLock lock(&mu_);
  callbacks_.erase(point);
}

void SyncPoint::ClearAllCallBacks() {
  absl::MutexLock lock(&mu_);
  callbacks_.clear();
}

void SyncPoint::EnableProcessing() {
  absl::MutexLock lock(&mu_);
  enabled_locked_ = true;
  timeouts_ = 0;
  enabled_.store(true, std::memory_order_release);
}

void SyncPoint::StartTest(absl::Duration wait_timeout) {
  LoadDependency({});
  ClearAllCallBacks();
  SetWaitTimeout(wait_timeout);
  EnableProcessing();
}

void SyncPoint::EndTest() {
  DisableProcessing();
  LoadDependency({});
  ClearAllCallBacks();
}

void SyncPoint::DisableProcessing() {
  absl::MutexLock lock(&mu_);
  enabled_locked_ = false;
  enabled_.store(false, std::memory_order_release);
}

void SyncPoint::ClearTrace() {
  absl::MutexLock lock(&mu_);
  arrivals_.clear();
  passes_.clear();
}

void SyncPoint::SetWaitTimeout(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  wait_timeout_ = timeout;
}

absl::Duration SyncPoint::wait_timeout() const {
  absl::MutexLock lock(&mu_);
  return wait_timeout_;
}

uint64_t SyncPoint::arrivals(const std::string& point) const {
  absl::MutexLock lock(&mu_);
  auto it = arrivals_.find(point);
  return it == arrivals_.end() ? 0 : it->second;
}

uint64_t SyncPoint::passes(const std::string& point) const {
  absl::MutexLock lock(&mu_);
  auto it = passes_.find(point);
  return it == passes_.end() ? 0 : it->second;
}

namespace {

bool AwaitCount(absl::Mutex* mu, const std::map<std::string, uint64_t>* counts,
                const std::string& point, uint64_t n, absl::Time deadline) {
  absl::MutexLock lock(mu);
  auto reached = [counts, &point, n] {
    auto it = counts->find(point);
    return it != counts->end() && it->second >= n;
  };
  return mu->AwaitWithDeadline(absl::Condition(&reached), deadline);
}

}  // namespace

bool SyncPoint::WaitForArrivals(const std::string& point, uint64_t n, absl::Time deadline) const {
  return AwaitCount(&mu_, &arrivals_, point, n, deadline);
}

bool SyncPoint::WaitForPasses(const std::string& point, uint64_t n, absl::Time deadline) const {
  return AwaitCount(&mu_, &passes_, point, n, deadline);
}

uint64_t SyncPoint::timeouts() const {
  absl::MutexLock lock(&mu_);
  return timeouts_;
}

std::vector<std::string> SyncPoint::MissingLocked(const std::string& point) const {
  std::vector<std::string> missing;
  auto it = predecessors_.find(point);
  if (it == predecessors_.end()) return missing;
  for (const std::string& p : it->second) {
    if (passes_.count(p) == 0) missing.push_back(p);
  }
  return missing;
}

void SyncPoint::ProcessSlow(const char* point, void* arg) {
  const std::string name(point);
  Callback callback;
  {
    absl::MutexLock lock(&mu_);
    if (!enabled_locked_) return;
    ++arrivals_[name];
    auto ready = [this, &name]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return !enabled_locked_ || MissingLocked(name).empty();
    };
    const absl::Duration timeout = wait_timeout_;
    if (!mu_.AwaitWithDeadline(absl::Condition(&ready), absl::Now() + timeout)) {
      ++timeouts_;
      CKPT_LOG(ERROR) << "sync point " << name << " gave up after " << timeout << " waiting for ["
                      << absl::StrJoin(MissingLocked(name), ", ")
                      << "]; going on without them (the test's ordering did not happen)";
    }
    if (!enabled_locked_) return;
    auto cb = callbacks_.find(name);
    if (cb != callbacks_.end()) callback = cb->second;
  }
  if (callback != nullptr) (*callback)(arg);
  absl::MutexLock lock(&mu_);
  if (enabled_locked_) ++passes_[name];
}

}  // namespace ckpt
