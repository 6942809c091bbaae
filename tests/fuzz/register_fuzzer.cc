// libFuzzer target: Register request handling from raw bytes (size limits
// and API fuzzing in docs/reliability.md, the parts that need no memory
// handover or I/O).
//
// Input: byte 0 picks the mode, the rest feeds a FuzzedDataProvider.
//   even: the request is a v1::RegisterRequest parsed from raw protobuf bytes
//         (what a hostile or broken client can send);
//   odd:  the request is built field by field from the input, mostly valid,
//         so that the checks deep inside validation and the policy code
//         behind it are reached.
// The region sizes (what fstat would say about the handed-over memfds) and
// the limits come from the input too. Then, as Engine::Register does:
// RegistrationOf (the gRPC handler's conversion), ValidateRegistration, the
// policy's Validate and, for a valid request, the
// per-layer file layout, a few steps of layer selection (SelectLayers, or
// LayerCheck's Decide with drift sums from the input).
//
// Oracles for a request that validates (checked independently of the code
// under test): job id syntax, rank < world_size, dense layer ids, unique
// names, nbytes == prod(shape) * dtype size, every tensor inside its region,
// no two tensors overlapping; every layer's version file — with the header
// the engine writes, at the largest step/generation/group counters — fits
// the staging budget the limits name; selections are sorted, unique and in
// range and include every forced layer; LayerCheck persists never-persisted
// layers and reports finite thresholds.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/dtype.h"
#include "base/region.h"
#include "daemon/common/validate.h"
#include "daemon/engine/registration.h"
#include "daemon/io/io_backend.h"
#include "daemon/policy/layercheck.h"
#include "daemon/policy/selection.h"
#include "daemon/recovery/schema_convert.h"
#include "daemon/rpc/convert.h"
#include "daemon/store/format.h"
#include "tests/fuzz/fuzz_util.h"

