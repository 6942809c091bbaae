#include "tools/export_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace ckpt {

namespace {

absl::Status Errno(absl::string_view what) {
  return absl::Status(errno == ENOSPC || errno == EDQUOT  ? absl::StatusCode::kResourceExhausted
                      : errno == EACCES || errno == EPERM ? absl::StatusCode::kPermissionDenied
                                                          : absl::StatusCode::kInternal,
                      absl::StrCat(what, ": ", std::strerror(errno)));
}

// A file written beneath a directory fd: created as "<name>.tmp" with
// O_EXCL|O_NOFOLLOW (a leftover or planted temp entry is unlinked first; a
// symbolic link is removed, not followed), renamed over <name> by Commit.
// Removed again when not committed.
class BeneathFile {
 public:
  static absl::StatusOr<BeneathFile> Create(int dir_fd, const std::string& name) {
    BeneathFile f(dir_fd, name);
    if (::unlinkat(dir_fd, f.tmp_.c_str(), 0) != 0 && errno != ENOENT) {
      return Errno(absl::StrCat("remove ", f.tmp_));
    }
    f.fd_ = ::openat(dir_fd, f.tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                     0600);
    if (f.fd_ < 0) return Errno(absl::StrCat("create ", f.tmp_));
    return f;
  }
  BeneathFile(BeneathFile&& o) noexcept
      : dir_fd_(o.dir_fd_),
        name_(std::move(o.name_)),
        tmp_(std::move(o.tmp_)),
        fd_(std::exchange(o.fd_, -1)) {}
  BeneathFile(const BeneathFile&) = delete;
  BeneathFile& operator=(const BeneathFile&) = delete;
  ~BeneathFile() {
    if (fd_ >= 0) {
      ::close(fd_);
      ::unlinkat(dir_fd_, tmp_.c_str(), 0);
    }
  }

  absl::Status Write(const void* data, size_t n) {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      const ssize_t w = ::write(fd_, p, n);
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) return Errno(absl::StrCat("write ", tmp_));
      p += w;
      n -= static_cast<size_t>(w);
    }
    return absl::OkStatus();
  }

  absl::Status Commit() {
    if (::fsync(fd_) != 0) return Errno(absl::StrCat("fsync ", tmp_));
    const int fd = std::exchange(fd_, -1);
    if (::close(fd) != 0) {
      ::unlinkat(dir_fd_, tmp_.c_str(), 0);
      return Errno(absl::StrCat("close ", tmp_));
    }
    if (::renameat(dir_fd_, tmp_.c_str(), dir_fd_, name_.c_str()) != 0) {
      const absl::Status s = Errno(absl::StrCat("rename ", tmp_, " -> ", name_));
      ::unlinkat(dir_fd_, tmp_.c_str(), 0);
      return s;
    }
    return absl::OkStatus();
  }

 private:
  BeneathFile(int dir_fd, std::string name)
      : dir_fd_(dir_fd), name_(std::move(name)), tmp_(name_ + ".tmp") {}
  int dir_fd_;
  std::string name_;
  std::string tmp_;
  int fd_ = -1;
};

}  // namespace

absl::Status WriteFileBeneath(int dir_fd, const std::string& name, const std::string& text) {
  CKPT_ASSIGN_OR_RETURN(BeneathFile out, BeneathFile::Create(dir_fd, name));
  CKPT_RETURN_IF_ERROR(out.Write(text.data(), text.size()));
  return out.Commit();
}

std::string SafetensorsDType(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_F32:
      return "F32";
    case v1::DTYPE_F16:
      return "F16";
    case v1::DTYPE_BF16:
      return "BF16";
    case v1::DTYPE_F64:
      return "F64";
    case v1::DTYPE_I64:
      return "I64";
    case v1::DTYPE_I32:
      return "I32";
    case v1::DTYPE_U8:
      return "U8";
    default:
      return "";
  }
}

absl::StatusOr<nlohmann::json> WriteSafetensors(const ChunkSource& next, int dir_fd,
                                                const std::string& name, const Progress& progress) {
  v1::ExportChunk chunk;
  if (!next(&chunk) || !chunk.has_header()) {
    return absl::DataLossError("the export stream did not start with a header");
  }
  const v1::ExportHeader h = chunk.header();
  // Tensor names must be unique in a file: a name repeated across layers is
  // qualified with its layer ("layer/name"). Any name that still collides
  // (with a literal "layer/name" of another tensor, or "__metadata__") is
  // refused rather than silently overwritten in the header.
  std::map<std::string, int> seen;
  for (const v1::ExportTensor& t : h.tensors()) ++seen[t.name()];
  nlohmann::json header = nlohmann::json::object();
  std::map<uint32_t, std::vector<std::string>> names_by_layer;
  uint64_t offset = 0;
  for (const v1::ExportTensor& t : h.tensors()) {
    const std::string name =
        seen[t.name()] > 1 ? absl::StrCat(t.layer_name(), "/", t.name()) : t.name();
    if (name == "__metadata__" || header.contains(name)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", t.name(), "' of layer ", t.layer(), " would be named '", name,
          "' in the safetensors file, which another tensor (or the metadata) already uses"));
    }
    const std::string dtype = SafetensorsDType(t.dtype());
    if (dtype.empty())
      return absl::InvalidArgumentError(absl::StrCat("tensor ", name, ": unknown dtype"));
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

  CKPT_ASSIGN_OR_RETURN(BeneathFile out, BeneathFile::Create(dir_fd, name));
  uint64_t len = text.size();
  unsigned char le[8];
  for (int i = 0; i < 8; ++i) le[i] = static_cast<unsigned char>(len >> (8 * i));
  CKPT_RETURN_IF_ERROR(out.Write(le, 8));
  CKPT_RETURN_IF_ERROR(out.Write(text.data(), text.size()));
  uint64_t done = 0;
  while (next(&chunk)) {
    if (!chunk.has_data()) return absl::DataLossError("a second header in the export stream");
    if (done + chunk.data().size() > offset)
      return absl::DataLossError("more bytes than announced");
    CKPT_RETURN_IF_ERROR(out.Write(chunk.data().data(), chunk.data().size()));
    done += chunk.data().size();
    if (progress) progress(done, offset);
  }
  if (done != offset) {
    return absl::DataLossError(
        absl::StrCat("the export stream ended after ", done, " of ", offset, " bytes"));
  }
  CKPT_RETURN_IF_ERROR(out.Commit());
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
