// ckptctl repair (ckptctl_commands.h): the offline index rebuild of a
// stopped ckptd's data directory (daemon/store/repair.h); no daemon.
#include <cstdio>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "daemon/io/file_system.h"
#include "daemon/store/repair.h"
#include "tools/ckptctl_commands.h"
#include "tools/ckptctl_output.h"

namespace ckpt::ctl {

int RepairCommand(const Options& o) {
  ckpt::RepairOptions ro;
  ro.owner_uid = o.owner_uid.value_or(0);
  absl::StatusOr<ckpt::RepairReport> r =
      ckpt::RepairDataDir(o.data_dir, ckpt::DefaultFileSystem(), ro);
  if (!r.ok()) {
    std::fprintf(stderr, "ckptctl: %s: repair of %s: %s\n",
                 absl::StatusCodeToString(r.status().code()).c_str(), o.data_dir.c_str(),
                 std::string(r.status().message()).c_str());
    return kExitLocalError;
  }
  if (o.json) {
    PrintJson(Json{{"index_rebuilt", r->index_rebuilt},
                   {"damaged_index", r->damaged_index},
                   {"open_error", r->open_error},
                   {"files_checked", r->files_checked},
                   {"records_kept", r->records_kept},
                   {"records_added", r->records_added},
                   {"files_unquarantined", r->files_unquarantined},
                   {"events_added", r->events_added},
                   {"ranks_added", r->ranks_added},
                   {"jobs_added", r->jobs_added},
                   {"skipped", r->skipped}});
    return kExitOk;
  }
  PrintKv({{"index_rebuilt", r->index_rebuilt ? "yes (old index kept as " + r->damaged_index + ")"
                                              : std::string("no")},
           {"files_checked", absl::StrCat(r->files_checked)},
           {"records_kept", absl::StrCat(r->records_kept)},
           {"records_added", absl::StrCat(r->records_added)},
           {"files_unquarantined", absl::StrCat(r->files_unquarantined)},
           {"events_added", absl::StrCat(r->events_added)},
           {"ranks_added", absl::StrCat(r->ranks_added)},
           {"jobs_added", absl::StrCat(r->jobs_added)},
           {"files_left_in_place", absl::StrCat(r->skipped.size())}});
  for (const std::string& s : r->skipped) std::printf("left in place: %s\n", s.c_str());
  return kExitOk;
}

}  // namespace ckpt::ctl
