// libFuzzer target: the RocksDB index (daemon/store/index.h) read back from
// arbitrary contents, and the logic that consumes it (parser fuzzing in docs/reliability.md).
//
// Each input describes a list of index entries: keys that are well-formed
// (m/generation, j/, r/, v/, e/ with the documented fixed-width hex fields),
// well-formed prefixes with mangled number fields (upper case, wrong width,
// "+", "0x"), or raw bytes; values that are valid serialized records built
// from the input or raw bytes. They are written with a raw RocksDB handle —
// what a corrupt or foreign writer could leave — then the database is opened
// through Index and every reader runs: NextGeneration, jobs, ranks, versions
// and events (point lookups and scans), BuildPlan, PlanRetention over what the
// scans return (as the engine's GC does) and, on some inputs, LayerStore's
// start-up Reconcile over a data directory holding some of the named files.
//
// Oracles (a model of the index rebuilt from the scans):
//   - readers fail only with DATA_LOSS (BuildPlan also NOT_FOUND);
//   - scans return strictly ordered keys, the newest-first event scan is the
//     reverse of the oldest-first one;
//   - VersionAtOrBefore / EventAtOrBefore return the newest entry with step
//     <= the bound among those the scans return, never a later one;
//   - a plan's steps are <= its target, staleness = target - step, complete
//     iff every layer has a version, max/size-weighted staleness consistent;
//   - retention keeps the latest event, never deletes a version above it, and
//     keeps for every retained target each layer's newest version <= it;
//   - NextGeneration never hands out the same number twice;
//   - after Reconcile, no temp file is left, every surviving version record
//     is <= the rank's last event and names a file of its recorded size.
// File operations go through a FileSystem that refuses names which are not a
// single path component, so a corrupt record can never make the fuzzer touch
// anything outside its temp directory.
#include <fcntl.h>
#include <fuzzer/FuzzedDataProvider.h>
#include <rocksdb/db.h>
#include <rocksdb/options.h>
#include <rocksdb/write_batch.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "base/status.h"
#include "daemon/common/validate.h"
#include "daemon/io/file_system.h"
#include "daemon/recovery/plan.h"
#include "daemon/store/index.h"
#include "daemon/store/layer_store.h"
#include "daemon/store/retention.h"
#include "tests/fuzz/fuzz_util.h"

namespace ckpt {
namespace {

// The temp directory of this process (removed at exit). Heap-allocated and
// never freed: the exit handler runs after static destructors.
const std::string& Root() {
  static const std::string* root = [] {
    const char* tmp = std::getenv("TMPDIR");
    std::string base = (tmp != nullptr && *tmp != '\0') ? tmp : "/tmp";
    if (access("/dev/shm", W_OK) == 0) base = "/dev/shm";  // see the sync stubs below
    std::string templ = base + "/ckpt-index-fuzz-XXXXXX";
    CKPT_FUZZ_CHECK(mkdtemp(templ.data()) != nullptr, "mkdtemp " + templ);
    auto* r = new std::string(templ);
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(Root(), ec);
    });
    return r;
  }();
  return *root;
}

bool PlainName(const std::string& name) {
  return !name.empty() && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos && name != "." && name != "..";
}

// Refuses every name that is not a single path component (see the header).
class SandboxFs : public FileSystem {
 public:
  absl::StatusOr<UniqueFd> OpenSubdir(int dir_fd, const std::string& name, bool create) override {
    CKPT_RETURN_IF_ERROR(Check(name));
    return FileSystem::OpenSubdir(dir_fd, name, create);
  }
  absl::StatusOr<UniqueFd> CreateExclusive(int dir_fd, const std::string& name, bool direct,
                                           bool* direct_used) override {
    CKPT_RETURN_IF_ERROR(Check(name));
    return FileSystem::CreateExclusive(dir_fd, name, direct, direct_used);
  }
  absl::StatusOr<UniqueFd> OpenForRead(int dir_fd, const std::string& name, bool direct,
                                       bool* direct_used) override {
    CKPT_RETURN_IF_ERROR(Check(name));
    return FileSystem::OpenForRead(dir_fd, name, direct, direct_used);
  }
  absl::Status RenameNoReplace(int dir_fd, const std::string& from,
                               const std::string& to) override {
    CKPT_RETURN_IF_ERROR(Check(from));
    CKPT_RETURN_IF_ERROR(Check(to));
    return FileSystem::RenameNoReplace(dir_fd, from, to);
  }
  absl::Status Unlink(int dir_fd, const std::string& name) override {
    CKPT_RETURN_IF_ERROR(Check(name));
    return FileSystem::Unlink(dir_fd, name);
  }
  absl::Status RemoveDir(int dir_fd, const std::string& name) override {
    CKPT_RETURN_IF_ERROR(Check(name));
    return FileSystem::RemoveDir(dir_fd, name);
  }
  absl::StatusOr<uint64_t> FileSizeAt(int dir_fd, const std::string& name) override {
    CKPT_RETURN_IF_ERROR(Check(name));
    return FileSystem::FileSizeAt(dir_fd, name);
  }

