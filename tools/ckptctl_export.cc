// ckptctl export and restore (ckptctl_commands.h): the composite checkpoint
// of each rank, streamed from ckptd, written as DIR/rank-NNNNN.safetensors
// (tools/export_writer.h) plus DIR/manifest.json with each rank's plan. In
// order: the ranks, every rank's plan (a refusal leaves nothing behind), the
// output directory, one stream per rank, the manifest.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "base/unique_fd.h"
#include "tools/ckptctl_commands.h"
#include "tools/ckptctl_output.h"
#include "tools/export_writer.h"
#include "tools/terminal_text.h"

namespace ckpt::ctl {
namespace {

// The ranks to write: --rank (restore: default 0), else every rank ckptd
// knows of the job.
int RanksToExport(const Options& o, const AdminConnection& admin, bool one_rank,
                  std::vector<uint32_t>* ranks) {
  const std::string& job = o.positional[0];
  if (one_rank || o.rank.has_value()) {
    ranks->push_back(o.rank.value_or(0));
    return kExitOk;
  }
  v1::JobsReply jobs;
  if (int rc = admin.Call(&v1::Admin::Stub::Jobs, v1::JobsRequest(), &jobs); rc != kExitOk) {
    return rc;
  }
  for (const v1::JobInfo& j : jobs.jobs()) {
    if (j.job_id() != job) continue;
    for (const v1::RankInfo& ri : j.ranks()) ranks->push_back(ri.rank());
  }
  if (ranks->empty()) {
    std::fprintf(stderr, "ckptctl: NOT_FOUND: job %s does not exist\n", TerminalSafe(job).c_str());
    return kExitDaemonError;
  }
  return kExitOk;
}

// Every rank's plan first: a refusal (another user's job, no checkpoint
// at that step) leaves nothing behind, not even the output directory.
int CheckPlans(const Options& o, const AdminConnection& admin, const std::vector<uint32_t>& ranks) {
  for (uint32_t rank : ranks) {
    v1::PlanRequest req;
    req.set_job_id(o.positional[0]);
    req.set_rank(rank);
    req.set_target_step(o.step.value_or(0));
    req.set_older_within_steps(o.older_within.value_or(0));
    v1::Plan plan;
    if (int rc = admin.Call(&v1::Admin::Stub::Plan, req, &plan); rc != kExitOk) return rc;
  }
  return kExitOk;
}

// The output directory, walked one component at a time from / (or the
// working directory): each is opened without following a symbolic link and
// created private (0700) when missing. A link anywhere in the path is
// refused, naming it: root's `export --out=link/sub` once followed a link
// another user controlled. Every file is then created beneath the opened
// directory (export_writer.h), so links planted in it are never followed
// either.
int OpenOutputDir(const Options& o, UniqueFd* dir) {
  const std::string& path = o.out;
  UniqueFd at(
      ::open(!path.empty() && path[0] == '/' ? "/" : ".", O_DIRECTORY | O_RDONLY | O_CLOEXEC));
  if (!at.valid()) {
    std::fprintf(stderr, "ckptctl: cannot open the start of %s: %s\n", TerminalSafe(path).c_str(),
                 std::strerror(errno));
    return kExitLocalError;
  }
  std::string walked = path[0] == '/' ? "" : ".";
  for (absl::string_view part : absl::StrSplit(path, '/', absl::SkipEmpty())) {
    const std::string name(part);
    walked += "/" + name;
    if (::mkdirat(at.get(), name.c_str(), 0700) != 0 && errno != EEXIST) {
      std::fprintf(stderr, "ckptctl: cannot create %s: %s\n", TerminalSafe(walked).c_str(),
                   std::strerror(errno));
      return kExitLocalError;
    }
    UniqueFd next(
        ::openat(at.get(), name.c_str(), O_DIRECTORY | O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
    if (!next.valid()) {
      struct stat st;
      const bool link =
          errno == ELOOP ||
          (::fstatat(at.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK(st.st_mode));
      std::fprintf(stderr, "ckptctl: cannot open %s as a directory: %s\n",
                   TerminalSafe(walked).c_str(),
                   link ? "it is a symbolic link, which export does not follow (give the path "
                          "it resolves to)"
                        : std::strerror(errno));
      return kExitLocalError;
    }
    at = std::move(next);
  }
  *dir = std::move(at);
  return kExitOk;
}

// Streams one rank's checkpoint into dir_fd/rank-NNNNN.safetensors, with a
// progress bar on stderr when `bar`, and adds its entry to the manifest.
int ExportRank(const Options& o, const AdminConnection& admin, int dir_fd, uint32_t rank, bool bar,
               Json* manifest) {
  v1::ExportRequest req;
  req.set_job_id(o.positional[0]);
  req.set_rank(rank);
  req.set_target_step(o.step.value_or(0));
  req.set_older_within_steps(o.older_within.value_or(0));
  grpc::ClientContext ctx;
  ctx.set_deadline(
      std::chrono::system_clock::now() +
      std::chrono::microseconds(static_cast<int64_t>(std::max(o.timeout_seconds, 3600.0) * 1e6)));
  std::unique_ptr<grpc::ClientReader<v1::ExportChunk>> reader = admin.stub()->Export(&ctx, req);
  const std::string file = absl::StrFormat("rank-%05u.safetensors", rank);
  auto progress = [&](uint64_t done, uint64_t total) {
    if (!bar) return;
    const int w = 40, filled = total ? static_cast<int>(w * done / total) : w;
    std::fprintf(stderr, "\r%s [%s%s] %3d%%", file.c_str(), std::string(filled, '#').c_str(),
                 std::string(w - filled, ' ').c_str(),
                 total ? static_cast<int>(100 * done / total) : 100);
  };
  absl::StatusOr<Json> entry = ckpt::WriteSafetensors(
      [&](v1::ExportChunk* c) { return reader->Read(c); }, dir_fd, file, progress);
  if (bar) std::fprintf(stderr, "\n");
  if (!entry.ok()) ctx.TryCancel();  // stop the stream; the file is gone already
  grpc::Status s = reader->Finish();
  if (!entry.ok()) {
    std::fprintf(stderr, "ckptctl: %s\n", TerminalSafe(entry.status().ToString()).c_str());
    // The stream itself (DATA_LOSS) or a refused table is the daemon's
    // side; anything else is the local file system.
    return absl::IsDataLoss(entry.status()) || absl::IsInvalidArgument(entry.status())
               ? kExitDaemonError
               : kExitLocalError;
  }
  if (!s.ok()) return admin.Report(s);
  (*entry)["file"] = file;
  (*manifest)["ranks"].push_back(*entry);
  if (!o.json) {
    std::printf("rank %u: step %lu, %s -> %s/%s\n", rank,
                static_cast<unsigned long>((*entry)["target_step"].get<uint64_t>()),
                HumanBytes((*entry)["bytes"].get<uint64_t>()).c_str(), TerminalSafe(o.out).c_str(),
                file.c_str());
  }
  return kExitOk;
}

}  // namespace

int ExportCommand(const Options& o, const AdminConnection& admin, bool one_rank) {
  std::vector<uint32_t> ranks;
  if (int rc = RanksToExport(o, admin, one_rank, &ranks); rc != kExitOk) return rc;
  if (int rc = CheckPlans(o, admin, ranks); rc != kExitOk) return rc;
  UniqueFd dir;
  if (int rc = OpenOutputDir(o, &dir); rc != kExitOk) return rc;
  Json manifest{
      {"format", "ckptd-export-v1"}, {"job_id", o.positional[0]}, {"ranks", Json::array()}};
  const bool bar = !o.json && ::isatty(2);
  for (uint32_t rank : ranks) {
    if (int rc = ExportRank(o, admin, dir.get(), rank, bar, &manifest); rc != kExitOk) return rc;
  }
  if (absl::Status w =
          ckpt::WriteFileBeneath(dir.get(), "manifest.json", JsonText(manifest) + "\n");
      !w.ok()) {
    std::fprintf(stderr, "ckptctl: %s/manifest.json: %s\n", TerminalSafe(o.out).c_str(),
                 TerminalSafe(w.message()).c_str());
    return kExitLocalError;
  }
  if (o.json) PrintJson(manifest);
  return kExitOk;
}

}  // namespace ckpt::ctl
