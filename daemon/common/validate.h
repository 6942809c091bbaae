// Validation of names that reach the file system or the index.
#pragma once

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace ckpt {

inline constexpr size_t kMaxJobIdLength = 128;

// OK when `job_id` matches [A-Za-z0-9._-]{1,128} and is not "." or "..";
// INVALID_ARGUMENT (naming the offending character) otherwise.
absl::Status ValidateJobId(absl::string_view job_id);

// A node's name (its ckptd's certificate common name, docs/peer.md): OK
// when it matches [A-Za-z0-9._-]{1,253} (a DNS name's length) and is not
// "." or "..".
inline constexpr size_t kMaxNodeNameLength = 253;
absl::Status ValidateNodeName(absl::string_view node);

// Layer and tensor names: they are shown in tables and logs and stored in
// every file header, so they are bounded and printable.
inline constexpr size_t kMaxNameLength = 1024;

// OK when `name` has 1..kMaxNameLength bytes and no control character
// (bytes below 0x20, and 0x7f); INVALID_ARGUMENT otherwise, saying which
// rule (the message never repeats the name).
absl::Status ValidateName(absl::string_view name);

}  // namespace ckpt