 private:
  static absl::Status Check(const std::string& name) {
    if (PlainName(name)) return absl::OkStatus();
    return absl::InvalidArgumentError("fuzz sandbox: not a single path component");
  }
};

const char* const kJobs[] = {"job", "job2", "j"};

// Builds keys and values from the fuzz input.
class Gen {
 public:
  explicit Gen(FuzzedDataProvider* p) : p_(*p) {}

  std::string Job() {
    const int k = p_.ConsumeIntegralInRange<int>(0, 4);
    if (k < 3) return kJobs[k];
    return p_.ConsumeRandomLengthString(12);
  }
  uint64_t Small(uint64_t max) { return p_.ConsumeIntegralInRange<uint64_t>(0, max); }
  uint64_t Step() {
    switch (p_.ConsumeIntegralInRange<int>(0, 3)) {
      case 0:
        return Small(12);
      case 1:
        return Small(2000);
      case 2:
        return ~uint64_t{0} - Small(2);
      default:
        return p_.ConsumeIntegral<uint64_t>();
    }
  }
  uint32_t Rank() {
    return p_.ConsumeBool() ? static_cast<uint32_t>(Small(2)) : p_.ConsumeIntegral<uint32_t>();
  }
  // A number field of `width` hex digits, usually well-formed.
  std::string Num(uint64_t v, int width) {
    switch (p_.ConsumeIntegralInRange<int>(0, 9)) {
      case 0:
        return absl::StrFormat("%0*X", width, v);  // upper case
      case 1:
        return absl::StrFormat("%0*x", width + 1, v);  // too wide
      case 2:
        return absl::StrFormat("%x", v);  // unpadded
      case 3:
        return "+" +
               absl::StrFormat("%0*x", width - 1, v & ((uint64_t{1} << (4 * (width - 1))) - 1));
      case 4:
        return "0x" +
               absl::StrFormat("%0*x", width - 2, v & ((uint64_t{1} << (4 * (width - 2))) - 1));
      case 5:
        return p_.ConsumeBytesAsString(static_cast<size_t>(width));
      default:
        return absl::StrFormat("%0*x", width, v);
    }
  }

