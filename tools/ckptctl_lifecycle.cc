// ckptctl's commands that change a job (ckptctl_commands.h): gc (the
// retention policy), release (a rank's registration) and delete (the whole
// job).
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "tools/ckptctl_commands.h"
#include "tools/ckptctl_output.h"
#include "tools/terminal_text.h"

namespace ckpt::ctl {

int GcCommand(const Options& o, const AdminConnection& admin) {
  v1::GcRequest req;
  req.set_job_id(o.positional[0]);
  req.set_dry_run(o.dry_run);
  v1::GcReply r;
  if (int rc = admin.Call(&v1::Admin::Stub::Gc, req, &r); rc != kExitOk) return rc;
  if (o.json) {
    PrintJson(Json{{"dry_run", o.dry_run},
                   {"versions_deleted", r.versions_deleted()},
                   {"bytes_deleted", r.bytes_deleted()},
                   {"events_deleted", r.events_deleted()},
                   {"versions_kept", r.versions_kept()},
                   {"bytes_kept", r.bytes_kept()},
                   {"retained_targets", r.retained_targets()},
                   {"ranks_busy", r.ranks_busy()}});
    return kExitOk;
  }
  const char* verb = o.dry_run ? "would delete" : "deleted";
  PrintKv({
      {verb, absl::StrCat(r.versions_deleted(), " versions, ", BytesWithRaw(r.bytes_deleted()),
                          ", ", r.events_deleted(), " events")},
      {"kept", absl::StrCat(r.versions_kept(), " versions, ", BytesWithRaw(r.bytes_kept()))},
      {"restorable steps", absl::StrCat(r.retained_targets())},
      {"ranks busy (skipped)", absl::StrCat(r.ranks_busy())},
  });
  return kExitOk;
}

int ReleaseCommand(const Options& o, const AdminConnection& admin) {
  v1::ReleaseRankRequest req;
  req.set_job_id(o.positional[0]);
  req.set_rank(o.rank.value_or(0));
  req.set_evict(o.evict);
  v1::ReleaseRankReply r;
  if (int rc = admin.Call(&v1::Admin::Stub::ReleaseRank, req, &r); rc != kExitOk) return rc;
  if (o.evict) {
    if (o.json) {
      PrintJson(Json{
          {"job_id", req.job_id()}, {"evicted", true}, {"ranks_released", r.ranks_released()}});
    } else {
      std::printf(
          "evicted job %s: %u registrations released; none registers again until the "
          "job is deleted (ckptctl delete %s)\n",
          TerminalSafe(req.job_id()).c_str(), r.ranks_released(),
          TerminalSafe(req.job_id()).c_str());
    }
    return kExitOk;
  }
  if (o.json) {
    PrintJson(Json{{"job_id", req.job_id()}, {"rank", req.rank()}, {"generation", r.generation()}});
    return kExitOk;
  }
  std::printf("released job %s rank %u (generation %llu)\n", TerminalSafe(req.job_id()).c_str(),
              req.rank(), static_cast<unsigned long long>(r.generation()));
  return kExitOk;
}

int DeleteCommand(const Options& o, const AdminConnection& admin) {
  v1::DeleteJobRequest req;
  req.set_job_id(o.positional[0]);
  v1::DeleteJobReply r;
  if (int rc = admin.Call(&v1::Admin::Stub::DeleteJob, req, &r); rc != kExitOk) return rc;
  if (o.json) {
    PrintJson(Json{{"job_id", req.job_id()},
                   {"ranks", r.ranks()},
                   {"versions_deleted", r.versions_deleted()},
                   {"bytes_deleted", r.bytes_deleted()},
                   {"events_deleted", r.events_deleted()}});
    return kExitOk;
  }
  PrintKv({
      {"deleted job", req.job_id()},
      {"ranks", absl::StrCat(r.ranks())},
      {"versions", absl::StrCat(r.versions_deleted(), ", ", BytesWithRaw(r.bytes_deleted()))},
      {"events", absl::StrCat(r.events_deleted())},
  });
  return kExitOk;
}

}  // namespace ckpt::ctl
