// The region an export's bytes come through instead of the stream
// (ExportRequest.region_token): a memfd of the reader's, mapped by both
// sides. Its first kExportRegionControlBytes are a control page; the rest,
// the window, holds one batch of the stream's bytes at a time.
//
// ckptd writes a batch (whole layers, verified) at the start of the window
// and sends ExportChunk.region_bytes; the reader copies those bytes out and
// then bumps the ack word (BumpExportAck). ckptd writes the next batch only
// once the ack word counts every batch before it (WaitForExportAck), so a
// reader's peak memory is its destinations plus the window, whatever the
// checkpoint's size. The word lives in memory the reader controls: what it
// writes there can only make ckptd overwrite bytes the reader has not taken
// yet, or wait (paced, and for restore_timeout at most over the whole
// export), never reach outside the region.
#pragma once

#include <cstdint>
#include <functional>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace ckpt {

inline constexpr uint64_t kExportRegionControlBytes = 4096;
// The window a reader asks for: at most this much, at most the bytes due.
inline constexpr uint64_t kExportRegionWindowBytes = 256 << 20;

// The number of batches the reader of `region` (its base address) took.
uint32_t ExportAcks(const void* region);
// The reader took one more batch; wakes ckptd if it waits.
void BumpExportAck(void* region);
// Waits until the reader took `want` batches. Once a `slice` it asks
// `reader_there` (false: CANCELLED, the reader went away); past `deadline`,
// DEADLINE_EXCEEDED.
absl::Status WaitForExportAck(const void* region, uint32_t want, absl::Time deadline,
                              absl::Duration slice, const std::function<bool()>& reader_there);

}  // namespace ckpt