  store::VersionRecord Version() {
    store::VersionRecord r;
    r.set_file(p_.ConsumeBool()
                   ? absl::StrFormat("L%08x-S%016x-G%016x.ckv", Small(3), Step(), Small(9))
                   : p_.ConsumeRandomLengthString(40));
    r.set_file_bytes(p_.ConsumeBool() ? 4096 * Small(3) : p_.ConsumeIntegral<uint64_t>());
    r.set_payload_bytes(p_.ConsumeBool() ? Small(1 << 20) : p_.ConsumeIntegral<uint64_t>());
    r.set_header_xxh3(p_.ConsumeIntegral<uint64_t>());
    r.set_generation(Small(9));
    for (uint64_t g = Small(2); g > 0; --g) {
      store::GroupStep* gs = r.add_group_steps();
      gs->set_group(static_cast<uint32_t>(Small(3)));
      gs->set_step(Step());
    }
    r.set_committed_unix_ms(p_.ConsumeIntegral<int64_t>());
    return r;
  }
  store::EventRecord Event() {
    store::EventRecord e;
    for (uint64_t n = Small(3); n > 0; --n) e.add_layers(static_cast<uint32_t>(Small(5)));
    e.set_bytes(p_.ConsumeIntegral<uint64_t>());
    e.set_failed(static_cast<uint32_t>(Small(2)));
    e.set_skipped(static_cast<uint32_t>(Small(2)));
    e.set_aux(p_.ConsumeRandomLengthString(16));
    e.set_lr(p_.ConsumeFloatingPoint<double>());
    e.set_unix_ms(p_.ConsumeBool() ? 1700000000000 + static_cast<int64_t>(Small(1 << 30))
                                   : p_.ConsumeIntegral<int64_t>());
    return e;
  }
  store::RankRecord RankRec() {
    store::RankRecord r;
    const uint64_t layers = Small(5);
    for (uint64_t l = 0; l < layers; ++l) {
      store::LayerSpec* ls = r.add_layers();
      ls->set_id(p_.ConsumeIntegralInRange<int>(0, 7) == 0 ? static_cast<uint32_t>(Small(9))
                                                           : static_cast<uint32_t>(l));
      ls->set_name(absl::StrCat("layer", l));
      for (uint64_t t = 1 + Small(1); t > 0; --t) {
        store::TensorSpec* ts = ls->add_tensors();
        ts->set_name(absl::StrCat("t", t));
        ts->set_dtype(store::DTYPE_F32);
        ts->set_nbytes(4 * (1 + Small(100)));
      }
    }
    r.set_world_size(static_cast<uint32_t>(1 + Small(3)));
    r.set_generation(Small(9));
    return r;
  }
  template <typename Msg>
  std::string Value(Msg (Gen::*make)()) {
    if (p_.ConsumeIntegralInRange<int>(0, 5) == 0) return p_.ConsumeRandomLengthString(32);
    return (this->*make)().SerializeAsString();
  }

  // One entry; `entries` may receive several (a version and its event).
  void Entry(std::vector<std::pair<std::string, std::string>>* entries) {
    switch (p_.ConsumeIntegralInRange<int>(0, 9)) {
      case 0:
        entries->emplace_back("m/generation", p_.ConsumeBool() ? absl::StrCat(Step())
                                                               : p_.ConsumeRandomLengthString(24));
        return;
      case 1: {
        store::JobRecord j;
        j.set_owner_uid(p_.ConsumeIntegral<uint32_t>());
        entries->emplace_back(absl::StrCat("j/", Job()), p_.ConsumeBool()
                                                             ? j.SerializeAsString()
                                                             : p_.ConsumeRandomLengthString(16));
        return;
      }
      case 2: {
        const std::string job = Job();
        entries->emplace_back(absl::StrCat("r/", job, "/", Num(Rank(), 8)), Value(&Gen::RankRec));
        return;
      }
      case 3:
      case 4:
      case 5: {
        const std::string job = Job();
        const uint32_t rank = Rank();
        entries->emplace_back(
            absl::StrCat("v/", job, "/", Num(rank, 8), "/", Num(Small(4), 8), "/", Num(Step(), 16)),
            Value(&Gen::Version));
        return;
      }
      case 6:
      case 7: {
        const std::string job = Job();
        entries->emplace_back(absl::StrCat("e/", job, "/", Num(Rank(), 8), "/", Num(Step(), 16)),
                              Value(&Gen::Event));
        return;
      }
      case 8: {
        static const char* const kPrefixes[] = {"v/",
                                                "e/",
                                                "r/",
                                                "j/",
                                                "m/",
                                                "v/job/00000000/",
                                                "e/job/00000000/",
                                                "v/job/00000000/00000000/"};
        entries->emplace_back(absl::StrCat(kPrefixes[Small(7)], p_.ConsumeRandomLengthString(32)),
                              p_.ConsumeRandomLengthString(32));
        return;
      }
      default:
        entries->emplace_back(p_.ConsumeRandomLengthString(40), p_.ConsumeRandomLengthString(32));
        return;
    }
  }

 private:
  FuzzedDataProvider& p_;
};

void CheckCode(const absl::Status& s, const std::string& what, bool not_found_ok = false) {
  CKPT_FUZZ_CHECK(s.ok() || absl::IsDataLoss(s) || (not_found_ok && absl::IsNotFound(s)),
                  what + " returned " + s.ToString());
}

// What the scans of one rank returned.
struct RankModel {
  std::vector<std::pair<uint64_t, int64_t>> events;    // (step, unix_ms), ascending
  std::map<uint32_t, std::vector<uint64_t>> versions;  // layer -> ascending steps
  std::map<std::pair<uint32_t, uint64_t>, store::VersionRecord> records;
  bool events_ok = false;
  bool versions_ok = false;
};

