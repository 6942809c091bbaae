#include "tests/lib/test_util.h"

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/time/clock.h"

namespace ckpt {
namespace testing {
namespace {

int RemoveEntry(const char* path, const struct stat* st, int type, struct FTW* ftw) {
  (void)st;
  (void)ftw;
  if (type == FTW_DP) {
    ::rmdir(path);
  } else {
    ::unlink(path);
  }
  return 0;
}

}  // namespace

TempDir::TempDir() {
  char tmpl[] = "/tmp/ckpt_test.XXXXXX";
  char* p = ::mkdtemp(tmpl);
  if (p == nullptr) {
    ADD_FAILURE() << "mkdtemp: " << std::strerror(errno);
    return;
  }
  path_ = p;
}

TempDir::~TempDir() {
  if (!path_.empty()) RemoveTree(path_);
}

void RemoveTree(const std::string& path) {
  ::nftw(path.c_str(), RemoveEntry, 16, FTW_DEPTH | FTW_PHYS);
}

std::string RandomBytes(uint64_t seed, size_t n) {
  std::mt19937_64 rng(seed);
  std::string out(n, '\0');
  FillRandom(&rng, out.data(), n);
  return out;
}

void FillRandom(std::mt19937_64* rng, void* buf, size_t n) {
  char* p = static_cast<char*>(buf);
  while (n >= 8) {
    uint64_t v = (*rng)();
    std::memcpy(p, &v, 8);
    p += 8;
    n -= 8;
  }
  if (n > 0) {
    uint64_t v = (*rng)();
    std::memcpy(p, &v, n);
  }
}

size_t CountOpenFds() {
  size_t n = 0;
  DIR* d = ::opendir("/proc/self/fd");
  if (d == nullptr) {
    ADD_FAILURE() << "opendir /proc/self/fd: " << std::strerror(errno);
    return 0;
  }
  while (struct dirent* e = ::readdir(d)) {
    if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) ++n;
  }
  ::closedir(d);
  return n;
}

void WriteFile(const std::string& path, const std::string& data) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(data.data(), static_cast<std::streamsize>(data.size()));
  out.close();
  if (!out) ADD_FAILURE() << "cannot write " << path;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return "<missing>";
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool PathExists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

void FreeDeleter::operator()(void* p) const { ::free(p); }

AlignedPtr AllocAligned(size_t bytes, size_t alignment) {
  void* p = nullptr;
  if (::posix_memalign(&p, alignment, bytes == 0 ? alignment : bytes) != 0) {
    ADD_FAILURE() << "posix_memalign of " << bytes << " bytes failed";
    return AlignedPtr(nullptr);
  }
  return AlignedPtr(static_cast<char*>(p));
}

pid_t ThreadId() { return static_cast<pid_t>(::syscall(SYS_gettid)); }

bool WaitUntilThreadSleeps(pid_t tid, absl::Time deadline) {
  const std::string path = "/proc/self/task/" + std::to_string(tid) + "/stat";
  for (;;) {
    // "<tid> (<comm>) <state> ...": the state follows the last ')'.
    std::string stat = ReadFile(path);
    const size_t paren = stat.rfind(')');
    if (paren != std::string::npos && paren + 2 < stat.size() && stat[paren + 2] == 'S') {
      return true;
    }
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(1));  // between polls of a state; bounded by `deadline`
  }
}

ExhaustedDescriptors::ExhaustedDescriptors(uint64_t limit) {
  struct rlimit rl;
  ::getrlimit(RLIMIT_NOFILE, &rl);
  saved_limit_ = rl.rlim_cur;
  rl.rlim_cur = limit;
  if (::setrlimit(RLIMIT_NOFILE, &rl) != 0) {
    error_ = "setrlimit";
    return;
  }
  lowered_ = true;
  for (;;) {
    const int fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      if (errno != EMFILE) error_ = "filler open";
      return;
    }
    filler_.push_back(fd);
  }
}

void ExhaustedDescriptors::Release() {
  for (int fd : filler_) ::close(fd);
  filler_.clear();
  if (lowered_) {
    struct rlimit rl;
    ::getrlimit(RLIMIT_NOFILE, &rl);
    rl.rlim_cur = saved_limit_;
    ::setrlimit(RLIMIT_NOFILE, &rl);
    lowered_ = false;
  }
}

}  // namespace testing
}  // namespace ckpt
