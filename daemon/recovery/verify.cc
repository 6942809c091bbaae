#include "daemon/recovery/verify.h"

#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "base/status.h"

namespace ckpt {

absl::Status VerifyRank(const std::string& job, uint32_t rank, bool deep, Index* index,
                        LayerStore* store, IoBackend* io, StagingPool* pool,
                        absl::Duration read_timeout, v1::VerifyReply* reply) {
  std::vector<std::pair<VersionKey, store::VersionRecord>> versions;
  CKPT_RETURN_IF_ERROR(index->ForEachVersion(
      job, rank, -1, [&](const VersionKey& k, const store::VersionRecord& rec) {
        versions.emplace_back(k, rec);
        return true;
      }));
  for (const auto& [key, rec] : versions) {
    absl::Status v = deep ? store->Read(key, rec, io, pool, absl::Now() + read_timeout).status()
                          : store->CheckFile(key, rec);
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
