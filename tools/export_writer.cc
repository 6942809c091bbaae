#include "tools/export_writer.h"

#include <cstdio>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"

namespace ckpt {

std::string SafetensorsDType(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_F32: return "F32";
    case v1::DTYPE_F16: return "F16";
    case v1::DTYPE_BF16: return "BF16";
    case v1::DTYPE_F64: return "F64";
    case v1::DTYPE_I64: return "I64";
    case v1::DTYPE_I32: return "I32";
    case v1::DTYPE_U8: return "U8";
    default: return "";
  }
}

absl::StatusOr<nlohmann::json> WriteSafetensors(const ChunkSource& next, const std::string& path,
                                                const Progress& progress) {
  v1::ExportChunk chunk;
  if (!next(&chunk) || !chunk.has_header()) {
    return absl::DataLossError("the export stream did not start with a header");
  }
  const v1::ExportHeader h = chunk.header();
  // Tensor names must be unique in a file: qualify a repeated one with its layer.
  std::map<std::string, int> seen;
  for (const v1::ExportTensor& t : h.tensors()) ++seen[t.name()];
  nlohmann::json header = nlohmann::json::object();
  std::map<uint32_t, std::vector<std::string>> names_by_layer;
  uint64_t offset = 0;
  for (const v1::ExportTensor& t : h.tensors()) {
    const std::string name = seen[t.name()] > 1 ? absl::StrCat(t.layer_name(), "/", t.name()) : t.name();
    const std::string dtype = SafetensorsDType(t.dtype());
    if (dtype.empty()) return absl::InvalidArgumentError(absl::StrCat("tensor ", name, ": unknown dtype"));
    header[name] = {{"dtype", dtype},
                    {"shape", std::vector<uint64_t>(t.shape().begin(), t.shape().end())},
                    {"data_offsets", {offset, offset + t.nbytes()}}};
    offset += t.nbytes();
    names_by_layer[t.layer()].push_back(name);
  }
  const v1::Plan& plan = h.plan();
  header["__metadata__"] = {{"format", "ckptd-composite"},
                            {"job_id", plan.job_id()},
                            {"rank", absl::StrCat(plan.rank())},
                            {"target_step", absl::StrCat(plan.target_step())}};
  std::string text = header.dump();
  while ((8 + text.size()) % 8 != 0) text.push_back(' ');

  const std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) return absl::PermissionDeniedError(absl::StrCat("cannot write ", tmp));
  auto fail = [&](absl::Status s) {
    std::fclose(f);
    std::remove(tmp.c_str());
    return s;
  };
  uint64_t len = text.size();
  unsigned char le[8];
  for (int i = 0; i < 8; ++i) le[i] = static_cast<unsigned char>(len >> (8 * i));
  if (std::fwrite(le, 1, 8, f) != 8 || std::fwrite(text.data(), 1, text.size(), f) != text.size()) {
    return fail(absl::InternalError(absl::StrCat("write ", tmp)));
  }
  uint64_t done = 0;
  while (next(&chunk)) {
    if (!chunk.has_data()) return fail(absl::DataLossError("a second header in the export stream"));
    if (done + chunk.data().size() > offset) return fail(absl::DataLossError("more bytes than announced"));
    if (std::fwrite(chunk.data().data(), 1, chunk.data().size(), f) != chunk.data().size()) {
      return fail(absl::InternalError(absl::StrCat("write ", tmp)));
    }
    done += chunk.data().size();
    if (progress) progress(done, offset);
  }
  if (done != offset) {
    return fail(absl::DataLossError(absl::StrCat("the export stream ended after ", done, " of ",
                                                 offset, " bytes")));
  }
  if (std::fflush(f) != 0 || std::fclose(f) != 0) {
    std::remove(tmp.c_str());
    return absl::InternalError(absl::StrCat("close ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("rename ", tmp, " -> ", path));
  }
  nlohmann::json layers = nlohmann::json::array();
  for (const v1::LayerPlan& lp : plan.layers()) {
    layers.push_back({{"layer", lp.layer()},
                      {"name", lp.name()},
                      {"step", lp.step()},
                      {"staleness", lp.staleness()},
                      {"bytes", lp.bytes()},
                      {"tensors", names_by_layer[lp.layer()]}});
  }
  return nlohmann::json{{"rank", plan.rank()},
                        {"target_step", plan.target_step()},
                        {"max_staleness", plan.max_staleness()},
                        {"size_weighted_staleness", plan.size_weighted_staleness()},
                        {"bytes", offset},
                        {"layers", layers}};
}

}  // namespace ckpt
