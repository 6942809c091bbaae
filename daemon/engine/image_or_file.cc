#include "daemon/engine/image_or_file.h"

#include "base/status.h"

namespace ckpt {

absl::Status ImageOrFile::Fill(uint64_t offset, size_t n, std::string* out) {
  if (!file_.has_value()) {
    if (std::shared_ptr<const StagingLease> image = image_.lock(); image != nullptr) {
      out->resize(n);
      image->CopyOut(offset, out->data(), n);
      from_memory_ += n;
      return absl::OkStatus();
    }
    CKPT_ASSIGN_OR_RETURN(file_, remote::SequentialFileReader::Open(fd_, kFileReadBytes));
  }
  return remote::FillFromFile(&*file_, offset, n, out);
}

}  // namespace ckpt
