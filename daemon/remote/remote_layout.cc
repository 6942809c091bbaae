#include "daemon/remote/remote_layout.h"

#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "daemon/store/format.h"
#include "daemon/store/layer_store.h"

namespace ckpt::remote {
namespace {

constexpr char kManifestMagic[8] = {'C', 'K', 'P', 'T', 'M', 'F', '\0', '\1'};

}  // namespace

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

std::string EncodeManifest(const store::RemoteManifest& manifest) {
  const std::string body = manifest.SerializeAsString();
  const uint64_t sum = HashBytes(body.data(), body.size());
  std::string out(kManifestMagic, sizeof(kManifestMagic));
  char le[8];
  for (int i = 0; i < 8; ++i) le[i] = static_cast<char>((sum >> (8 * i)) & 0xff);
  out.append(le, sizeof(le));
  out += body;
  return out;
}

absl::StatusOr<store::RemoteManifest> DecodeManifest(const std::string& bytes) {
  if (bytes.size() < 16 || std::memcmp(bytes.data(), kManifestMagic, sizeof(kManifestMagic)) != 0) {
    return absl::DataLossError("not a ckptd manifest (bad magic or truncated)");
  }
  uint64_t sum = 0;
  for (int i = 0; i < 8; ++i) sum |= uint64_t{static_cast<unsigned char>(bytes[8 + i])} << (8 * i);
  const char* body = bytes.data() + 16;
  const size_t len = bytes.size() - 16;
  if (HashBytes(body, len) != sum) return absl::DataLossError("manifest checksum mismatch");
  store::RemoteManifest m;
  if (!m.ParseFromArray(body, static_cast<int>(len))) {
    return absl::DataLossError("manifest body does not parse");
  }
  return m;
}

}  // namespace ckpt::remote
