#include "daemon/common/validate.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace ckpt {

absl::Status ValidateJobId(absl::string_view job_id) {
  if (job_id.empty()) return absl::InvalidArgumentError("job id is empty");
  if (job_id.size() > kMaxJobIdLength) {
    return absl::InvalidArgumentError(
        absl::StrCat("job id is ", job_id.size(), " bytes; the limit is ", kMaxJobIdLength));
  }
  if (job_id == "." || job_id == "..") {
    return absl::InvalidArgumentError("job id may not be '.' or '..'");
  }
  for (size_t i = 0; i < job_id.size(); ++i) {
    unsigned char c = static_cast<unsigned char>(job_id[i]);
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '.' || c == '_' || c == '-';
    if (!ok) {
      return absl::InvalidArgumentError(
          absl::StrFormat("job id has byte 0x%02x at position %d; allowed: [A-Za-z0-9._-]", c, i));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateName(absl::string_view name) {
  if (name.empty() || name.size() > kMaxNameLength) {
    return absl::InvalidArgumentError(
        absl::StrCat("the name has ", name.size(), " bytes; expected 1..", kMaxNameLength));
  }
  for (size_t i = 0; i < name.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(name[i]);
    if (c < 0x20 || c == 0x7f) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the name has the control character 0x", absl::Hex(c, absl::kZeroPad2), " at byte ", i));
    }
  }
  return absl::OkStatus();
}

}  // namespace ckpt
