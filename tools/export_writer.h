// Writing an exported composite checkpoint (Admin.Export stream) as a
// safetensors file: 8-byte little-endian header length, a JSON header naming
// each tensor's dtype, shape and byte range, then the tensors' bytes. Readable
// without ckptd (any safetensors reader, or a dozen lines of numpy).
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "ckpt/v1/ckpt.pb.h"
#include "nlohmann/json.hpp"

namespace ckpt {

// Pulls the next chunk; false at the end of the stream.
using ChunkSource = std::function<bool(v1::ExportChunk*)>;
using Progress = std::function<void(uint64_t done, uint64_t total)>;

// Reads one rank's stream from `next` and writes `name` inside the directory
// `dir_fd` (through a temporary file created O_EXCL|O_NOFOLLOW, mode 0600,
// renamed into place: a symbolic link planted in the directory is replaced,
// never followed). Returns that rank's manifest entry: rank, file, target
// step, staleness figures, and per layer its step and tensor names.
// DATA_LOSS when the stream ends early or carries more bytes than announced;
// INVALID_ARGUMENT when two tensors would have the same name in the file
// (safetensors names must be unique; "__metadata__" is reserved);
// file-system errors as their errno says.
absl::StatusOr<nlohmann::json> WriteSafetensors(const ChunkSource& next, int dir_fd,
                                                const std::string& name, const Progress& progress);

// Writes `text` as `name` inside `dir_fd` the same way (manifest.json).
absl::Status WriteFileBeneath(int dir_fd, const std::string& name, const std::string& text);

// safetensors dtype name ("F32", "BF16", ...); empty for an unknown dtype.
std::string SafetensorsDType(v1::DType dtype);

}  // namespace ckpt
