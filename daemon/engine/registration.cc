#include "daemon/engine/registration.h"

#include <algorithm>
#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "base/region.h"
#include "base/status.h"
#include "daemon/common/validate.h"
#include "daemon/io/io_backend.h"
#include "daemon/recovery/schema_convert.h"
#include "daemon/store/format.h"

namespace ckpt {

store::LayerFileHeader HeaderTemplateOf(const std::string& job, uint32_t rank,
                                        const LayerDesc& layer) {
  store::LayerFileHeader header;
  header.set_job_id(job);
  header.set_rank(rank);
  header.set_layer(layer.id);
  header.set_layer_name(layer.name);
  for (const TensorDesc& t : layer.tensors) {
    store::TensorEntry* e = header.add_tensors();
    e->set_name(t.name);
    e->set_dtype(ToStore(t.dtype));
    e->mutable_shape()->Add(t.shape.begin(), t.shape.end());
    e->set_role(ToStore(t.role));
    e->set_group(t.group);
    e->set_nbytes(t.nbytes);
  }
  return header;
}

uint64_t RankIndexBytes(const store::RankRecord& table) {
  constexpr uint64_t kRecordOverhead = 512;  // the key and RocksDB's own bytes
  return table.ByteSizeLong() + kRecordOverhead;
}

store::LayerSpec TableEntryOf(const LayerDesc& layer) {
  store::LayerSpec out;
  out.set_id(layer.id);
  out.set_name(layer.name);
  out.set_kind(ToStore(layer.kind));
  out.set_frozen(layer.frozen);
  for (const TensorDesc& t : layer.tensors) {
    store::TensorSpec* s = out.add_tensors();
    s->set_name(t.name);
    s->set_dtype(ToStore(t.dtype));
    s->mutable_shape()->Add(t.shape.begin(), t.shape.end());
    s->set_nbytes(t.nbytes);
    s->set_role(ToStore(t.role));
    s->set_region(t.region);
    s->set_offset(t.offset);
    s->set_group(t.group);
    s->set_param(t.param);
    s->set_lr_scale(t.lr_scale);
    s->set_beta1(t.beta1);
    s->set_beta2(t.beta2);
    s->set_eps(t.eps);
    s->set_weight_decay(t.weight_decay);
  }
  return out;
}

namespace {

// (region, offset, end, layer, tensor) of a tensor, for the overlap check.
using TensorSpan = std::tuple<uint32_t, uint64_t, uint64_t, size_t, size_t>;

// "layer <li> ('<name>') tensor '<name>'", for a message.
std::string TensorWhere(const Registration& req, size_t li, size_t ti) {
  return absl::StrCat("layer ", li, " ('", req.layers[li].name, "') tensor '",
                      req.layers[li].tensors[ti].name, "'");
}

// The request's job id, world size and rank, and how many layers it has.
absl::Status ValidateRankAndLayerCount(const Registration& req, const RegistrationLimits& limits) {
  CKPT_RETURN_IF_ERROR(ValidateJobId(req.job));
  if (req.world_size == 0 || req.world_size > limits.max_world_size) {
    return absl::InvalidArgumentError(absl::StrCat("world_size ", req.world_size, " out of range"));
  }
  if (req.rank >= req.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", req.rank, " is not below world_size ", req.world_size));
  }
  if (req.layers.empty() || req.layers.size() > limits.max_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat(req.layers.size(), " layers; expected 1..", limits.max_layers));
  }
  if (req.job_nodes.size() > req.world_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "job_nodes names ", req.job_nodes.size(), " ranks' nodes; world_size is ", req.world_size));
  }
  for (size_t i = 0; i < req.job_nodes.size(); ++i) {
    if (absl::Status s = ValidateNodeName(req.job_nodes[i]); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("job_nodes[", i, "] (the node of rank ", i, "): ", s.message()));
    }
  }
  return absl::OkStatus();
}

// Layer `li`'s own fields: its name (not one of `layer_names`, to which it
// is added), its id and how many tensors it has.
absl::Status ValidateLayer(const Registration& req, size_t li, const RegistrationLimits& limits,
                           std::set<std::string>* layer_names) {
  const LayerDesc& layer = req.layers[li];
  if (absl::Status s = ValidateName(layer.name); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", li, ": ", s.message()));
  }
  const std::string where = absl::StrCat("layer ", li, " ('", layer.name, "')");
  if (layer.id != li) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, " has id ", layer.id, "; layers must be numbered 0..N-1 in order"));
  }
  if (!layer_names->insert(layer.name).second) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": duplicate layer name"));
  }
  if (layer.tensors.empty() || layer.tensors.size() > limits.max_tensors_per_layer) {
    return absl::InvalidArgumentError(absl::StrCat(where, " has ", layer.tensors.size(),
                                                   " tensors; expected 1..",
                                                   limits.max_tensors_per_layer));
  }
  return absl::OkStatus();
}

