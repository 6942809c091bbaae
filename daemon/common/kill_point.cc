#include "daemon/common/kill_point.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <string>

namespace ckpt {
namespace {

struct KillConfig {
  std::string at;
  long at_count = 1;
  long odds = 0;
  std::string log_path;
  std::mt19937_64 rng;
  long hits = 0;
  std::string delay_at;
  long delay_ms = 0;
  long delay_hit = 0;  // hold only this hit of the delay point (0: every hit)
  long delay_hits = 0;
  std::string cancel_at;
  long cancel_hit = 1;
  long cancel_hits = 0;
  std::string delay_log_path;
  std::string delay_until_path;
};

std::once_flag g_once;
std::atomic<bool> g_armed{false};
std::mutex g_mu;
KillConfig* g_config = nullptr;

void Load() {
  auto* c = new KillConfig();
  if (const char* at = std::getenv("CKPT_KILL_AT")) {
    std::string s = at;
    auto colon = s.find(':');
    c->at = s.substr(0, colon);
    if (colon != std::string::npos) c->at_count = std::atol(s.c_str() + colon + 1);
  }
  if (const char* odds = std::getenv("CKPT_KILL_ODDS")) c->odds = std::atol(odds);
  if (const char* delay = std::getenv("CKPT_DELAY_AT")) {
    std::string s = delay;
    auto colon = s.find(':');
    c->delay_at = s.substr(0, colon);
    c->delay_ms = colon == std::string::npos ? 100 : std::atol(s.c_str() + colon + 1);
    auto second = colon == std::string::npos ? std::string::npos : s.find(':', colon + 1);
    if (second != std::string::npos) c->delay_hit = std::atol(s.c_str() + second + 1);
  }
  if (const char* cancel = std::getenv("CKPT_CANCEL_AT")) {
    std::string s = cancel;
    auto colon = s.find(':');
    c->cancel_at = s.substr(0, colon);
    if (colon != std::string::npos) c->cancel_hit = std::atol(s.c_str() + colon + 1);
  }
  if (const char* log = std::getenv("CKPT_KILL_LOG")) c->log_path = log;
  if (const char* log = std::getenv("CKPT_DELAY_LOG")) c->delay_log_path = log;
  if (const char* until = std::getenv("CKPT_DELAY_UNTIL")) c->delay_until_path = until;
  const char* seed = std::getenv("CKPT_KILL_SEED");
  c->rng.seed(seed ? std::strtoull(seed, nullptr, 10)
                   : static_cast<uint64_t>(::getpid()) * 7919 + ::time(nullptr));
  g_config = c;
  g_armed.store(!c->at.empty() || c->odds > 0 || !c->delay_at.empty() || !c->cancel_at.empty(),
                std::memory_order_relaxed);
}

// Appends `name` as one line to `path` (fsynced); best effort.
void AppendLine(const std::string& path, const char* name) {
  int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return;
  std::string line = std::string(name) + "\n";
  ssize_t unused = ::write(fd, line.data(), line.size());
  (void)unused;
  ::fsync(fd);
  ::close(fd);
}

void Die(const char* name) {
  if (!g_config->log_path.empty()) AppendLine(g_config->log_path, name);
  ::kill(::getpid(), SIGKILL);
  ::pause();
}

}  // namespace

void InitKillPoints() { std::call_once(g_once, Load); }

bool KillPointsArmed() {
  InitKillPoints();
  return g_armed.load(std::memory_order_relaxed);
}

void KillPointHit(const char* name) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_config->at.empty() && g_config->at == name && ++g_config->hits >= g_config->at_count) {
    Die(name);
  }
  if (g_config->odds > 0 && g_config->rng() % static_cast<uint64_t>(g_config->odds) == 0) {
    Die(name);
  }
}

bool CancelPointHit(const char* name) {
  if (g_config->cancel_at != name) return false;
  std::lock_guard<std::mutex> lock(g_mu);
  return ++g_config->cancel_hits == g_config->cancel_hit;
}

void DelayPointHit(const char* name) {
  if (g_config->delay_at != name || g_config->delay_ms <= 0) return;
  if (g_config->delay_hit > 0) {
    std::lock_guard<std::mutex> lock(g_mu);
    if (++g_config->delay_hits != g_config->delay_hit) return;
  }
  if (!g_config->delay_log_path.empty()) AppendLine(g_config->delay_log_path, name);
  if (g_config->delay_until_path.empty()) {
    ::usleep(static_cast<useconds_t>(g_config->delay_ms) * 1000);
    return;
  }
  // Held until the test creates the file, never past the delay.
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(g_config->delay_ms);
  while (::access(g_config->delay_until_path.c_str(), F_OK) != 0 &&
         std::chrono::steady_clock::now() < deadline) {
    ::usleep(5000);
  }
}

}  // namespace ckpt
