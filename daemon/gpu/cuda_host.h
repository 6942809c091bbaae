// CUDA host-memory registration for the staging pool, behind a header with
// no CUDA types so the rest of ckptd builds and runs without CUDA.
//
// In a build with CUDA (CKPT_HAVE_CUDA), HostRegistration pins a range with
// cudaHostRegister when a device is present, so device-to-host copies into
// the staging pool run at full speed. One call of 512 GiB or more fails on
// recent drivers (r580 and later), so the range is registered in chunks of
// at most kHostRegisterChunkBytes, one call each, each ending on a chunk
// boundary of the staging pool (no pool chunk straddles two registered
// ranges); every return code is
// checked, and when a chunk fails the chunks registered before it are
// unregistered again and `reason` says which chunk failed and why (the pool
// then works unregistered, with slower copies). Without CUDA, or without a
// device (on a machine without a driver every CUDA call fails with error
// 35), it is a no-op that reports why. The chunks are unregistered on
// destruction, the last first.
//
// The two runtime calls go through HostRegisterCalls, so a test checks the
// chunking on a fake without a GPU.
//
// Thread-safety: a HostRegistration is used by one thread (main's).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace ckpt {

// Number of CUDA devices usable by this process; 0 without CUDA, driver or device.
int CudaDeviceCount();
// "cuda <runtime version>" or "none".
std::string CudaSupport();

// The largest range one cudaHostRegister call is given.
inline constexpr uint64_t kHostRegisterChunkBytes = uint64_t{64} << 30;

// cudaHostRegister / cudaHostUnregister.
class HostRegisterCalls {
 public:
  virtual ~HostRegisterCalls() = default;
  // Registers [ptr, ptr + bytes) (cudaHostRegisterDefault); the error names
  // the CUDA error.
  virtual absl::Status Register(void* ptr, uint64_t bytes) = 0;
  // Unregisters a range Register succeeded on, by its start.
  virtual absl::Status Unregister(void* ptr) = 0;
};

// The CUDA runtime's calls; without CUDA, calls that fail with
// FAILED_PRECONDITION. Never destroyed.
HostRegisterCalls* RuntimeHostRegisterCalls();

class HostRegistration {
 public:
  HostRegistration() = default;
  // Registers [ptr, ptr+bytes) through the runtime when a device exists;
  // `reason` says what happened. `pool_chunk_bytes` is the staging pool's
  // chunk size (0: none): every range registered ends on a multiple of it.
  HostRegistration(void* ptr, uint64_t bytes, uint64_t pool_chunk_bytes);
  // Registers [ptr, ptr+bytes) through `calls`, in chunks of `chunk_bytes`
  // (0: kHostRegisterChunkBytes) rounded down to a multiple of
  // `pool_chunk_bytes` (when not 0; at least one pool chunk), whether or not
  // a device exists. `calls` must outlive this object.
  HostRegistration(void* ptr, uint64_t bytes, HostRegisterCalls* calls,
                   uint64_t chunk_bytes = kHostRegisterChunkBytes, uint64_t pool_chunk_bytes = 0);
  ~HostRegistration();
  HostRegistration(const HostRegistration&) = delete;
  HostRegistration& operator=(const HostRegistration&) = delete;

  // The whole range is registered (every chunk).
  bool registered() const { return !chunks_.empty(); }
  size_t chunks() const { return chunks_.size(); }
  const std::string& reason() const { return reason_; }

 private:
  void RegisterChunks(char* ptr, uint64_t bytes, uint64_t chunk_bytes, uint64_t pool_chunk_bytes);

  HostRegisterCalls* calls_ = nullptr;
  std::vector<void*> chunks_;  // the start of each registered chunk, in order
  std::string reason_ = "not attempted";
};

}  // namespace ckpt
