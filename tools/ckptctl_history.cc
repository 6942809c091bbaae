// ckptctl's view of one rank's past and restore (ckptctl_commands.h):
// history (its checkpoint events) and plan (the composite restore plan).
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "tools/ckptctl_commands.h"
#include "tools/ckptctl_output.h"
#include "tools/terminal_text.h"

namespace ckpt::ctl {

int HistoryCommand(const Options& o, const AdminConnection& admin) {
  v1::HistoryRequest req;
  req.set_job_id(o.positional[0]);
  req.set_rank(o.rank.value_or(0));
  req.set_layer(o.layer.value_or(-1));
  req.set_limit(o.limit.value_or(0));
  v1::HistoryReply r;
  if (int rc = admin.Call(&v1::Admin::Stub::History, req, &r); rc != kExitOk) return rc;
  if (o.json) {
    Json events = Json::array();
    for (const v1::HistoryEvent& e : r.events()) {
      std::vector<uint32_t> layers(e.layers().begin(), e.layers().end());
      events.push_back(Json{{"step", e.step()},
                            {"layers", std::move(layers)},
                            {"bytes", e.bytes()},
                            {"failed", e.failed()},
                            {"skipped", e.skipped()},
                            {"remote", e.remote()}});
    }
    PrintJson(Json{{"events", std::move(events)}});
    return kExitOk;
  }
  if (r.events().empty()) {
    std::printf("no events\n");
    return kExitOk;
  }
  Table t({"STEP", "LAYERS", "BYTES", "FAILED", "SKIPPED", "REMOTE"},
          {true, false, true, true, true, false});
  for (const v1::HistoryEvent& e : r.events()) {
    t.Add({absl::StrCat(e.step()), LayerList(e.layers(), 40), HumanBytes(e.bytes()),
           absl::StrCat(e.failed()), absl::StrCat(e.skipped()), e.remote() ? "yes" : "-"});
  }
  t.Print();
  return kExitOk;
}

int PlanCommand(const Options& o, const AdminConnection& admin) {
  v1::PlanRequest req;
  req.set_job_id(o.positional[0]);
  req.set_rank(o.rank.value_or(0));
  req.set_target_step(o.step.value_or(0));
  req.set_older_within_steps(o.older_within.value_or(0));
  v1::Plan r;
  if (int rc = admin.Call(&v1::Admin::Stub::Plan, req, &r); rc != kExitOk) return rc;
  if (o.json) {
    Json layers = Json::array();
    for (const v1::LayerPlan& l : r.layers()) {
      layers.push_back(Json{{"layer", l.layer()},
                            {"name", l.name()},
                            {"has_version", l.has_version()},
                            {"step", l.step()},
                            {"staleness", l.staleness()},
                            {"bytes", l.bytes()},
                            {"file", l.file()},
                            {"lost_step", l.lost_step()}});
    }
    PrintJson(Json{{"job_id", r.job_id()},
                   {"rank", r.rank()},
                   {"target_step", r.target_step()},
                   {"complete", r.complete()},
                   {"total_bytes", r.total_bytes()},
                   {"max_staleness", r.max_staleness()},
                   {"size_weighted_staleness", r.size_weighted_staleness()},
                   {"layers", std::move(layers)}});
    return kExitOk;
  }
  std::printf("job %s rank %u\n", TerminalSafe(r.job_id()).c_str(), r.rank());
  PrintKv({
      {"target step", absl::StrCat(r.target_step())},
      {"complete", r.complete() ? "yes" : "no (some layers have no version)"},
      {"total bytes", BytesWithRaw(r.total_bytes())},
      {"max staleness", absl::StrCat(r.max_staleness())},
      {"size-weighted staleness", absl::StrFormat("%.2f", r.size_weighted_staleness())},
  });
  std::printf("\n");
  Table t({"LAYER", "NAME", "STEP", "STALENESS", "BYTES", "LOST"},
          {true, false, true, true, true, true});
  for (const v1::LayerPlan& l : r.layers()) {
    t.Add({absl::StrCat(l.layer()), OrDash(l.name()),
           l.has_version() ? absl::StrCat(l.step()) : "-",
           l.has_version() ? absl::StrCat(l.staleness()) : "-",
           l.has_version() ? HumanBytes(l.bytes()) : "-",
           l.lost_step() != 0 ? absl::StrCat("step ", l.lost_step()) : "-"});
  }
  t.Print();
  return kExitOk;
}

}  // namespace ckpt::ctl
