// Helpers shared by the store_test sources: staged layer versions filled with
// seeded random bytes.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "daemon/staging/staging_pool.h"
#include "daemon/store/format.h"
#include "daemon/store/index.h"
#include "daemon/store/layer_store.h"
#include "gtest/gtest.h"
#include "tests/lib/io_test_util.h"
#include "tests/lib/test_util.h"

namespace ckpt {
namespace store_test {

using ::ckpt::testing::MakeTestPool;

inline std::string TensorName(size_t i) { return "tensor" + std::to_string(i); }

// A header for `key` with one U8 tensor per entry of `sizes`, laid out by PlanLayout.
inline store::LayerFileHeader MakeHeader(const VersionKey& key, uint64_t generation,
                                         const std::vector<uint64_t>& sizes) {
  store::LayerFileHeader h;
  h.set_job_id(key.job);
  h.set_rank(key.rank);
  h.set_layer(key.layer);
  h.set_layer_name("layer" + std::to_string(key.layer));
  h.set_step(key.step);
  h.set_generation(generation);
  for (size_t i = 0; i < sizes.size(); ++i) {
    store::TensorEntry* t = h.add_tensors();
    t->set_name(TensorName(i));
    t->set_dtype(store::DTYPE_U8);
    t->add_shape(sizes[i]);
    t->set_role(store::ROLE_PARAM);
    t->set_nbytes(sizes[i]);
  }
  return h;
}

// A staged version: header laid out, lease acquired and every tensor filled
// with bytes from `seed`. `data[i]` holds tensor i's bytes.
struct Staged {
  StagedVersion version;
  std::vector<std::string> data;
};

// A non-empty `layer_name` replaces the default one.
inline void StageVersion(StagingPool* pool, const VersionKey& key, uint64_t generation,
                         const std::vector<uint64_t>& sizes, uint64_t seed, Staged* out,
                         const std::string& layer_name = "") {
  out->version.key = key;
  out->version.generation = generation;
  out->version.header = MakeHeader(key, generation, sizes);
  if (!layer_name.empty()) out->version.header.set_layer_name(layer_name);
  absl::StatusOr<VersionLayout> layout = PlanLayout(&out->version.header);
  ASSERT_TRUE(::ckpt::testing::IsOk(layout));
  out->version.layout = *layout;
  absl::StatusOr<StagingLease> lease =
      pool->Acquire(layout->file_bytes, absl::Now() + absl::Seconds(30));
  ASSERT_TRUE(::ckpt::testing::IsOk(lease));
  out->version.lease = std::move(lease).value();
  out->data.clear();
  for (int i = 0; i < out->version.header.tensors_size(); ++i) {
    const store::TensorEntry& t = out->version.header.tensors(i);
    out->data.push_back(
        ::ckpt::testing::RandomBytes(seed * 1000 + static_cast<uint64_t>(i), t.nbytes()));
    out->version.lease.CopyIn(layout->header_bytes + t.offset(), out->data.back().data(),
                              t.nbytes());
  }
}

// Sets every tensor's checksum from the lease and encodes the header, like
// LayerStore::Commit does.
inline absl::StatusOr<uint64_t> SealImage(StagedVersion* v) {
  for (store::TensorEntry& t : *v->header.mutable_tensors()) {
    t.set_xxh3(HashImage(LeaseImage(v->lease), v->layout.header_bytes + t.offset(), t.nbytes()));
  }
  LeaseImage image(v->lease);
  return EncodeHeader(v->header, v->layout, &image);
}

inline std::string ImageBytes(const StagingLease& lease, uint64_t offset, uint64_t len) {
  std::string out(len, '\0');
  lease.CopyOut(offset, out.data(), len);
  return out;
}

}  // namespace store_test
}  // namespace ckpt