RankModel ScanRank(Index* index, const std::string& job, uint32_t rank) {
  RankModel m;
  const std::string where = absl::StrCat(job, "/", rank);
  absl::Status s =
      index->ForEachEvent(job, rank, false, [&](uint64_t step, const store::EventRecord& e) {
        CKPT_FUZZ_CHECK(m.events.empty() || m.events.back().first < step,
                        "events out of order " + where);
        m.events.emplace_back(step, e.unix_ms());
        return true;
      });
  CheckCode(s, "ForEachEvent " + where);
  m.events_ok = s.ok();
  std::vector<uint64_t> newest_first;
  s = index->ForEachEvent(job, rank, true, [&](uint64_t step, const store::EventRecord&) {
    newest_first.push_back(step);
    return true;
  });
  CheckCode(s, "ForEachEvent newest first " + where);
  if (s.ok() && m.events_ok) {
    CKPT_FUZZ_CHECK(newest_first.size() == m.events.size(), "event scans disagree " + where);
    for (size_t i = 0; i < newest_first.size(); ++i) {
      CKPT_FUZZ_CHECK(newest_first[i] == m.events[m.events.size() - 1 - i].first,
                      "event scans disagree " + where);
    }
  }
  std::optional<std::pair<uint32_t, uint64_t>> prev;
  s = index->ForEachVersion(
      job, rank, -1, [&](const VersionKey& k, const store::VersionRecord& rec) {
        CKPT_FUZZ_CHECK(k.job == job && k.rank == rank, "version of another rank " + where);
        const auto lk = std::make_pair(k.layer, k.step);
        CKPT_FUZZ_CHECK(!prev.has_value() || *prev < lk, "versions out of order " + where);
        prev = lk;
        m.versions[k.layer].push_back(k.step);
        m.records[lk] = rec;
        return true;
      });
  CheckCode(s, "ForEachVersion " + where);
  m.versions_ok = s.ok();
  if (m.versions_ok) {
    for (const auto& entry : m.versions) {
      const uint32_t layer = entry.first;
      const std::vector<uint64_t>& steps = entry.second;
      std::vector<uint64_t> one;
      absl::Status s1 = index->ForEachVersion(
          job, rank, layer, [&](const VersionKey& k, const store::VersionRecord&) {
            CKPT_FUZZ_CHECK(k.layer == layer, "layer scan returned another layer " + where);
            one.push_back(k.step);
            return true;
          });
      CKPT_FUZZ_CHECK(s1.ok() && one == steps, "layer scan disagrees with the rank scan " + where);
    }
  }
  return m;
}

// Newest step <= bound in an ascending list.
std::optional<uint64_t> AtOrBefore(const std::vector<uint64_t>& steps, uint64_t bound) {
  auto it = std::upper_bound(steps.begin(), steps.end(), bound);
  if (it == steps.begin()) return std::nullopt;
  return *(it - 1);
}

void CheckLookups(Index* index, const std::string& job, uint32_t rank, const RankModel& m,
                  const std::vector<uint64_t>& bounds) {
  const std::string where = absl::StrCat(job, "/", rank);
  if (m.events_ok) {
    std::vector<uint64_t> steps;
    for (const auto& e : m.events) steps.push_back(e.first);
    for (uint64_t b : bounds) {
      auto got = index->EventAtOrBefore(job, rank, b);
      CheckCode(got.status(), "EventAtOrBefore " + where);
      if (!got.ok()) continue;
      std::optional<uint64_t> want = AtOrBefore(steps, b);
      CKPT_FUZZ_CHECK(got->has_value() == want.has_value() && (!want || (*got)->first == *want),
                      absl::StrCat("EventAtOrBefore(", b, ") ", where, " returned ",
                                   got->has_value() ? absl::StrCat((*got)->first) : "none",
                                   ", want ", want ? absl::StrCat(*want) : "none"));
    }
  }
  if (m.versions_ok) {
    std::set<uint32_t> layers{0, 1};
    for (const auto& [l, s] : m.versions) layers.insert(l);
    for (uint32_t layer : layers) {
      auto it = m.versions.find(layer);
      const std::vector<uint64_t> none;
      const std::vector<uint64_t>& steps = it == m.versions.end() ? none : it->second;
      for (uint64_t b : bounds) {
        auto got = index->VersionAtOrBefore(job, rank, layer, b);
        CheckCode(got.status(), "VersionAtOrBefore " + where);
        if (!got.ok()) continue;
        std::optional<uint64_t> want = AtOrBefore(steps, b);
        CKPT_FUZZ_CHECK(
            got->has_value() == want.has_value() && (!want || (*got)->first == *want),
            absl::StrCat("VersionAtOrBefore(layer ", layer, ", ", b, ") ", where, " returned ",
                         got->has_value() ? absl::StrCat((*got)->first) : "none", ", want ",
                         want ? absl::StrCat(*want) : "none"));
      }
    }
  }
}

