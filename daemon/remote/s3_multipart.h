// The multipart upload of S3Store::PutFile for a file above part_bytes:
// CreateMultipartUpload, the parts through one curl multi handle with up to
// parallel_parts in flight (each part read with pread into its own buffer,
// each retried on its own), CompleteMultipartUpload, and
// AbortMultipartUpload on every failure path. s3_store.h's banner states the
// policy (part sizes, retries, codes).
//
// Internal to daemon/remote (PRIVATE_HDRS); called by S3Store::PutFile
// (s3_store.cc), which also reads its single-PUT bodies through PreadFull.
//
// Thread-safety: each call runs on the calling thread and shares nothing but
// the transport's handle pool (thread-safe), so concurrent calls are safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "daemon/remote/s3_transport.h"

namespace ckpt::remote::s3_internal {

// Reads exactly `len` bytes of `fd` at `offset` into `buf`. INVALID_ARGUMENT
// when the file ends first; the errno's code when pread fails.
absl::Status PreadFull(int fd, char* buf, size_t len, uint64_t offset);

// Uploads the first `size` bytes of `fd` as the object `full_key` (prefix
// included) in parts of part_bytes, or of more whole MiB when the object
// would otherwise need over 10000 parts. OK when the object is complete;
// INVALID_ARGUMENT for an object over 10000 parts of 5 GiB or a file shorter
// than `size`; otherwise the status of the step that failed (a part's says
// which part), the upload aborted. REQUIRES: `fd` stays open during the call.
absl::Status PutMultipart(Transport* transport, const std::string& full_key, int fd, uint64_t size);

}  // namespace ckpt::remote::s3_internal
