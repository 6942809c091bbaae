// A small logging facade: CKPT_LOG(INFO|WARNING|ERROR) << ...;
//
// Lines go to stderr (journald under systemd) as
// "<RFC3339 time> <level> <file>:<line>] message". Thread-safe: each line is
// written with a single write(2). Log an error once, where it is handled.
#pragma once

#include <sstream>

namespace ckpt {

enum class LogLevel { kInfo = 0, kWarning = 1, kError = 2 };

// Lines below this level are dropped. Default kInfo; CKPT_LOG_LEVEL=warning
// or =error in the environment raises it.
void SetMinLogLevel(LogLevel level);
LogLevel MinLogLevel();

class LogMessage {
 public:
  LogMessage(LogLevel level, const char* file, int line);
  ~LogMessage();
  LogMessage(const LogMessage&) = delete;
  LogMessage& operator=(const LogMessage&) = delete;
  std::ostream& stream() { return stream_; }

 private:
  LogLevel level_;
  std::ostringstream stream_;
};

// Turns the stream expression into void so both arms of ?: match.
struct LogVoidify {
  void operator&(std::ostream&) {}
};

}  // namespace ckpt

#define CKPT_LOG_LEVEL_INFO ::ckpt::LogLevel::kInfo
#define CKPT_LOG_LEVEL_WARNING ::ckpt::LogLevel::kWarning
#define CKPT_LOG_LEVEL_ERROR ::ckpt::LogLevel::kError
// An expression (not an if/else), so it is safe inside an unbraced if.
#define CKPT_LOG(level)                            \
  (CKPT_LOG_LEVEL_##level < ::ckpt::MinLogLevel()) \
      ? (void)0                                    \
      : ::ckpt::LogVoidify() &                     \
            ::ckpt::LogMessage(CKPT_LOG_LEVEL_##level, __FILE__, __LINE__).stream()
