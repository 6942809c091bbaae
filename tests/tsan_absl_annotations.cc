// ThreadSanitizer annotations for Debian's Abseil (CKPT_SANITIZE=thread only).
//
// libabsl_synchronization.so is not built with -fsanitize=thread, so TSan
// sees none of absl::Mutex's happens-before edges (the lock is atomics and
// futexes inside an uninstrumented library) and reports every access to an
// ABSL_GUARDED_BY member from two threads as a race. Abseil's own TSan build
// annotates the mutex with TSan's mutex interface; this file does the same
// from the outside: the top-level CMakeLists.txt links every target with
// -Wl,--wrap=<symbol> for the functions below, so the calls our code makes go
// to __wrap_<symbol>, which annotates and calls the real __real_<symbol>.
// Calls made inside Debian's other libraries (gRPC, RocksDB) are not
// annotated; tests/tsan.supp covers what that leaves.
//
// The symbols are those of Abseil 20220623 on Debian 12 (inline namespace
// debian3); the CMake code checks that each one exists before wrapping it.
#include <sanitizer/tsan_interface.h>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

using absl::Condition;
using absl::Duration;
using absl::Mutex;
using absl::Time;

extern "C" {
// TSan's dynamic annotations (exported by the TSan runtime).
void AnnotateIgnoreReadsBegin(const char* file, int line);
void AnnotateIgnoreReadsEnd(const char* file, int line);
void AnnotateIgnoreWritesBegin(const char* file, int line);
void AnnotateIgnoreWritesEnd(const char* file, int line);
}

namespace {

void PreLock(Mutex* mu, unsigned flags) { __tsan_mutex_pre_lock(mu, flags); }
void PostLock(Mutex* mu, unsigned flags) { __tsan_mutex_post_lock(mu, flags, 0); }
void Release(Mutex* mu, unsigned flags) {
  __tsan_mutex_pre_unlock(mu, flags);
  __tsan_mutex_post_unlock(mu, flags);
}
void Acquire(Mutex* mu, unsigned flags) {
  PreLock(mu, flags);
  PostLock(mu, flags);
}

// Await and CondVar::Wait release the mutex while they wait and hold it again
// when they return; the conditions they evaluate run inside Abseil, partly on
// other threads, so memory accesses are ignored for the duration (Abseil's own
// annotations do not check them either).
template <typename F>
auto WhileReleased(Mutex* mu, unsigned flags, F&& f) {
  Release(mu, flags);
  AnnotateIgnoreReadsBegin(__FILE__, __LINE__);
  AnnotateIgnoreWritesBegin(__FILE__, __LINE__);
  auto r = f();
  AnnotateIgnoreWritesEnd(__FILE__, __LINE__);
  AnnotateIgnoreReadsEnd(__FILE__, __LINE__);
  Acquire(mu, flags);
  return r;
}

}  // namespace