void CheckPlan(Index* index, const std::string& job, uint32_t rank, uint64_t target,
               const store::RankRecord& table, const RankModel& m) {
  const std::string where = absl::StrCat(job, "/", rank, " target ", target);
  absl::StatusOr<CompositePlan> plan = BuildPlan(index, job, rank, target, table);
  CheckCode(plan.status(), "BuildPlan " + where, /*not_found_ok=*/true);
  if (!plan.ok()) return;
  const uint64_t tau = plan->target_step;
  if (target != 0) CKPT_FUZZ_CHECK(tau == target, "plan for another step " + where);
  if (m.events_ok) {
    CKPT_FUZZ_CHECK(
        std::any_of(m.events.begin(), m.events.end(), [&](auto& e) { return e.first == tau; }),
        "plan targets a step without an event " + where);
  }
  CKPT_FUZZ_CHECK(plan->layers.size() == static_cast<size_t>(table.layers_size()),
                  "plan layer count " + where);
  bool complete = true;
  uint64_t max_staleness = 0;
  for (const PlannedLayer& lp : plan->layers) {
    if (!lp.has_version) {
      complete = false;
      continue;
    }
    CKPT_FUZZ_CHECK(lp.step <= tau, absl::StrCat("layer ", lp.layer, " step ", lp.step,
                                                 " is after the target ", tau, " ", where));
    CKPT_FUZZ_CHECK(lp.staleness == tau - lp.step, "staleness " + where);
    max_staleness = std::max(max_staleness, lp.staleness);
    if (m.versions_ok) {
      auto it = m.versions.find(lp.layer);
      CKPT_FUZZ_CHECK(it != m.versions.end() && AtOrBefore(it->second, tau) == lp.step,
                      "plan picked a version that is not the layer's newest <= target " + where);
    }
  }
  CKPT_FUZZ_CHECK(plan->complete == complete, "plan completeness " + where);
  CKPT_FUZZ_CHECK(plan->max_staleness == max_staleness, "max staleness " + where);
  const double w = plan->size_weighted_staleness;
  CKPT_FUZZ_CHECK(
      std::isfinite(w) && w >= 0 && w <= static_cast<double>(max_staleness) * (1 + 1e-9) + 1e-9,
      absl::StrCat("size-weighted staleness ", w, " outside [0, ", max_staleness, "] ", where));
}