// Whether the layer's file fits the staging pool (limits.max_layer_file_bytes,
// 0 = unchecked) and its header can be laid out at all (`where` names the
// layer in the message).
absl::Status CheckLayerFits(const Registration& req, const LayerDesc& layer,
                            const std::string& where, const RegistrationLimits& limits) {
  // Every field a version's header carries (Engine::Register/Snapshot),
  // the per-version ones at their widest.
  store::LayerFileHeader sizing = HeaderTemplateOf(req.job, req.rank, layer);
  std::set<uint32_t> groups;
  for (const TensorDesc& t : layer.tensors) groups.insert(t.group);
  sizing.set_step(~uint64_t{0});
  sizing.set_generation(~uint64_t{0});
  for (uint32_t g : groups) {
    store::GroupStep* gs = sizing.add_group_steps();
    gs->set_group(g);
    gs->set_step(~uint64_t{0});
  }
  absl::StatusOr<VersionLayout> layout = PlanLayout(&sizing);
  if (!layout.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", layout.status().message()));
  }
  // One page of slack beyond the widest header (a StepDone may, for
  // example, name a group twice).
  if (limits.max_layer_file_bytes > 0 &&
      layout->file_bytes + kDirectAlignment > limits.max_layer_file_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, " needs ", layout->file_bytes, " bytes of staging; the pool has ",
                     limits.max_layer_file_bytes, " (raise staging_pool_bytes)"));
  }
  return absl::OkStatus();
}

// No two tensors of one region overlap.
absl::Status CheckNoOverlaps(const Registration& req, std::vector<TensorSpan> spans) {
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) {
    const auto& a = spans[i - 1];
    const auto& b = spans[i];
    if (std::get<0>(a) == std::get<0>(b) && std::get<1>(b) < std::get<2>(a)) {
      return absl::InvalidArgumentError(
          absl::StrCat(TensorWhere(req, std::get<3>(a), std::get<4>(a)), " and ",
                       TensorWhere(req, std::get<3>(b), std::get<4>(b)), " overlap"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateRegistration(const Registration& req,
                                  const std::vector<uint64_t>& region_sizes,
                                  const RegistrationLimits& limits) {
  CKPT_RETURN_IF_ERROR(ValidateRankAndLayerCount(req, limits));
  // (region, offset, end, layer, tensor) of every tensor, for the overlap
  // check. Messages are built only for the error returned: a request may
  // hold millions of tensors.
  std::vector<TensorSpan> spans;
  std::set<std::string> layer_names;
  // The job's nodes are stored with the table and count with it.
  uint64_t table_bytes = 0;
  for (const std::string& n : req.job_nodes) table_bytes += n.size() + 2;
  for (size_t li = 0; li < req.layers.size(); ++li) {
    const LayerDesc& layer = req.layers[li];
    CKPT_RETURN_IF_ERROR(ValidateLayer(req, li, limits, &layer_names));
    const std::string where = absl::StrCat("layer ", li, " ('", layer.name, "')");
    // Each tensor: its name, dtype, size and shape, and where in its region
    // it lies.
    std::set<std::string> tensor_names;
    for (size_t ti = 0; ti < layer.tensors.size(); ++ti) {
      const TensorDesc& t = layer.tensors[ti];
      if (absl::Status s = ValidateName(t.name); !s.ok()) {
        return absl::InvalidArgumentError(absl::StrCat(where, " tensor ", ti, ": ", s.message()));
      }
      auto tw = [&] { return TensorWhere(req, li, ti); };
      if (!tensor_names.insert(t.name).second) {
        return absl::InvalidArgumentError(absl::StrCat(tw(), ": duplicate name"));
      }
      const uint64_t esize = ElementBytes(t.dtype);
      if (esize == 0) return absl::InvalidArgumentError(absl::StrCat(tw(), ": unknown dtype"));
      if (t.nbytes == 0 || t.nbytes > kMaxRegionBytes) {
        return absl::InvalidArgumentError(absl::StrCat(tw(), ": size ", t.nbytes, " out of range"));
      }
      unsigned __int128 elems = 1;
      for (uint64_t d : t.shape) {
        elems *= d;
        if (elems > kMaxRegionBytes) break;
      }
      if (t.shape.size() > 16 || elems * esize != t.nbytes) {
        return absl::InvalidArgumentError(
            absl::StrCat(tw(), ": nbytes ", t.nbytes, " does not equal prod(shape) * ", esize));
      }
      if (t.region >= region_sizes.size()) {
        return absl::InvalidArgumentError(absl::StrCat(tw(), ": region ", t.region, " but only ",
                                                       region_sizes.size(), " were handed over"));
      }
      const uint64_t rsize = region_sizes[t.region];
      if (t.offset > rsize || t.nbytes > rsize - t.offset) {
        return absl::InvalidArgumentError(
            absl::StrCat(tw(), ": [", t.offset, ", ", t.offset + t.nbytes, ") lies outside region ",
                         t.region, " of ", rsize, " bytes"));
      }
      spans.emplace_back(t.region, t.offset, t.offset + t.nbytes, li, ti);
    }
    CKPT_RETURN_IF_ERROR(CheckLayerFits(req, layer, where, limits));
    table_bytes += TableEntryOf(layer).ByteSizeLong();
    if (table_bytes > limits.max_table_bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("the rank's table reaches ", table_bytes, " bytes at layer ", li,
                       ", more than max_registration_table_bytes (", limits.max_table_bytes,
                       "): fewer layers or tensors, or shorter names"));
    }
  }
  return CheckNoOverlaps(req, std::move(spans));
}

}  // namespace ckpt
