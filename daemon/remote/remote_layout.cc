#include "daemon/remote/remote_layout.h"

#include <cstring>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "base/status.h"
#include "daemon/store/format.h"
#include "daemon/store/layer_store.h"

namespace ckpt::remote {
namespace {

// Version 2: the body's MAC under the cluster key, not an unkeyed checksum.
constexpr char kManifestMagic[8] = {'C', 'K', 'P', 'T', 'M', 'F', '\0', '\2'};
constexpr char kOwnerMagic[8] = {'C', 'K', 'P', 'T', 'J', 'O', '\0', '\1'};
constexpr size_t kHeadBytes = 8 + RemoteKey::kMacBytes;

// magic, MAC(purpose, body), body.
std::string Seal(const char (&magic)[8], std::string_view purpose, const std::string& body,
                 const RemoteKey& key) {
  std::string out(magic, sizeof(magic));
  out += key.Mac(purpose, body);
  out += body;
  return out;
}

// The body of a sealed object, once its magic and MAC check.
absl::StatusOr<absl::string_view> Unseal(const char (&magic)[8], std::string_view purpose,
                                         const std::string& bytes, const RemoteKey& key,
                                         const char* what) {
  if (bytes.size() < 8 || std::memcmp(bytes.data(), magic, 7) != 0) {
    return absl::DataLossError(absl::StrCat("not a ckptd ", what, " (bad magic or truncated)"));
  }
  if (bytes[7] != magic[7]) {
    return absl::DataLossError(
        absl::StrCat("a ", what, " of another format version (", static_cast<int>(bytes[7]),
                     ", this ckptd reads ", static_cast<int>(magic[7]),
                     "): written by an older ckptd without the cluster key"));
  }
  if (bytes.size() < kHeadBytes) {
    return absl::DataLossError(absl::StrCat("not a ckptd ", what, " (truncated)"));
  }
  const absl::string_view body(bytes.data() + kHeadBytes, bytes.size() - kHeadBytes);
  if (!key.Verify(purpose, std::string_view(body.data(), body.size()),
                  std::string_view(bytes.data() + 8, RemoteKey::kMacBytes))) {
    return absl::DataLossError(
        absl::StrCat("the ", what,
                     "'s MAC does not match: it was not written by a ckptd holding this cluster's "
                     "remote_key_file (damaged, or written by someone else)"));
  }
  return body;
}

}  // namespace

absl::Status CheckObjectKey(absl::string_view key) {
  const auto bad = [&key] {
    return absl::InvalidArgumentError(
        absl::StrCat("bad object key \"", absl::CHexEscape(key.substr(0, 200)), "\""));
  };
  if (key.empty() || key.size() > kMaxKeyBytes || key.front() == '/' || key.back() == '/' ||
      key.find('\0') != absl::string_view::npos) {
    return bad();
  }
  for (absl::string_view part : absl::StrSplit(key, '/')) {
    if (part.empty() || part == "." || part == ".." || absl::StartsWith(part, ".tmp."))
      return bad();
  }
  return absl::OkStatus();
}

std::string JobsPrefix() { return "jobs/"; }
std::string JobPrefix(const std::string& job) { return absl::StrCat("jobs/", job, "/"); }
std::string RankPrefix(const std::string& job, uint32_t rank) {
  return absl::StrCat(JobPrefix(job), RankDirName(rank), "/");
}
std::string VersionObjectKey(const std::string& job, uint32_t rank, const std::string& file) {
  return absl::StrCat(RankPrefix(job, rank), "v/", file);
}
std::string ManifestPrefix(const std::string& job, uint32_t rank) {
  return absl::StrCat(RankPrefix(job, rank), "m/");
}
std::string OwnerKey(const std::string& job) { return absl::StrCat(JobPrefix(job), "owner"); }
std::string ManifestKey(const std::string& job, uint32_t rank, uint64_t step) {
  return absl::StrCat(ManifestPrefix(job, rank), absl::StrFormat("S%016u", step));
}

bool ParseManifestKey(const std::string& key, const std::string& job, uint32_t rank,
                      uint64_t* step) {
  const std::string prefix = ManifestPrefix(job, rank);
  if (!absl::StartsWith(key, prefix)) return false;
  absl::string_view rest(key);
  rest.remove_prefix(prefix.size());
  if (rest.size() != 17 || rest[0] != 'S') return false;
  rest.remove_prefix(1);
  for (char c : rest) {
    if (c < '0' || c > '9') return false;
  }
  return absl::SimpleAtoi(rest, step);
}

bool ParseVersionObjectKey(const std::string& key, const std::string& job, uint32_t rank,
                           std::string* file) {
  const std::string prefix = absl::StrCat(RankPrefix(job, rank), "v/");
  if (!absl::StartsWith(key, prefix)) return false;
  *file = key.substr(prefix.size());
  uint32_t layer = 0;
  uint64_t step = 0;
  return ParseFileName(*file, &layer, &step);
}

bool GenerationOfFile(const std::string& file, uint64_t* generation) {
  uint32_t layer = 0;
  uint64_t step = 0;
  if (!ParseFileName(file, &layer, &step)) return false;
  return absl::SimpleHexAtoi(absl::string_view(file).substr(29, 16), generation);
}

bool ParseRankOfKey(const std::string& key, std::string* job, uint32_t* rank) {
  if (!absl::StartsWith(key, "jobs/")) return false;
  const size_t job_end = key.find('/', 5);
  if (job_end == std::string::npos || job_end == 5) return false;
  const size_t rank_end = key.find('/', job_end + 1);
  if (rank_end == std::string::npos) return false;
  *job = key.substr(5, job_end - 5);
  return ParseRankDirName(key.substr(job_end + 1, rank_end - job_end - 1), rank);
}

std::string EncodeManifest(const store::RemoteManifest& manifest, const RemoteKey& key) {
  return Seal(kManifestMagic, "manifest", manifest.SerializeAsString(), key);
}

absl::StatusOr<store::RemoteManifest> DecodeManifest(const std::string& bytes,
                                                     const RemoteKey& key) {
  CKPT_ASSIGN_OR_RETURN(absl::string_view body,
                        Unseal(kManifestMagic, "manifest", bytes, key, "manifest"));
  store::RemoteManifest m;
  if (!m.ParseFromArray(body.data(), static_cast<int>(body.size()))) {
    return absl::DataLossError("manifest body does not parse");
  }
  return m;
}

std::string EncodeOwner(const store::RemoteJob& job, const RemoteKey& key) {
  return Seal(kOwnerMagic, "owner", job.SerializeAsString(), key);
}

absl::StatusOr<store::RemoteJob> DecodeOwner(const std::string& bytes, const RemoteKey& key) {
  CKPT_ASSIGN_OR_RETURN(absl::string_view body,
                        Unseal(kOwnerMagic, "owner", bytes, key, "job owner record"));
  store::RemoteJob job;
  if (!job.ParseFromArray(body.data(), static_cast<int>(body.size()))) {
    return absl::DataLossError("job owner record does not parse");
  }
  return job;
}

}  // namespace ckpt::remote