extern "C" {

#define CKPT_REAL(sym) __real_##sym
#define CKPT_WRAP(sym) __wrap_##sym

// ---- exclusive locks ----
void CKPT_REAL(_ZN4absl7debian35Mutex4LockEv)(Mutex*);
void CKPT_WRAP(_ZN4absl7debian35Mutex4LockEv)(Mutex* mu) {
  PreLock(mu, 0);
  CKPT_REAL(_ZN4absl7debian35Mutex4LockEv)(mu);
  PostLock(mu, 0);
}
void CKPT_REAL(_ZN4absl7debian35Mutex6UnlockEv)(Mutex*);
void CKPT_WRAP(_ZN4absl7debian35Mutex6UnlockEv)(Mutex* mu) {
  __tsan_mutex_pre_unlock(mu, 0);
  CKPT_REAL(_ZN4absl7debian35Mutex6UnlockEv)(mu);
  __tsan_mutex_post_unlock(mu, 0);
}
bool CKPT_REAL(_ZN4absl7debian35Mutex7TryLockEv)(Mutex*);
bool CKPT_WRAP(_ZN4absl7debian35Mutex7TryLockEv)(Mutex* mu) {
  PreLock(mu, __tsan_mutex_try_lock);
  const bool ok = CKPT_REAL(_ZN4absl7debian35Mutex7TryLockEv)(mu);
  PostLock(mu, __tsan_mutex_try_lock | (ok ? 0 : __tsan_mutex_try_lock_failed));
  return ok;
}

// ---- shared locks ----
void CKPT_REAL(_ZN4absl7debian35Mutex10ReaderLockEv)(Mutex*);
void CKPT_WRAP(_ZN4absl7debian35Mutex10ReaderLockEv)(Mutex* mu) {
  PreLock(mu, __tsan_mutex_read_lock);
  CKPT_REAL(_ZN4absl7debian35Mutex10ReaderLockEv)(mu);
  PostLock(mu, __tsan_mutex_read_lock);
}
void CKPT_REAL(_ZN4absl7debian35Mutex12ReaderUnlockEv)(Mutex*);
void CKPT_WRAP(_ZN4absl7debian35Mutex12ReaderUnlockEv)(Mutex* mu) {
  __tsan_mutex_pre_unlock(mu, __tsan_mutex_read_lock);
  CKPT_REAL(_ZN4absl7debian35Mutex12ReaderUnlockEv)(mu);
  __tsan_mutex_post_unlock(mu, __tsan_mutex_read_lock);
}
bool CKPT_REAL(_ZN4absl7debian35Mutex13ReaderTryLockEv)(Mutex*);
bool CKPT_WRAP(_ZN4absl7debian35Mutex13ReaderTryLockEv)(Mutex* mu) {
  const unsigned f = __tsan_mutex_read_lock | __tsan_mutex_try_lock;
  PreLock(mu, f);
  const bool ok = CKPT_REAL(_ZN4absl7debian35Mutex13ReaderTryLockEv)(mu);
  PostLock(mu, f | (ok ? 0 : __tsan_mutex_try_lock_failed));
  return ok;
}

// ---- conditional waits (called with the mutex held; return with it held) ----
void CKPT_REAL(_ZN4absl7debian35Mutex5AwaitERKNS0_9ConditionE)(Mutex*, const Condition&);
void CKPT_WRAP(_ZN4absl7debian35Mutex5AwaitERKNS0_9ConditionE)(Mutex* mu, const Condition& c) {
  WhileReleased(mu, 0, [&] {
    CKPT_REAL(_ZN4absl7debian35Mutex5AwaitERKNS0_9ConditionE)(mu, c);
    return 0;
  });
}
bool CKPT_REAL(_ZN4absl7debian35Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE)(
    Mutex*, const Condition&, Time);
bool CKPT_WRAP(_ZN4absl7debian35Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE)(
    Mutex* mu, const Condition& c, Time t) {
  return WhileReleased(mu, 0, [&] {
    return CKPT_REAL(_ZN4absl7debian35Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE)(mu, c,
                                                                                            t);
  });
}
bool CKPT_REAL(_ZN4absl7debian35Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE)(
    Mutex*, const Condition&, Duration);
bool CKPT_WRAP(_ZN4absl7debian35Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE)(
    Mutex* mu, const Condition& c, Duration d) {
  return WhileReleased(mu, 0, [&] {
    return CKPT_REAL(_ZN4absl7debian35Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE)(
        mu, c, d);
  });
}

// ---- lock when a condition holds (called without the mutex) ----
void CKPT_REAL(_ZN4absl7debian35Mutex8LockWhenERKNS0_9ConditionE)(Mutex*, const Condition&);
void CKPT_WRAP(_ZN4absl7debian35Mutex8LockWhenERKNS0_9ConditionE)(Mutex* mu, const Condition& c) {
  AnnotateIgnoreReadsBegin(__FILE__, __LINE__);
  AnnotateIgnoreWritesBegin(__FILE__, __LINE__);
  CKPT_REAL(_ZN4absl7debian35Mutex8LockWhenERKNS0_9ConditionE)(mu, c);
  AnnotateIgnoreWritesEnd(__FILE__, __LINE__);
  AnnotateIgnoreReadsEnd(__FILE__, __LINE__);
  Acquire(mu, 0);
}
bool CKPT_REAL(_ZN4absl7debian35Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE)(
    Mutex*, const Condition&, Time);
bool CKPT_WRAP(_ZN4absl7debian35Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE)(
    Mutex* mu, const Condition& c, Time t) {
  AnnotateIgnoreReadsBegin(__FILE__, __LINE__);
  AnnotateIgnoreWritesBegin(__FILE__, __LINE__);
  const bool r =
      CKPT_REAL(_ZN4absl7debian35Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE)(mu, c, t);
  AnnotateIgnoreWritesEnd(__FILE__, __LINE__);
  AnnotateIgnoreReadsEnd(__FILE__, __LINE__);
  Acquire(mu, 0);  // held on return whether or not the condition became true
  return r;
}

// ---- destruction: the address may hold another mutex later ----
void CKPT_REAL(_ZN4absl7debian35MutexD1Ev)(Mutex*);
void CKPT_WRAP(_ZN4absl7debian35MutexD1Ev)(Mutex* mu) {
  __tsan_mutex_destroy(mu, 0);
  CKPT_REAL(_ZN4absl7debian35MutexD1Ev)(mu);
}

}  // extern "C"
