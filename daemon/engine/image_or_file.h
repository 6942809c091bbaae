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
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "daemon/remote/remote_store.h"
#include "daemon/staging/staging_pool.h"

namespace ckpt {

class ImageOrFile {
 public:
  // `fd` is the version's file (not owned), opened while the version was
  // sure to exist: read from once the image is gone.
  ImageOrFile(std::weak_ptr<const StagingLease> image, int fd)
      : image_(std::move(image)), fd_(fd) {}

  // A RemoteStore::Filler: the n bytes at `offset` into `*out`.
  absl::Status Fill(uint64_t offset, size_t n, std::string* out);
  // How many bytes came from the image.
  uint64_t from_memory() const { return from_memory_; }

 private:
  static constexpr size_t kFileReadBytes = 1 << 20;
  std::weak_ptr<const StagingLease> image_;
  const int fd_;
  std::optional<remote::SequentialFileReader> file_;  // once the image went
  uint64_t from_memory_ = 0;
};

}  // namespace ckpt
