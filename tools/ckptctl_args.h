// ckptctl's command line: the usage text, the exit codes, the options one
// run parses, and the check that a command got what it takes (ckptctl.cc
// calls these before anything reaches ckptd). Single-threaded, like ckptctl.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace ckpt::ctl {

// Exit codes (also in the usage text).
constexpr int kExitOk = 0;
constexpr int kExitDaemonError = 1;
constexpr int kExitUsage = 2;
constexpr int kExitUnreachable = 3;
constexpr int kExitCorrupt = 4;
constexpr int kExitLocalError = 5;

constexpr double kDefaultTimeoutSeconds = 10;

// `ckptctl --help`: commands, flags and exit codes.
extern const char kUsage[];

// One run's command line; ParseArgs fills it, ValidateCommand checks it.
struct Options {
  std::string socket;
  double timeout_seconds = kDefaultTimeoutSeconds;
  bool json = false;
  bool help = false;
  std::string command;
  std::vector<std::string> positional;  // after the command
  std::optional<uint32_t> rank;
  std::optional<int64_t> layer;
  std::optional<uint32_t> limit;
  std::optional<uint64_t> step;
  std::optional<uint64_t> older_within;  // --older-within (plan, export, restore)
  std::string out;
  bool dry_run = false;
  bool deep = false;
  bool evict = false;
  std::string data_dir;
  std::optional<uint32_t> owner_uid;
};

// Prints a usage error on stderr (escaped) with a pointer to --help;
// returns kExitUsage.
int UsageError(absl::string_view msg);

// Fills `o` from argv; the socket defaults to $CKPT_SOCKET, else
// /run/ckptd/ckptd.sock. Returns kExitOk, or kExitUsage after printing why
// (unknown flag, bad number, missing value).
int ParseArgs(int argc, char** argv, Options* o);

// Checks that o.command exists and got exactly the arguments and flags it
// takes. Returns kExitOk, or kExitUsage after printing why.
int ValidateCommand(const Options& o);

// `help COMMAND`: prints the command's entry of the usage text and returns
// kExitOk; a usage error for a command the text does not name.
int HelpFor(const std::string& command);

}  // namespace ckpt::ctl
