// ckptctl's commands, one function each (ckptctl.cc dispatches on
// Options::command after ValidateCommand). Each calls ckptd through `admin`,
// prints a table or, with --json, one JSON document on stdout, and returns
// the exit code (ckptctl_args.h); errors go to stderr. Single-threaded.
#pragma once

#include "tools/ckptctl_args.h"
#include "tools/ckptctl_connection.h"

namespace ckpt::ctl {

// ckptctl_query.cc: what ckptd holds, read only.
int StatusCommand(const Options& o, const AdminConnection& admin);
int JobsCommand(const Options& o, const AdminConnection& admin);
int LayersCommand(const Options& o, const AdminConnection& admin);
int ConfigCommand(const Options& o, const AdminConnection& admin);
// kExitCorrupt when any version does not verify.
int VerifyCommand(const Options& o, const AdminConnection& admin);

// ckptctl_history.cc: one rank's checkpoint events and restore plan.
int HistoryCommand(const Options& o, const AdminConnection& admin);
int PlanCommand(const Options& o, const AdminConnection& admin);

// ckptctl_export.cc: export (every rank, or --rank) and restore (one rank,
// `one_rank`) into o.out; kExitLocalError when a file cannot be written.
int ExportCommand(const Options& o, const AdminConnection& admin, bool one_rank);

// ckptctl_lifecycle.cc: what changes a job: gc, release, delete.
int GcCommand(const Options& o, const AdminConnection& admin);
int ReleaseCommand(const Options& o, const AdminConnection& admin);
int DeleteCommand(const Options& o, const AdminConnection& admin);

// ckptctl_repair.cc: the offline index rebuild; no daemon, no connection.
// kExitLocalError when the repair fails or is refused.
int RepairCommand(const Options& o);

}  // namespace ckpt::ctl
