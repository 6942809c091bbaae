// Validation of names that reach the file system or the index.
#pragma once

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace ckpt {

inline constexpr size_t kMaxJobIdLength = 128;

// OK when `job_id` matches [A-Za-z0-9._-]{1,128} and is not "." or "..";
// INVALID_ARGUMENT (naming the offending character) otherwise.
absl::Status ValidateJobId(absl::string_view job_id);

}  // namespace ckpt
