// ckptctl: the operator CLI of ckptd. Talks to the daemon's ckpt.v1.Admin
// service over its Unix socket and prints human tables or, with --json, one
// JSON document built field by field (stable names, numbers as numbers).
// Text from the daemon or the command line (names, ids, messages, paths) is
// printed through TerminalSafe() (tools/terminal_text.h), so no control
// character reaches the terminal; --json escapes through the JSON encoder.
// Run `ckptctl --help` for commands, flags and exit codes.
//
// The sources, by concern:
//   ckptctl_args.*        the usage text, the flags, the exit codes
//   ckptctl_connection.*  the Admin connection: deadlines, retries, errors
//   ckptctl_output.*      sizes, tables, key-value lists, JSON
//   ckptctl_commands.h    one function per command, defined in
//     ckptctl_query.cc      status, jobs, layers, config, verify
//     ckptctl_history.cc    history, plan
//     ckptctl_export.cc     export, restore
//     ckptctl_lifecycle.cc  gc, release, delete
//     ckptctl_repair.cc     repair (offline, no daemon)
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "tools/ckptctl_args.h"
#include "tools/ckptctl_commands.h"
#include "tools/ckptctl_connection.h"

namespace ckpt::ctl {
namespace {

// Runs a command that talks to ckptd (every one but repair and help).
int RunCommand(const Options& o, const AdminConnection& admin) {
  const std::string& c = o.command;
  if (c == "status") return StatusCommand(o, admin);
  if (c == "jobs") return JobsCommand(o, admin);
  if (c == "layers") return LayersCommand(o, admin);
  if (c == "history") return HistoryCommand(o, admin);
  if (c == "plan") return PlanCommand(o, admin);
  if (c == "verify") return VerifyCommand(o, admin);
  if (c == "gc") return GcCommand(o, admin);
  if (c == "release") return ReleaseCommand(o, admin);
  if (c == "delete") return DeleteCommand(o, admin);
  if (c == "export" || c == "restore") return ExportCommand(o, admin, c == "restore");
  if (c == "config") return ConfigCommand(o, admin);
  return UsageError(absl::StrCat("unknown command '", c, "'"));
}

int Main(int argc, char** argv) {
  Options o;
  if (int rc = ParseArgs(argc, argv, &o); rc != kExitOk) return rc;
  if (o.help || o.command == "help") {
    if (o.command == "help" && !o.positional.empty()) return HelpFor(o.positional[0]);
    std::fputs(kUsage, stdout);
    return kExitOk;
  }
  if (o.command.empty()) {
    std::fputs(kUsage, stderr);
    return kExitUsage;
  }
  if (int rc = ValidateCommand(o); rc != kExitOk) return rc;
  if (o.command == "repair") return RepairCommand(o);
  const AdminConnection admin(o);
  return RunCommand(o, admin);
}

}  // namespace
}  // namespace ckpt::ctl

int main(int argc, char** argv) { return ckpt::ctl::Main(argc, argv); }
