// DaemonProcess: a real ckptd child process on a temp socket and data dir,
// for tests that talk to it through the real client and gRPC stubs.
#pragma once

#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

namespace ckpt::testing {

inline std::string BuildDir() {
  const char* b = std::getenv("CKPT_BUILD_DIR");
  return b ? b : "build";
}

inline std::string MakeTempDir(const char* prefix) {
  std::string tmpl = std::string("/tmp/") + prefix + "XXXXXX";
  char* p = ::mkdtemp(tmpl.data());
  return p ? std::string(p) : std::string();
}

class DaemonProcess {
 public:
  // `env` entries are NAME=VALUE strings added to the child's environment.
  DaemonProcess(std::string root, std::vector<std::string> flags, std::vector<std::string> env = {})
      : root_(std::move(root)), flags_(std::move(flags)), env_(std::move(env)) {
    socket_ = root_ + "/ckptd.sock";
  }
  ~DaemonProcess() { Kill(); }

  bool Start() {
    std::vector<std::string> args = {
        BuildDir() + "/daemon/ckptd",    "--socket=" + socket_,
        "--data_dir=" + root_ + "/data", "--staging_pool_bytes=67108864",
        "--staging_chunk_bytes=1048576", "--metrics_address=127.0.0.1:0"};
    args.insert(args.end(), flags_.begin(), flags_.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::vector<std::string> envs;
    for (char** e = environ; *e; ++e) envs.emplace_back(*e);
    envs.push_back("CKPT_LOG_LEVEL=warning");
    envs.insert(envs.end(), env_.begin(), env_.end());
    std::vector<char*> envp;
    for (auto& e : envs) envp.push_back(e.data());
    envp.push_back(nullptr);
    // ckptd dies with the test: a test that aborts (a failed CHECK, a
    // crash) runs no destructor, and a ckptd left behind would hold the
    // output pipe ctest waits on until the test's timeout.
    const pid_t parent = ::getpid();
    pid_ = ::fork();
    if (pid_ < 0) return false;
    if (pid_ == 0) {  // only async-signal-safe calls until execve
      if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || ::getppid() != parent) ::_exit(127);
      ::execve(argv[0], argv.data(), envp.data());
      ::_exit(127);
    }
    for (int i = 0; i < 600; ++i) {
      if (Connectable()) return true;
      int st;
      if (::waitpid(pid_, &st, WNOHANG) == pid_) {
        pid_ = -1;
        return false;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  }

  void Kill() { Signal(SIGKILL); }
  // SIGTERM and wait; returns the exit status (or -1).
  int Stop() { return Signal(SIGTERM); }
  bool alive() const { return pid_ > 0 && ::kill(pid_, 0) == 0; }
  pid_t pid() const { return pid_; }
  const std::string& socket() const { return socket_; }
  const std::string& root() const { return root_; }

 private:
  bool Connectable() const {
    int s = ::socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    socket_.copy(a.sun_path, sizeof(a.sun_path) - 1);
    bool ok = ::connect(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
    ::close(s);
    return ok;
  }
  int Signal(int sig) {
    if (pid_ <= 0) return -1;
    ::kill(pid_, sig);
    int st = 0;
    ::waitpid(pid_, &st, 0);
    pid_ = -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  }

  std::string root_;
  std::vector<std::string> flags_;
  std::vector<std::string> env_;
  std::string socket_;
  pid_t pid_ = -1;
};

}  // namespace ckpt::testing
