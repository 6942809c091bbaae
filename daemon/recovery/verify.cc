#include "daemon/recovery/verify.h"

#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "base/status.h"

namespace ckpt {

absl::Status VerifyRank(const std::string& job, uint32_t rank, bool deep,
                        const RecoverySources& sources, v1::VerifyReply* reply) {
  if (deep && sources.readers.empty())
    return absl::InvalidArgumentError("verify needs an I/O backend");
  std::vector<std::pair<VersionKey, store::VersionRecord>> versions;
  CKPT_RETURN_IF_ERROR(sources.index->ForEachVersion(
      job, rank, -1, [&](const VersionKey& k, const store::VersionRecord& rec) {
        versions.emplace_back(k, rec);
        return true;
      }));
  for (const auto& [key, rec] : versions) {
    absl::Status v =
        deep ? sources.store
                   ->Read(key, rec, sources.readers[0], sources.pool, absl::Now() + sources.timeout)
                   .status()
             : sources.store->CheckFile(key, rec);
    if (absl::IsDeadlineExceeded(v)) return v;  // no staging memory: not a verdict on the data
    if (absl::IsNotFound(v)) continue;          // removed concurrently
    reply->set_versions_checked(reply->versions_checked() + 1);
    if (v.ok()) {
      reply->set_bytes_checked(reply->bytes_checked() + rec.payload_bytes());
      continue;
    }
    v1::VerifyFailure* f = reply->add_failures();
    f->set_rank(rank);
    f->set_layer(key.layer);
    f->set_step(key.step);
    f->set_error(v.ToString());
  }
  return absl::OkStatus();
}

}  // namespace ckpt
