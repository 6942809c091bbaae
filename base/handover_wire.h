// The handover socket's wire format, shared by the client library and ckptd.
//
// gRPC cannot carry file descriptors, so a trainer passes its memfd regions
// over a second Unix socket (default /run/ckptd/ckptd.sock.fds):
//
//   client -> daemon   HandoverHeader{magic, nfds} with SCM_RIGHTS carrying
//                      exactly nfds descriptors (1..kMaxHandoverFds)
//   daemon -> client   HandoverReply{magic, code, token[16], message[200]}
//
// code is an absl::StatusCode. The token is random, single-use, bound to the
// sender's uid (SO_PEERCRED) and expires after a configured time unless a
// Register call from the same uid claims it. A refusal carries its reason in
// `message`: RESOURCE_EXHAUSTED names the daemon limit that was hit (per uid
// or node-wide, see daemon/shm/handover.h), INVALID_ARGUMENT a malformed
// message (including two descriptors of one region), DEADLINE_EXCEEDED a
// connection that did not deliver its message in time.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "base/unique_fd.h"

namespace ckpt {

inline constexpr uint32_t kHandoverMagic = 0x31484B43;  // "CKH1"
// The header's magic of a handover of CUDA page descriptors (GPU memory of
// the virtual memory management API, exported with
// cuMemExportToShareableHandle) instead of memfd regions. Such descriptors
// may share one anonymous inode, so the one-descriptor-per-file check of
// memfd regions does not apply; a token names one kind, and a claim of the
// other kind is refused. The reply's magic is kHandoverMagic for both.
inline constexpr uint32_t kHandoverMagicCudaPages = 0x31474B43;  // "CKG1"
enum class HandoverKind { kMemfdRegions, kCudaPages };
inline constexpr size_t kMaxHandoverFds = 250;  // below SCM_MAX_FD
inline constexpr size_t kHandoverTokenBytes = 16;

struct HandoverHeader {
  uint32_t magic;
  uint32_t nfds;
};

struct HandoverReply {
  uint32_t magic;
  uint32_t code;
  uint8_t token[kHandoverTokenBytes];
  char message[200];
};

// Sends `len` bytes of `data` with `fds` attached in one sendmsg.
absl::Status SendWithFds(int sock, const void* data, size_t len, absl::Span<const int> fds);

// Receives exactly `len` bytes into `data` and up to `max_fds` descriptors
// (which are closed again when the message carried more than max_fds or was
// truncated: INVALID_ARGUMENT).
absl::Status RecvWithFds(int sock, void* data, size_t len, std::vector<UniqueFd>* fds,
                         size_t max_fds);

// Client side: connects to `socket_path`, hands over `fds`, returns the token.
// Every step is bounded by `timeout`; a missing daemon is UNAVAILABLE. A
// refusal keeps the daemon's code, with the message prefixed "ckptd refused
// the handover: ".
absl::StatusOr<std::string> HandOverFds(const std::string& socket_path, absl::Span<const int> fds,
                                        absl::Duration timeout,
                                        HandoverKind kind = HandoverKind::kMemfdRegions);

// Sets SO_RCVTIMEO and SO_SNDTIMEO.
absl::Status SetSocketTimeout(int sock, absl::Duration timeout);
// Connects the AF_UNIX stream socket `sock` to `path`. INVALID_ARGUMENT for a
// path that does not fit a sockaddr_un; UNAVAILABLE when nothing accepts there.
absl::Status ConnectUnix(int sock, const std::string& path);

}  // namespace ckpt
