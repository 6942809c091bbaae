// ckptctl's read-only commands (ckptctl_commands.h): status, jobs, layers,
// config and verify.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "tools/ckptctl_commands.h"
#include "tools/ckptctl_output.h"
#include "tools/terminal_text.h"

namespace ckpt::ctl {

int StatusCommand(const Options& o, const AdminConnection& admin) {
  v1::StatusReply r;
  if (int rc = admin.Call(&v1::Admin::Stub::Status, v1::StatusRequest(), &r); rc != kExitOk) {
    return rc;
  }
  if (o.json) {
    Json poisoned = Json::array();
    for (const std::string& gpu : r.gpu_poisoned()) poisoned.push_back(gpu);
    PrintJson(Json{{"version", r.version()},
                   {"data_dir", r.data_dir()},
                   {"io_backend", r.io_backend()},
                   {"pool_bytes", r.pool_bytes()},
                   {"pool_bytes_in_use", r.pool_bytes_in_use()},
                   {"registered_ranks", r.registered_ranks()},
                   {"jobs", r.jobs()},
                   {"versions_committed", r.versions_committed()},
                   {"bytes_committed", r.bytes_committed()},
                   {"snapshots_skipped", r.snapshots_skipped()},
                   {"write_errors", r.write_errors()},
                   {"uptime_seconds", r.uptime_seconds()},
                   {"orphan_files_quarantined", r.orphan_files_quarantined()},
                   {"files_quarantined", r.files_quarantined()},
                   {"dangling_records_removed", r.dangling_records_removed()},
                   {"temp_files_removed", r.temp_files_removed()},
                   {"metrics_address", r.metrics_address()},
                   {"disk_bytes_used", r.disk_bytes_used()},
                   {"disk_bytes_limit", r.disk_bytes_limit()},
                   {"gpu", r.gpu()},
                   {"open_gpu_mappings", r.open_gpu_mappings()},
                   {"open_gpu_mapping_bytes", r.open_gpu_mapping_bytes()},
                   {"gpu_poisoned", poisoned},
                   {"remote", r.remote()},
                   {"remote_lag_steps", r.remote_lag_steps()},
                   {"remote_lag_bytes", r.remote_lag_bytes()},
                   {"remote_error", r.remote_error()},
                   {"node", r.node()},
                   {"rack", r.rack()},
                   {"peer", r.peer()},
                   {"peer_lag_steps", r.peer_lag_steps()},
                   {"peer_lag_bytes", r.peer_lag_bytes()},
                   {"peer_error", r.peer_error()}});
    return kExitOk;
  }
  std::string in_use = BytesWithRaw(r.pool_bytes_in_use());
  if (r.pool_bytes() > 0) {
    absl::StrAppendFormat(&in_use, ", %.1f%%", 100.0 * r.pool_bytes_in_use() / r.pool_bytes());
  }
  PrintKv({
      {"version", OrDash(r.version())},
      {"data_dir", OrDash(r.data_dir())},
      {"io_backend", OrDash(r.io_backend())},
      {"pool_bytes", BytesWithRaw(r.pool_bytes())},
      {"pool_bytes_in_use", in_use},
      {"registered_ranks", absl::StrCat(r.registered_ranks())},
      {"jobs", absl::StrCat(r.jobs())},
      {"versions_committed", absl::StrCat(r.versions_committed())},
      {"bytes_committed", BytesWithRaw(r.bytes_committed())},
      {"snapshots_skipped", absl::StrCat(r.snapshots_skipped())},
      {"write_errors", absl::StrCat(r.write_errors())},
      {"uptime_seconds",
       absl::StrFormat("%.1f (%s)", r.uptime_seconds(),
                       absl::FormatDuration(absl::Seconds(std::floor(r.uptime_seconds()))))},
      {"orphan_files_quarantined", absl::StrCat(r.orphan_files_quarantined())},
      {"files_quarantined", absl::StrCat(r.files_quarantined())},
      {"dangling_records_removed", absl::StrCat(r.dangling_records_removed())},
      {"temp_files_removed", absl::StrCat(r.temp_files_removed())},
      {"gpu", OrDash(r.gpu())},
      {"open_gpu_mappings",
       absl::StrCat(r.open_gpu_mappings(), " (", BytesWithRaw(r.open_gpu_mapping_bytes()), ")")},
      {"gpu_poisoned", r.gpu_poisoned().empty()
                           ? "-"
                           : absl::StrCat(absl::StrJoin(r.gpu_poisoned(), "; "),
                                          " (restart ckptd to use these GPUs again)")},
      {"metrics_address", r.metrics_address().empty() ? "- (off)" : r.metrics_address()},
      {"disk_bytes_used", BytesWithRaw(r.disk_bytes_used())},
      {"disk_bytes_limit",
       r.disk_bytes_limit() == 0 ? "- (no bound)" : BytesWithRaw(r.disk_bytes_limit())},
      {"remote", OrDash(r.remote())},
      {"remote_lag",
       absl::StrCat(r.remote_lag_steps(), " steps, ", BytesWithRaw(r.remote_lag_bytes()))},
      {"remote_error", r.remote_error().empty() ? "-" : r.remote_error()},
      {"node",
       r.rack().empty() ? OrDash(r.node()) : absl::StrCat(r.node(), " (rack ", r.rack(), ")")},
      {"peer", OrDash(r.peer())},
      {"peer_lag", absl::StrCat(r.peer_lag_steps(), " steps, ", BytesWithRaw(r.peer_lag_bytes()))},
      {"peer_error", r.peer_error().empty() ? "-" : r.peer_error()},
  });
  return kExitOk;
}

int JobsCommand(const Options& o, const AdminConnection& admin) {
  v1::JobsReply r;
  if (int rc = admin.Call(&v1::Admin::Stub::Jobs, v1::JobsRequest(), &r); rc != kExitOk) return rc;
  if (o.json) {
    Json jobs = Json::array();
    for (const v1::JobInfo& j : r.jobs()) {
      Json ranks = Json::array();
      for (const v1::RankInfo& k : j.ranks()) {
        ranks.push_back(Json{{"rank", k.rank()},
                             {"registered", k.registered()},
                             {"stale", k.stale()},
                             {"generation", k.generation()},
                             {"latest_durable_step", k.latest_durable_step()},
                             {"last_step_seen", k.last_step_seen()},
                             {"agreed_step", k.agreed_step()},
                             {"remote_step", k.remote_step()},
                             {"peer_step", k.peer_step()},
                             {"layers", k.layers()}});
      }
      Json peers = Json::array();
      for (const std::string& n : j.peer_nodes()) peers.push_back(n);
      jobs.push_back(Json{{"job_id", j.job_id()},
                          {"owner_uid", j.owner_uid()},
                          {"versions", j.versions()},
                          {"bytes", j.bytes()},
                          {"peer_nodes", std::move(peers)},
                          {"ranks", std::move(ranks)}});
    }
    PrintJson(Json{{"jobs", std::move(jobs)}});
    return kExitOk;
  }
  if (r.jobs().empty()) {
    std::printf("no jobs\n");
    return kExitOk;
  }
  Table t({"JOB", "OWNER", "RANKS", "REGISTERED", "STALE", "LATEST STEP", "AGREED STEP",
           "REMOTE STEP", "PEER STEP", "VERSIONS", "BYTES", "PEERS"},
          {false, true, true, true, true, true, true, true, true, true, true, false});
  for (const v1::JobInfo& j : r.jobs()) {
    // The job-wide latest step: the range over its ranks when they differ.
    uint64_t lo = UINT64_MAX, hi = 0, agreed = 0, remote = UINT64_MAX, peer = UINT64_MAX;
    int registered = 0, stale = 0;
    for (const v1::RankInfo& k : j.ranks()) {
      agreed = std::max(agreed, k.agreed_step());  // the newest agreement any rank reported
      remote = std::min(remote, k.remote_step());  // the step every rank has remotely
      peer = std::min(peer, k.peer_step());
      stale += k.stale() ? 1 : 0;
      lo = std::min(lo, k.latest_durable_step());
      hi = std::max(hi, k.latest_durable_step());
      registered += k.registered() ? 1 : 0;
    }
    std::string latest = j.ranks().empty() ? "-"
                         : lo == hi        ? StepOrDash(lo)
                                           : absl::StrCat(StepOrDash(lo), "..", hi);
    t.Add({j.job_id(), absl::StrCat(j.owner_uid()), absl::StrCat(j.ranks_size()),
           absl::StrCat(registered), absl::StrCat(stale), latest, StepOrDash(agreed),
           StepOrDash(j.ranks().empty() ? 0 : remote), StepOrDash(j.ranks().empty() ? 0 : peer),
           absl::StrCat(j.versions()), HumanBytes(j.bytes()),
           j.peer_nodes().empty() ? "-" : absl::StrJoin(j.peer_nodes(), ",")});
  }
  t.Print();
  return kExitOk;
}

int LayersCommand(const Options& o, const AdminConnection& admin) {
  v1::LayersRequest req;
  req.set_job_id(o.positional[0]);
  req.set_rank(o.rank.value_or(0));
  v1::LayersReply r;
  if (int rc = admin.Call(&v1::Admin::Stub::Layers, req, &r); rc != kExitOk) return rc;
  const bool live_drift = r.s_max() > 0;  // a live layercheck registration
  if (o.json) {
    Json layers = Json::array();
    for (const v1::LayerInfo& l : r.layers()) {
      Json j{{"layer", l.layer()},       {"name", l.name()},           {"kind", KindName(l.kind())},
             {"bytes", l.bytes()},       {"last_step", l.last_step()}, {"staleness", l.staleness()},
             {"versions", l.versions()}, {"frozen", l.frozen()}};
      if (l.live()) {
        j["accumulated_drift"] = l.accumulated_drift();
        j["threshold"] = l.threshold();
        j["last_drift"] = l.last_drift();
      }
      layers.push_back(std::move(j));
    }
    Json out{{"job_id", r.job_id()},
             {"rank", r.rank()},
             {"latest_durable_step", r.latest_durable_step()},
             {"newest_staged_step", r.newest_staged_step()},
             {"policy", r.policy()},
             {"layers", std::move(layers)}};
    if (live_drift) out["s_max"] = r.s_max();
    PrintJson(out);
    return kExitOk;
  }
  // Steps ckptd copied and is still writing (also after their trainer
  // died): a restore now waits for them.
  const std::string staged =
      r.newest_staged_step() > r.latest_durable_step()
          ? absl::StrCat(" (steps up to ", r.newest_staged_step(),
                         " are staged in ckptd's memory and being written; a restore waits "
                         "for them)")
          : std::string();
  std::printf("job %s rank %u: latest durable step %s%s%s\n", TerminalSafe(r.job_id()).c_str(),
              r.rank(),
              r.latest_durable_step() == 0 ? "- (no history)"
                                           : absl::StrCat(r.latest_durable_step()).c_str(),
              staged.c_str(),
              r.policy().empty()
                  ? ", not registered"
                  : absl::StrCat(", policy ", TerminalSafe(r.policy()),
                                 live_drift ? absl::StrCat(", S_max ", r.s_max()) : std::string())
                        .c_str());
  std::vector<std::string> head = {"LAYER",     "NAME",      "KIND",    "BYTES",
                                   "LAST STEP", "STALENESS", "VERSIONS"};
  std::vector<bool> right = {true, false, false, true, true, true, true};
  if (live_drift) {
    for (const char* h : {"DRIFT", "ACC DRIFT", "THRESHOLD"}) {
      head.push_back(h);
      right.push_back(true);
    }
  }
  Table t(head, right);
  for (const v1::LayerInfo& l : r.layers()) {
    bool never = l.last_step() == 0;
    const std::string kind =
        l.frozen() ? absl::StrCat(KindName(l.kind()), " (frozen)") : KindName(l.kind());
    std::vector<std::string> row = {absl::StrCat(l.layer()),
                                    OrDash(l.name()),
                                    kind,
                                    HumanBytes(l.bytes()),
                                    StepOrDash(l.last_step()),
                                    never ? "-" : absl::StrCat(l.staleness()),
                                    absl::StrCat(l.versions())};
    if (live_drift) {
      row.push_back(absl::StrFormat("%.2e", l.last_drift()));
      row.push_back(absl::StrFormat("%.2e", l.accumulated_drift()));
      row.push_back(absl::StrFormat("%.2e", l.threshold()));
    }
    t.Add(row);
  }
  t.Print();
  return kExitOk;
}

int ConfigCommand(const Options& o, const AdminConnection& admin) {
  v1::ConfigReply r;
  if (int rc = admin.Call(&v1::Admin::Stub::Config, v1::ConfigRequest(), &r); rc != kExitOk) {
    return rc;
  }
  if (o.json) {
    Json j = Json::object();
    for (absl::string_view line : absl::StrSplit(r.text(), '\n')) {
      line = absl::StripAsciiWhitespace(line);
      if (line.empty() || line[0] == '#') continue;
      auto eq = line.find('=');
      if (eq == absl::string_view::npos) continue;
      const std::string key(absl::StripAsciiWhitespace(line.substr(0, eq)));
      const std::string value(absl::StripAsciiWhitespace(line.substr(eq + 1)));
      // Numbers and booleans as JSON numbers and booleans, the rest as text.
      uint64_t number;
      if (absl::SimpleAtoi(value, &number)) {
        j[key] = number;
      } else if (value == "true" || value == "false") {
        j[key] = value == "true";
      } else {
        j[key] = value;
      }
    }
    PrintJson(j);
  } else {
    // Line by line: the file's own newlines stay, anything else is escaped.
    std::vector<absl::string_view> lines = absl::StrSplit(r.text(), '\n');
    if (!lines.empty() && lines.back().empty()) lines.pop_back();
    for (absl::string_view line : lines) std::printf("%s\n", TerminalSafe(line).c_str());
  }
  return kExitOk;
}

int VerifyCommand(const Options& o, const AdminConnection& admin) {
  v1::VerifyRequest req;
  req.set_job_id(o.positional[0]);
  req.set_rank(o.rank.has_value() ? static_cast<int64_t>(*o.rank) : -1);
  req.set_deep(o.deep);
  v1::VerifyReply r;
  if (int rc = admin.Call(&v1::Admin::Stub::Verify, req, &r); rc != kExitOk) return rc;
  if (o.json) {
    Json failures = Json::array();
    for (const v1::VerifyFailure& f : r.failures()) {
      failures.push_back(
          Json{{"rank", f.rank()}, {"layer", f.layer()}, {"step", f.step()}, {"error", f.error()}});
    }
    PrintJson(Json{{"versions_checked", r.versions_checked()},
                   {"bytes_checked", r.bytes_checked()},
                   {"seconds", r.seconds()},
                   {"failures", std::move(failures)}});
  } else {
    PrintKv({
        {"versions checked", absl::StrCat(r.versions_checked())},
        {"bytes checked", BytesWithRaw(r.bytes_checked())},
        {"seconds", absl::StrFormat("%.3f", r.seconds())},
        {"failures", absl::StrCat(r.failures_size())},
    });
    if (r.failures_size() > 0) {
      std::printf("\n");
      Table t({"RANK", "LAYER", "STEP", "ERROR"}, {true, true, true, false});
      for (const v1::VerifyFailure& f : r.failures()) {
        t.Add({absl::StrCat(f.rank()), absl::StrCat(f.layer()), absl::StrCat(f.step()), f.error()});
      }
      t.Print();
    }
  }
  return r.failures_size() > 0 ? kExitCorrupt : kExitOk;
}

}  // namespace ckpt::ctl
