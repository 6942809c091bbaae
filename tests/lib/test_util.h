// Shared helpers for ckptd unit tests: status assertions, temporary
// directories, seeded random bytes, aligned buffers, fd counting and waiting
// for a thread to block.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define CKPT_TEST_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define CKPT_TEST_SANITIZER 1
#endif
#endif

namespace ckpt {
namespace testing {

// Built with ASan/UBSan or TSan (tests/sanitize.sh). Tests that take every
// descriptor the process may open skip there: the sanitizer runtime opens
// its report file (log_path) lazily and aborts when it cannot. Tests that
// measure glibc's heap through RSS skip too: the sanitizer's allocator
// keeps freed memory in quarantine by design.
#ifdef CKPT_TEST_SANITIZER
inline constexpr bool kSanitizerBuild = true;
#else
inline constexpr bool kSanitizerBuild = false;
#endif

inline ::testing::AssertionResult IsOk(const absl::Status& s) {
  if (s.ok()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "status is " << s;
}
template <typename T>
::testing::AssertionResult IsOk(const absl::StatusOr<T>& s) {
  return IsOk(s.status());
}

inline ::testing::AssertionResult HasCode(const absl::Status& s, absl::StatusCode code) {
  if (s.code() == code) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "expected code " << code << ", got " << s;
}
template <typename T>
::testing::AssertionResult HasCode(const absl::StatusOr<T>& s, absl::StatusCode code) {
  return HasCode(s.status(), code);
}

// A directory from mkdtemp under /tmp, removed recursively on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  std::string Join(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Removes `path` and everything below it; missing paths are fine.
void RemoveTree(const std::string& path);

// `n` bytes from a generator seeded with `seed`.
std::string RandomBytes(uint64_t seed, size_t n);
void FillRandom(std::mt19937_64* rng, void* buf, size_t n);

// Entries of /proc/self/fd (including the one used to list it).
size_t CountOpenFds();

// Takes every descriptor the process may still open: lowers the soft
// RLIMIT_NOFILE to `limit` and fills the table with /dev/null, so the next
// open, socket or accept fails with EMFILE. Release() (or the destructor)
// closes them and restores the limit. For a forked child: it changes the
// whole process's limit.
class ExhaustedDescriptors {
 public:
  explicit ExhaustedDescriptors(uint64_t limit = 256);
  ~ExhaustedDescriptors() { Release(); }
  ExhaustedDescriptors(const ExhaustedDescriptors&) = delete;
  ExhaustedDescriptors& operator=(const ExhaustedDescriptors&) = delete;
  // Empty when the table is full; otherwise what went wrong.
  const std::string& error() const { return error_; }
  void Release();

 private:
  uint64_t saved_limit_ = 0;
  bool lowered_ = false;
  std::vector<int> filler_;
  std::string error_;
};

// Writes `data` to `path` (created or truncated); fails the test on error.
void WriteFile(const std::string& path, const std::string& data);
// The contents of `path`, or "<missing>" when it cannot be read.
std::string ReadFile(const std::string& path);
bool PathExists(const std::string& path);

// The calling thread's kernel id (gettid).
pid_t ThreadId();
// Polls /proc/self/task/<tid>/stat until thread `tid` of this process is
// asleep in a blocking call (state S), or `deadline` passes; true if it is.
// The signal that a thread has reached a wait which the code under test does
// not expose: once the thread has only one blocking call left ahead of it,
// sleeping means it is there.
bool WaitUntilThreadSleeps(pid_t tid, absl::Time deadline);

// 4096-aligned memory from posix_memalign.
struct FreeDeleter {
  void operator()(void* p) const;
};
using AlignedPtr = std::unique_ptr<char, FreeDeleter>;
AlignedPtr AllocAligned(size_t bytes, size_t alignment = 4096);

}  // namespace testing
}  // namespace ckpt

#define CKPT_EXPECT_OK(expr) EXPECT_TRUE(::ckpt::testing::IsOk((expr)))
#define CKPT_ASSERT_OK(expr) ASSERT_TRUE(::ckpt::testing::IsOk((expr)))
#define CKPT_EXPECT_CODE(expr, code) \
  EXPECT_TRUE(::ckpt::testing::HasCode((expr), ::absl::StatusCode::code))
#define CKPT_ASSERT_CODE(expr, code) \
  ASSERT_TRUE(::ckpt::testing::HasCode((expr), ::absl::StatusCode::code))

#define CKPT_TEST_CONCAT_INNER_(a, b) a##b
#define CKPT_TEST_CONCAT_(a, b) CKPT_TEST_CONCAT_INNER_(a, b)
// `lhs = value of expr` (an absl::StatusOr), or fails the test (fatal).
#define CKPT_ASSERT_OK_AND_ASSIGN(lhs, expr) \
  CKPT_ASSERT_OK_AND_ASSIGN_IMPL_(CKPT_TEST_CONCAT_(ckpt_test_or_, __LINE__), lhs, expr)
#define CKPT_ASSERT_OK_AND_ASSIGN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                    \
  ASSERT_TRUE(::ckpt::testing::IsOk(tmp));              \
  lhs = std::move(tmp).value()