void CheckRetention(const RankModel& m, const RetentionPolicy& policy, int64_t now_ms) {
  if (!m.events_ok || !m.versions_ok) return;
  RetentionInput in;
  in.events = m.events;
  in.versions = m.versions;
  in.now_unix_ms = now_ms;
  const RetentionPlan plan = PlanRetention(policy, in);
  if (m.events.empty()) {
    CKPT_FUZZ_CHECK(plan.delete_events.empty() && plan.delete_versions.empty(),
                    "retention deletes without any event");
    return;
  }
  const uint64_t latest = m.events.back().first;
  CKPT_FUZZ_CHECK(!plan.retained_targets.empty() && plan.retained_targets.back() == latest,
                  "retention drops the latest event");
  CKPT_FUZZ_CHECK(plan.retained_targets.size() + plan.delete_events.size() == m.events.size(),
                  "retention loses events");
  if (policy.keep_last_events > 0) {
    CKPT_FUZZ_CHECK(plan.retained_targets.size() >=
                        std::min<uint64_t>(policy.keep_last_events, m.events.size()),
                    "retention keeps fewer than keep_last_events");
  }
  if (policy.keep_hours > 0) {
    // Age rule: an event whose age is below keep_hours is retained.
    for (const auto& [step, ms] : m.events) {
      const bool young =
          static_cast<__int128>(now_ms) - ms <= static_cast<__int128>(policy.keep_hours) * 3600000;
      if (young) {
        CKPT_FUZZ_CHECK(
            std::binary_search(plan.retained_targets.begin(), plan.retained_targets.end(), step),
            absl::StrCat("event ", step, " younger than keep_hours was not retained"));
      }
    }
  }
  std::set<std::pair<uint32_t, uint64_t>> deleted(plan.delete_versions.begin(),
                                                  plan.delete_versions.end());
  size_t total = 0;
  for (const auto& [layer, steps] : m.versions) {
    total += steps.size();
    for (uint64_t s : steps) {
      if (s > latest)
        CKPT_FUZZ_CHECK(!deleted.count({layer, s}),
                        "retention deletes a version above the latest event");
    }
    for (uint64_t target : plan.retained_targets) {
      std::optional<uint64_t> need = AtOrBefore(steps, target);
      if (need) {
        CKPT_FUZZ_CHECK(!deleted.count({layer, *need}),
                        absl::StrCat("retention deletes layer ", layer, " step ", *need,
                                     " needed by retained target ", target));
      }
    }
  }
  CKPT_FUZZ_CHECK(plan.versions_kept + plan.delete_versions.size() == total,
                  "retention version count");
}

void WriteFile(const std::string& path, uint64_t size) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.close();
  if (truncate(path.c_str(), static_cast<off_t>(size)) != 0) {
    // Leave it empty; Reconcile copes with any size.
  }
}

void CheckReconcile(Index* index, FuzzedDataProvider* p, const std::string& data_dir,
                    const std::vector<std::pair<std::string, uint32_t>>& ranks,
                    const std::map<std::pair<std::string, uint32_t>, RankModel>& models) {
  // Some of the files the records name (with the recorded size or not), temp
  // files and strays; then the start-up reconcile.
  std::filesystem::create_directories(data_dir + "/jobs");
  for (const auto& jr : ranks) {
    const std::string& job = jr.first;
    const uint32_t rank = jr.second;
    if (!ValidateJobId(job).ok()) continue;
    const std::string dir = absl::StrFormat("%s/jobs/%s/rank-%08x", data_dir, job, rank);
    std::filesystem::create_directories(dir);
    auto it = models.find(jr);
    if (it != models.end()) {
      for (const auto& [lk, rec] : it->second.records) {
        if (!PlainName(rec.file()) || !p->ConsumeBool()) continue;
        const uint64_t size = rec.file_bytes() <= (1 << 16) && p->ConsumeBool()
                                  ? rec.file_bytes()
                                  : p->ConsumeIntegralInRange<uint64_t>(0, 9000);
        WriteFile(dir + "/" + rec.file(), size);
      }
    }
    if (p->ConsumeBool())
      WriteFile(dir + "/tmp." + std::to_string(p->ConsumeIntegral<uint16_t>()), 10);
    if (p->ConsumeBool()) {
      WriteFile(dir + absl::StrFormat("/L%08x-S%016x-G%016x.ckv",
                                      p->ConsumeIntegralInRange<uint32_t>(0, 3),
                                      p->ConsumeIntegralInRange<uint64_t>(0, 20), 1),
                4096);
    }
  }
  SandboxFs fs;
  LayerStore store(data_dir, &fs, index, /*use_direct_io=*/false);
  absl::Status init = store.Init();
  CKPT_FUZZ_CHECK(init.ok(), init.ToString());
  absl::StatusOr<ReconcileReport> report = store.Reconcile();
  if (!report.ok()) return;  // corrupt records stop the start-up: fail-stop is fine
  for (const auto& jr : ranks) {
    const std::string& job = jr.first;
    const uint32_t rank = jr.second;
    if (!ValidateJobId(job).ok()) continue;
    const std::string dir = absl::StrFormat("%s/jobs/%s/rank-%08x", data_dir, job, rank);
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
      CKPT_FUZZ_CHECK(!absl::StartsWith(e.path().filename().string(), "tmp."),
                      "a temp file survived Reconcile in " + dir);
    }
    auto last = index->EventAtOrBefore(job, rank, ~uint64_t{0});
    if (!last.ok()) continue;
    const uint64_t last_step = last->has_value() ? (*last)->first : 0;
    absl::Status s = index->ForEachVersion(
        job, rank, -1, [&](const VersionKey& k, const store::VersionRecord& rec) {
          CKPT_FUZZ_CHECK(k.step <= last_step,
                          absl::StrCat("version ", k.step, " above the last event ", last_step,
                                       " survived Reconcile"));
          struct stat st;
          CKPT_FUZZ_CHECK(
              PlainName(rec.file()) && ::stat((dir + "/" + rec.file()).c_str(), &st) == 0 &&
                  static_cast<uint64_t>(st.st_size) == rec.file_bytes(),
              "a record whose file is missing or short survived Reconcile: " + rec.file());
          return true;
        });
    (void)s;
  }
}

