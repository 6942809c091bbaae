// ImageOrFile: the bytes of a committed layer version for an upload to a
// store that takes bytes as they are filled in (a peer, RemoteStore::
// PutsFromMemory): from the version's image in the memory tier
// (memory_tier.h) while the tier keeps it, and from the version's file from
// the moment it has let the image go.
//
// The image is held only while a message's bytes are copied out of it: an
// upload, however slow its peer, never keeps from the snapshots the room the
// memory tier gave back to the pool. An image and its file hold the same
// bytes (the file was written from the image), so a version may be sent
// from both, the first part from one and the rest from the other.
//
// Thread-safety: one upload's; not thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/unique_fd.h"
#include "daemon/remote/remote_store.h"
#include "daemon/staging/staging_pool.h"

namespace ckpt {

class ImageOrFile {
 public:
  // `open` opens the version's file, when it is first needed.
  ImageOrFile(std::weak_ptr<const StagingLease> image,
              std::function<absl::StatusOr<UniqueFd>()> open)
      : image_(std::move(image)), open_(std::move(open)) {}

  // A RemoteStore::Filler: the n bytes at `offset` into `*out`.
  absl::Status Fill(uint64_t offset, size_t n, std::string* out);
  // How many bytes came from the image.
  uint64_t from_memory() const { return from_memory_; }

 private:
  static constexpr size_t kFileReadBytes = 1 << 20;
  std::weak_ptr<const StagingLease> image_;
  std::function<absl::StatusOr<UniqueFd>()> open_;
  UniqueFd fd_;
  std::optional<remote::SequentialFileReader> file_;  // once the image went
  uint64_t from_memory_ = 0;
};

}  // namespace ckpt
