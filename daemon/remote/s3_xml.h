// The text S3Store exchanges with the server: the little XML it reads from
// S3's answers (ListObjectsV2 pages, CreateMultipartUpload, <Error> bodies)
// and writes into CompleteMultipartUpload, and the two checks on text that
// goes into a request or a status message.
//
// Not a general XML parser: S3's documents are flat enough that the first
// <Tag>...</Tag> after a position is the element wanted. Internal to
// daemon/remote (PRIVATE_HDRS); called by every s3_*.cc.
//
// Thread-safety: stateless functions, thread-safe.
#pragma once

#include <cstddef>
#include <optional>
#include <string>

#include "absl/strings/string_view.h"

namespace ckpt::remote::s3_internal {

// `s` with the five predefined XML entities and numeric character references
// (decimal or hex, a code point of Unicode that is not a surrogate) replaced;
// anything else after '&' is kept as it is.
std::string XmlDecode(absl::string_view s);

// `s` with '&', '<' and '>' written as entities (the text of an element).
std::string XmlEscape(absl::string_view s);

// The raw (undecoded) text of the first <tag>...</tag> starting at or after
// *pos, and *pos moved past its closing tag; nullopt, *pos unchanged, when
// there is none. The view points into `xml`.
std::optional<absl::string_view> FindElement(absl::string_view xml, absl::string_view tag,
                                             size_t* pos);

// The decoded text of the first <tag>...</tag> in `xml`, or nullopt.
std::optional<std::string> ElementText(absl::string_view xml, absl::string_view tag);

// True when `s` holds a byte below 0x20 or 0x7f (DEL).
bool HasControlChar(absl::string_view s);

// Text from the server or from a caller, made safe for a status message:
// at most 200 bytes, control characters replaced by spaces.
std::string Sanitize(absl::string_view text);

}  // namespace ckpt::remote::s3_internal