std::vector<std::string> Seeds() {
  // FuzzedDataProvider reads integral choices from the end of the input and
  // byte strings from the front, so random-ish seeds of a few sizes are as
  // good a start as any hand-made encoding; libFuzzer's CMP tracing does the
  // rest.
  std::vector<std::string> seeds;
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (size_t len : {16, 64, 200, 512, 1024, 2048}) {
    std::string s(len, '\0');
    for (char& c : s) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      c = static_cast<char>(x);
    }
    seeds.push_back(s);
  }
  // Mostly well-formed keys: small choice bytes at the end.
  seeds.push_back(std::string(300, 'j') + std::string(300, '\x03'));
  seeds.push_back(std::string(400, '\0') + std::string(400, '\x06'));
  return seeds;
}

// Phase timings on stderr with CKPT_FUZZ_DEBUG set.
struct PhaseTimer {
  const bool on = std::getenv("CKPT_FUZZ_DEBUG") != nullptr;
  absl::Time last = absl::Now();
  void Mark(const char* what) {
    if (!on) return;
    const absl::Time now = absl::Now();
    std::fprintf(stderr, "  %-10s %8.2f ms\n", what, absl::ToDoubleMilliseconds(now - last));
    last = now;
  }
};

void FuzzOne(const uint8_t* data, size_t size) {
  PhaseTimer timer;
  FuzzedDataProvider p(data, size);
  Gen gen(&p);
  // The retention policy first: FuzzedDataProvider hands out zeros once the
  // input is used up, and zeros switch most retention rules off.
  RetentionPolicy retention;
  retention.keep_last_events = p.ConsumeIntegralInRange<uint64_t>(0, 4);
  retention.keep_every_steps =
      p.ConsumeBool() ? p.ConsumeIntegralInRange<uint64_t>(0, 8) : p.ConsumeIntegral<uint64_t>();
  retention.keep_hours =
      p.ConsumeBool() ? p.ConsumeIntegralInRange<uint64_t>(0, 48) : p.ConsumeIntegral<uint64_t>();
  const int64_t now_ms = p.ConsumeBool()
                             ? 1700000000000 + static_cast<int64_t>(p.ConsumeIntegral<uint32_t>())
                             : p.ConsumeIntegral<int64_t>();
  std::vector<std::pair<std::string, std::string>> entries;
  for (int n = p.ConsumeIntegralInRange<int>(0, 24); n > 0 && p.remaining_bytes() > 0; --n)
    gen.Entry(&entries);
  if (std::getenv("CKPT_FUZZ_DEBUG") != nullptr) {  // to read a reproducer
    for (const auto& [k, v] : entries) {
      std::fprintf(stderr, "entry key '%s' (%zu bytes) value %zu bytes\n",
                   absl::CHexEscape(k).c_str(), k.size(), v.size());
    }
  }
  const std::string db_path = Root() + "/index";
  const std::string data_dir = Root() + "/data";
  {
    std::error_code ec;
    std::filesystem::remove_all(db_path, ec);
    std::filesystem::remove_all(data_dir, ec);
    timer.Mark("cleanup");
    rocksdb::Options options;
    options.create_if_missing = true;
    options.max_file_opening_threads = 1;
    options.write_buffer_size = 1 << 20;
    rocksdb::DB* raw = nullptr;
    rocksdb::Status s = rocksdb::DB::Open(options, db_path, &raw);
    CKPT_FUZZ_CHECK(s.ok(), s.ToString());
    std::unique_ptr<rocksdb::DB> db(raw);
    rocksdb::WriteBatch batch;
    for (const auto& [k, v] : entries) batch.Put(k, v);
    s = db->Write(rocksdb::WriteOptions(), &batch);
    CKPT_FUZZ_CHECK(s.ok(), s.ToString());
    s = db->Close();
    CKPT_FUZZ_CHECK(s.ok(), s.ToString());
  }
  timer.Mark("write");
  absl::StatusOr<std::unique_ptr<Index>> opened = Index::Open(db_path);
  CKPT_FUZZ_CHECK(opened.ok(), opened.status().ToString());
  timer.Mark("open");
  Index* index = opened->get();

  // Jobs and ranks to look at: what the index lists, plus the usual names.
  absl::StatusOr<std::vector<std::string>> jobs = index->ListJobs();
  CheckCode(jobs.status(), "ListJobs");
  std::set<std::string> job_set(std::begin(kJobs), std::end(kJobs));
  if (jobs.ok()) job_set.insert(jobs->begin(), jobs->end());
  std::vector<std::pair<std::string, uint32_t>> ranks;
  for (const std::string& job : job_set) {
    if (ranks.size() >= 12) break;
    CheckCode(index->GetJob(job).status(), "GetJob " + job);
    absl::StatusOr<std::vector<uint32_t>> rs = index->ListRanks(job);
    CheckCode(rs.status(), "ListRanks " + job);
    std::set<uint32_t> rank_set{0, 1};
    if (rs.ok()) rank_set.insert(rs->begin(), rs->end());
    for (uint32_t r : rank_set) {
      if (ranks.size() < 12) ranks.emplace_back(job, r);
    }
  }

  std::vector<uint64_t> bounds = {0, 1, 5, 1000, ~uint64_t{0}, ~uint64_t{0} - 1};
  for (int i = 0; i < 3; ++i) bounds.push_back(gen.Step());

  std::map<std::pair<std::string, uint32_t>, RankModel> models;
  for (const auto& [job, rank] : ranks) {
    RankModel m = ScanRank(index, job, rank);
    CheckLookups(index, job, rank, m, bounds);
    absl::StatusOr<std::optional<store::RankRecord>> table = index->GetRank(job, rank);
    CheckCode(table.status(), "GetRank");
    store::RankRecord t = table.ok() && table->has_value() ? **table : gen.RankRec();
    std::vector<uint64_t> targets = {0, gen.Step()};
    if (!m.events.empty()) targets.push_back(m.events[m.events.size() / 2].first);
    for (uint64_t target : targets) CheckPlan(index, job, rank, target, t, m);
    CheckRetention(m, retention, now_ms);
    models.emplace(std::make_pair(job, rank), std::move(m));
  }

  timer.Mark("readers");
  absl::StatusOr<uint64_t> g1 = index->NextGeneration();
  CheckCode(g1.status(), "NextGeneration");
  if (g1.ok()) {
    absl::StatusOr<uint64_t> g2 = index->NextGeneration();
    CKPT_FUZZ_CHECK(g2.ok() && *g2 != *g1,
                    absl::StrCat("NextGeneration handed out ", *g1, " twice"));
  }

  timer.Mark("generation");
  if (p.ConsumeBool()) CheckReconcile(index, &p, data_dir, ranks, models);
  timer.Mark("reconcile");
  opened->reset();
  timer.Mark("close");
}

}  // namespace
}  // namespace ckpt

// Durability is not what this target tests (the crash tests do), and each
// input creates and opens a RocksDB database twice: with real syncs (2-9 ms
// each here) and real preallocation (RocksDB reserves ~70 MB of WAL, which
// tmpfs allocates and zeroes) that is ~7 inputs/s. These definitions in the
// executable take precedence over libc's for every library, RocksDB included.
extern "C" int fsync(int) { return 0; }
extern "C" int fdatasync(int) { return 0; }
extern "C" int sync_file_range(int, off_t, off_t, unsigned int) { return 0; }
extern "C" int fallocate(int, int, off_t, off_t) { return 0; }
extern "C" int fallocate64(int, int, off_t, off_t) { return 0; }

CKPT_FUZZ_ENTRY_POINTS()
