#include "daemon/common/validate.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace ckpt {

namespace {

// [A-Za-z0-9._-]{1,max}, not "." or ".."; `what` names it in errors.
absl::Status ValidateToken(const char* what, absl::string_view s, size_t max) {
  if (s.empty()) return absl::InvalidArgumentError(absl::StrCat(what, " is empty"));
  if (s.size() > max) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " is ", s.size(), " bytes; the limit is ", max));
  }
  if (s == "." || s == "..") {
    return absl::InvalidArgumentError(absl::StrCat(what, " may not be '.' or '..'"));
  }
  for (size_t i = 0; i < s.size(); ++i) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '.' || c == '_' || c == '-';
    if (!ok) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s has byte 0x%02x at position %d; allowed: [A-Za-z0-9._-]", what, c, i));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateJobId(absl::string_view job_id) {
  return ValidateToken("job id", job_id, kMaxJobIdLength);
}

absl::Status ValidateNodeName(absl::string_view node) {
  return ValidateToken("node name", node, kMaxNodeNameLength);
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