namespace ckpt {
namespace {

v1::DType AnyDType(FuzzedDataProvider& p) {
  return static_cast<v1::DType>(p.ConsumeIntegralInRange<int>(0, 9));  // 8, 9: unknown values
}

// A request built from the input: mostly well-formed, with the input choosing
// where it deviates. FuzzedDataProvider returns zeros once the input is used
// up, so a zero always picks the well-formed choice; one choice in 16 (or 8)
// deviates. A "wide" layer has up to 1000 tensors (the limit is 4096), to
// exercise the header size against the staging budget.
v1::RegisterRequest BuildRequest(FuzzedDataProvider& p, std::vector<uint64_t>* regions) {
  auto rare = [&p](int n) { return p.ConsumeIntegralInRange<int>(0, n - 1) == n - 1; };
  v1::RegisterRequest req;
  req.set_job_id(rare(16) ? p.ConsumeRandomLengthString(20) : std::string("job-1"));
  req.set_world_size(rare(16) ? p.ConsumeIntegral<uint32_t>()
                              : 1 + p.ConsumeIntegralInRange<uint32_t>(0, 7));
  req.set_rank(rare(16) ? p.ConsumeIntegral<uint32_t>() : p.ConsumeIntegralInRange<uint32_t>(0, 7));
  const int nregions = (p.ConsumeIntegralInRange<int>(0, 3) + 1) % 4;  // 0 regions is rare
  for (int i = 0; i < nregions; ++i) {
    regions->push_back(rare(8) ? p.ConsumeIntegral<uint64_t>()
                               : uint64_t{1} << (40 - p.ConsumeIntegralInRange<int>(0, 28)));
  }
  const int nlayers = (p.ConsumeIntegralInRange<int>(0, 6) + 1) % 7;  // 0 layers is rare
  uint64_t cursor = 0;  // a packing cursor, so that most tables do not overlap
  for (int l = 0; l < nlayers; ++l) {
    v1::LayerSpec* layer = req.add_layers();
    layer->set_id(rare(16) ? p.ConsumeIntegral<uint32_t>() : static_cast<uint32_t>(l));
    layer->set_name(rare(16) ? p.ConsumeRandomLengthString(8) : absl::StrCat("layers.", l));
    layer->set_kind(static_cast<v1::LayerKind>(p.ConsumeIntegralInRange<int>(0, 6)));
    const bool wide = rare(8);
    const int ntensors = wide ? 1 + p.ConsumeIntegralInRange<int>(0, 999)
                              : (p.ConsumeIntegralInRange<int>(0, 5) + 1) % 6;  // 0 is rare
    for (int t = 0; t < ntensors; ++t) {
      v1::TensorSpec* ts = layer->add_tensors();
      static const char* const kNames[] = {"weight", "bias", "exp_avg", "exp_avg_sq", "master"};
      ts->set_name(rare(16) ? p.ConsumeRandomLengthString(8)
                   : t < 5  ? std::string(kNames[t])
                            : absl::StrCat("t", t));
      const v1::DType dt =
          rare(8) ? AnyDType(p) : static_cast<v1::DType>(1 + p.ConsumeIntegralInRange<int>(0, 6));
      ts->set_dtype(dt);
      uint64_t elems = 1;
      const int dims = p.ConsumeIntegralInRange<int>(0, 3);
      for (int d = 0; d < dims; ++d) {
        const uint64_t n = rare(16) ? p.ConsumeIntegral<uint64_t>()
                                    : 1 + p.ConsumeIntegralInRange<uint64_t>(0, 63);
        ts->add_shape(n);
        elems *= n;
      }
      const uint64_t nbytes = elems * std::max<uint64_t>(ElementBytes(static_cast<DType>(dt)), 1);
      ts->set_nbytes(rare(16) ? p.ConsumeIntegral<uint64_t>() : nbytes);
      ts->set_region(rare(16) ? p.ConsumeIntegral<uint32_t>() : 0);
      if (rare(8)) {
        ts->set_offset(p.ConsumeIntegral<uint64_t>());
      } else {
        cursor = AlignUp(cursor, 64);
        ts->set_offset(cursor);
        cursor += nbytes;
      }
      ts->set_role(static_cast<v1::TensorRole>(p.ConsumeIntegralInRange<int>(0, 6)));
      ts->set_group(rare(4) ? p.ConsumeIntegral<uint32_t>()
                            : p.ConsumeIntegralInRange<uint32_t>(0, 3));
      if (p.ConsumeBool()) ts->set_param("weight");
    }
  }
  v1::PolicySpec* policy = req.mutable_policy();
  policy->set_kind(static_cast<v1::PolicyKind>(p.ConsumeIntegralInRange<int>(0, 6)));
  policy->set_every_n(p.ConsumeIntegralInRange<uint64_t>(0, 5));
  policy->set_optimizer(static_cast<v1::OptimizerKind>(p.ConsumeIntegralInRange<int>(0, 5)));
  v1::LayerCheckSpec* lc = policy->mutable_layercheck();
  if (p.ConsumeBool()) lc->set_k0(p.ConsumeFloatingPoint<double>());
  if (p.ConsumeBool()) lc->set_k0_embedding(p.ConsumeFloatingPoint<double>());
  if (p.ConsumeBool()) lc->set_k_floor(p.ConsumeFloatingPoint<double>());
  if (p.ConsumeBool()) lc->set_s_max(p.ConsumeIntegralInRange<uint64_t>(0, 5));
  if (p.ConsumeBool()) lc->set_warmup(p.ConsumeIntegralInRange<uint64_t>(0, 5));
  if (p.ConsumeBool()) lc->set_warmup_interval(p.ConsumeIntegralInRange<uint64_t>(0, 3));
  if (p.ConsumeBool()) lc->set_full_every(p.ConsumeIntegralInRange<uint64_t>(0, 4));
  return req;
}

// The header Engine::Register and Engine::Snapshot write for one layer, with
// every per-version field at its widest.
store::LayerFileHeader EngineHeader(const v1::RegisterRequest& req, const v1::LayerSpec& spec) {
  store::LayerFileHeader h;
  h.set_job_id(req.job_id());
  h.set_rank(req.rank());
  h.set_layer(spec.id());
  h.set_layer_name(spec.name());
  std::set<uint32_t> groups;
  for (const v1::TensorSpec& t : spec.tensors()) {
    store::TensorEntry* e = h.add_tensors();
    e->set_name(t.name());
    e->set_dtype(ToStore(static_cast<DType>(t.dtype())));
    *e->mutable_shape() = t.shape();
    e->set_role(ToStore(static_cast<TensorRole>(t.role())));
    e->set_group(t.group());
    e->set_nbytes(t.nbytes());
    groups.insert(t.group());
  }
  h.set_step(~uint64_t{0});
  h.set_generation(~uint64_t{0});
  for (uint32_t g : groups) {
    store::GroupStep* gs = h.add_group_steps();
    gs->set_group(g);
    gs->set_step(~uint64_t{0});
  }
  return h;
}

// The documented rules, checked independently of ValidateRegistration.
void CheckValidRequest(const v1::RegisterRequest& req, const std::vector<uint64_t>& regions,
                       const RegistrationLimits& limits) {
  CKPT_FUZZ_CHECK(ValidateJobId(req.job_id()).ok(), "bad job id accepted");
  CKPT_FUZZ_CHECK(req.world_size() >= 1 && req.world_size() <= limits.max_world_size &&
                      req.rank() < req.world_size(),
                  "rank/world_size accepted out of range");
  CKPT_FUZZ_CHECK(
      req.layers_size() >= 1 && static_cast<uint32_t>(req.layers_size()) <= limits.max_layers,
      "layer count");
  std::set<std::string> layer_names;
  std::vector<std::tuple<uint32_t, uint64_t, uint64_t>> spans;
  for (int li = 0; li < req.layers_size(); ++li) {
    const v1::LayerSpec& layer = req.layers(li);
    CKPT_FUZZ_CHECK(layer.id() == static_cast<uint32_t>(li), "layer ids not dense");
    CKPT_FUZZ_CHECK(!layer.name().empty() && layer_names.insert(layer.name()).second,
                    "layer names");
    CKPT_FUZZ_CHECK(layer.tensors_size() >= 1 &&
                        static_cast<uint32_t>(layer.tensors_size()) <= limits.max_tensors_per_layer,
                    "tensor count");
    std::set<std::string> names;
    for (const v1::TensorSpec& t : layer.tensors()) {
      CKPT_FUZZ_CHECK(!t.name().empty() && names.insert(t.name()).second, "tensor names");
      const uint64_t esize = ElementBytes(static_cast<DType>(t.dtype()));
      CKPT_FUZZ_CHECK(esize > 0, "unknown dtype accepted");
      unsigned __int128 prod = esize;
      for (uint64_t d : t.shape())
        prod =
            std::min<unsigned __int128>(prod * d, ~uint64_t{0} + static_cast<unsigned __int128>(1));
      CKPT_FUZZ_CHECK(
          t.nbytes() > 0 && prod == t.nbytes(),
          absl::StrCat("tensor '", t.name(), "' nbytes ", t.nbytes(), " != prod(shape) * ", esize));
      CKPT_FUZZ_CHECK(t.region() < regions.size(), "region index out of range");
      const unsigned __int128 end = static_cast<unsigned __int128>(t.offset()) + t.nbytes();
      CKPT_FUZZ_CHECK(end <= regions[t.region()],
                      absl::StrCat("tensor '", t.name(), "' [", t.offset(), ", +", t.nbytes(),
                                   ") outside region ", t.region(), " of ", regions[t.region()]));
      spans.emplace_back(t.region(), t.offset(), static_cast<uint64_t>(end));
    }
    store::LayerFileHeader h = EngineHeader(req, layer);
    absl::StatusOr<VersionLayout> layout = PlanLayout(&h);
    CKPT_FUZZ_CHECK(layout.ok(), "a validated layer has no layout: " + layout.status().ToString());
    if (limits.max_layer_file_bytes > 0) {
      CKPT_FUZZ_CHECK(layout->file_bytes <= limits.max_layer_file_bytes,
                      absl::StrCat("layer ", li, " validated against a staging budget of ",
                                   limits.max_layer_file_bytes, " but its version file needs ",
                                   layout->file_bytes, " bytes"));
    }
  }
  for (size_t i = 0; i < spans.size(); ++i) {
    for (size_t j = i + 1; j < spans.size(); ++j) {
      const auto& [ra, oa, ea] = spans[i];
      const auto& [rb, ob, eb] = spans[j];
      CKPT_FUZZ_CHECK(ra != rb || ea <= ob || eb <= oa, "overlapping tensors accepted");
    }
  }
}

void CheckSelection(FuzzedDataProvider& p, const Registration& req) {
  const PolicyConfig& policy = req.policy.selection;
  const uint32_t n = static_cast<uint32_t>(req.layers.size());
  if (policy.kind == PolicyKind::kLayerCheck) {
    const LayerCheckConfig& config = req.policy.layercheck;
    if (!config.Validate().ok()) return;
    std::vector<LayerKind> kinds;
    for (const LayerDesc& l : req.layers) kinds.push_back(l.kind);
    LayerCheckPolicy lc(config, kinds);
    uint64_t step = 0;
    bool sane_lr = true;
    for (int i = p.ConsumeIntegralInRange<int>(1, 8); i > 0; --i) {
      step += p.ConsumeIntegralInRange<uint64_t>(1, 300);
      std::vector<drift::LayerSums> sums;
      for (uint32_t l = 0; l < n; ++l) {
        sums.push_back(drift::LayerSums{std::fabs(p.ConsumeFloatingPoint<double>()),
                                        std::fabs(p.ConsumeFloatingPoint<double>())});
      }
      std::vector<bool> forced;
      for (uint32_t l = 0; l < n; ++l) forced.push_back(p.ConsumeIntegralInRange<int>(0, 7) == 0);
      std::vector<uint64_t> before;
      for (uint32_t l = 0; l < n; ++l) before.push_back(lc.last_persisted(l));
      // StepDone does not check lr: any double, NaN and infinities included.
      double lr = 1e-3;
      if (p.ConsumeBool()) {
        const uint64_t bits = p.ConsumeIntegral<uint64_t>();
        std::memcpy(&lr, &bits, sizeof(lr));
      }
      sane_lr &= std::isfinite(lr) && lr > 0;
      std::vector<LayerDecision> d = lc.Decide(step, lr, sums, forced);
      CKPT_FUZZ_CHECK(d.size() == n, "one decision per layer");
      for (uint32_t l = 0; l < n; ++l) {
        if (before[l] == 0 || forced[l]) {
          CKPT_FUZZ_CHECK(d[l].reason != PersistReason::kNone,
                          "a never-persisted or forced layer was not persisted");
        }
        if (d[l].reason != PersistReason::kNone)
          CKPT_FUZZ_CHECK(lc.last_persisted(l) == step, "t_l not updated");
        if (sane_lr) CKPT_FUZZ_CHECK(!std::isnan(d[l].threshold), "NaN threshold");
        if (step - before[l] >= config.s_max && step > config.warmup) {
          CKPT_FUZZ_CHECK(d[l].reason != PersistReason::kNone,
                          "staleness guard S_max not honoured");
        }
      }
    }
    return;
  }
  std::vector<bool> never(n), retry(n);
  for (uint32_t l = 0; l < n; ++l) {
    never[l] = p.ConsumeIntegralInRange<int>(0, 3) == 0;
    retry[l] = p.ConsumeIntegralInRange<int>(0, 7) == 0;
  }
  std::vector<uint32_t> explicit_layers;
  for (int i = p.ConsumeIntegralInRange<int>(0, 4); i > 0; --i) {
    explicit_layers.push_back(p.ConsumeIntegralInRange<uint32_t>(0, n + 1));
  }
  const uint64_t step = p.ConsumeIntegral<uint64_t>();
  absl::StatusOr<std::vector<uint32_t>> sel =
      SelectLayers(policy, step, n, explicit_layers, never, retry);
  if (!sel.ok()) {
    CKPT_FUZZ_CHECK(absl::IsInvalidArgument(sel.status()), sel.status().ToString());
    return;
  }
  CKPT_FUZZ_CHECK(std::is_sorted(sel->begin(), sel->end()) &&
                      std::adjacent_find(sel->begin(), sel->end()) == sel->end(),
                  "selection not sorted and unique");
  for (uint32_t l : *sel) CKPT_FUZZ_CHECK(l < n, "selected a layer that does not exist");
  if (policy.kind != PolicyKind::kNone) {
    for (uint32_t l = 0; l < n; ++l) {
      if (never[l] || retry[l]) {
        CKPT_FUZZ_CHECK(std::binary_search(sel->begin(), sel->end(), l),
                        "a forced layer was not selected");
      }
    }
    for (uint32_t l : explicit_layers) {
      CKPT_FUZZ_CHECK(std::binary_search(sel->begin(), sel->end(), l),
                      "an explicit layer was not selected");
    }
  }
}

std::string StructuredSeed(uint8_t fill) {
  // Mode byte 1 (structured), then bytes that make BuildRequest take its
  // well-formed branches (FuzzedDataProvider reads choices from the end).
  return std::string(1, '\x01') + std::string(256, static_cast<char>(fill));
}

std::vector<std::string> Seeds() {
  std::vector<std::string> seeds;
  // Raw protobuf seeds: valid requests of a few shapes.
  auto raw = [&](const v1::RegisterRequest& req, uint64_t region, uint8_t limit) {
    std::string s = std::string(1, '\x00') + std::string(1, '\x01');
    for (int b = 0; b < 8; ++b) s.push_back(static_cast<char>(region >> (8 * b)));
    s.push_back(static_cast<char>(limit));
    seeds.push_back(s + req.SerializeAsString());
  };
  v1::RegisterRequest req;
  req.set_job_id("job-1");
  req.set_rank(1);
  req.set_world_size(4);
  uint64_t offset = 0;
  for (uint32_t l = 0; l < 3; ++l) {
    v1::LayerSpec* layer = req.add_layers();
    layer->set_id(l);
    layer->set_name("layers." + std::to_string(l));
    layer->set_kind(l == 0 ? v1::LAYER_EMBEDDING : v1::LAYER_BLOCK);
    for (const char* name : {"weight", "exp_avg", "exp_avg_sq"}) {
      v1::TensorSpec* ts = layer->add_tensors();
      ts->set_name(name);
      ts->set_dtype(v1::DTYPE_F32);
      ts->add_shape(4);
      ts->add_shape(8);
      ts->set_nbytes(128);
      ts->set_offset(offset);
      offset += 128;
      ts->set_role(std::string(name) == "weight"    ? v1::ROLE_PARAM
                   : std::string(name) == "exp_avg" ? v1::ROLE_EXP_AVG
                                                    : v1::ROLE_EXP_AVG_SQ);
      if (std::string(name) != "weight") ts->set_param("weight");
    }
  }
  raw(req, 1 << 16, 1);
  req.mutable_policy()->set_kind(v1::POLICY_LAYERCHECK);
  req.mutable_policy()->set_optimizer(v1::OPTIMIZER_ADAMW);
  req.mutable_policy()->mutable_layercheck()->set_warmup(2);
  raw(req, 1 << 20, 8);
  req.mutable_policy()->set_kind(v1::POLICY_EVERY_N);
  req.mutable_policy()->set_every_n(3);
  raw(req, 4096, 3);
  req.mutable_policy()->set_kind(v1::POLICY_EXPLICIT);
  req.mutable_layers(1)->mutable_tensors(0)->set_offset(64);  // overlaps
  raw(req, 1 << 16, 0);
  for (uint8_t fill : {0x00, 0x01, 0x7f, 0x80, 0xff}) seeds.push_back(StructuredSeed(fill));
  return seeds;
}

// Raw mode layout: [mode][n][n little-endian u64 region sizes][limit][protobuf...]
bool ParseRaw(const uint8_t* data, size_t size, v1::RegisterRequest* req,
              std::vector<uint64_t>* regions, RegistrationLimits* limits) {
  size_t pos = 1;
  if (pos >= size) return false;
  const size_t n = data[pos++] % 4;
  for (size_t i = 0; i < n; ++i) {
    uint64_t v = 0;
    for (int b = 0; b < 8 && pos < size; ++b) v |= static_cast<uint64_t>(data[pos++]) << (8 * b);
    regions->push_back(v);
  }
  if (pos >= size) return false;
  const uint8_t limit = data[pos++];
  limits->max_layer_file_bytes = (limit & 1) ? 0 : 4096 * (1 + (limit >> 1) % 64);
  return req->ParseFromArray(data + pos,
                             static_cast<int>(size - pos));  // false: gRPC fails the call
}

void FuzzOne(const uint8_t* data, size_t size) {
  if (size == 0) return;
  const bool structured = (data[0] & 1) != 0;
  FuzzedDataProvider p(data + 1, size - 1);
  RegistrationLimits limits;
  v1::RegisterRequest req;
  std::vector<uint64_t> regions;
  if (structured) {
    if (p.ConsumeBool()) {
      limits.max_layers = p.ConsumeIntegralInRange<uint32_t>(0, 8);
      limits.max_tensors_per_layer = p.ConsumeIntegralInRange<uint32_t>(0, 8);
      limits.max_world_size = p.ConsumeIntegralInRange<uint32_t>(0, 1 << 20);
    }
    // The staging budget in bytes, so that CMP tracing can match it to a
    // layer's size exactly; 0 = unlimited.
    limits.max_layer_file_bytes =
        p.ConsumeBool() ? p.ConsumeIntegralInRange<uint64_t>(4096, 1 << 24) : 0;
    req = BuildRequest(p, &regions);
  } else if (!ParseRaw(data, size, &req, &regions, &limits)) {
    return;
  }
  absl::StatusOr<Registration> registration = RegistrationOf(req);
  if (!registration.ok()) {
    CKPT_FUZZ_CHECK(absl::IsInvalidArgument(registration.status()),
                    "RegistrationOf returned " + registration.status().ToString());
    return;
  }
  absl::Status s = ValidateRegistration(*registration, regions, limits);
  CKPT_FUZZ_CHECK(s.ok() || absl::IsInvalidArgument(s),
                  "ValidateRegistration returned " + s.ToString());
  if (!s.ok()) return;
  CheckValidRequest(req, regions, limits);
  const PolicyConfig& policy = registration->policy.selection;
  if (absl::Status ps = policy.Validate(); !ps.ok()) {
    CKPT_FUZZ_CHECK(absl::IsInvalidArgument(ps), ps.ToString());
    return;
  }
  CheckSelection(p, *registration);
}

}  // namespace
}  // namespace ckpt

CKPT_FUZZ_ENTRY_POINTS()
