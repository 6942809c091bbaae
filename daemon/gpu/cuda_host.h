// CUDA host-memory registration for the staging pool, behind a header with
// no CUDA types so the rest of ckptd builds and runs without CUDA.
//
// In a build with CUDA (CKPT_HAVE_CUDA), HostRegistration pins a range with
// cudaHostRegister when a device is present, so device-to-host copies into
// the staging pool run at full speed. Without CUDA, or without a device (on
// a machine without a driver every CUDA call fails with error 35), it is a
// no-op that reports why. The range is unregistered on destruction.
#pragma once

#include <cstdint>
#include <string>

namespace ckpt {

// Number of CUDA devices usable by this process; 0 without CUDA, driver or device.
int CudaDeviceCount();
// "cuda <runtime version>" or "none".
std::string CudaSupport();

class HostRegistration {
 public:
  HostRegistration() = default;
  // Registers [ptr, ptr+bytes) when a device exists; `reason` says what happened.
  HostRegistration(void* ptr, uint64_t bytes);
  ~HostRegistration();
  HostRegistration(const HostRegistration&) = delete;
  HostRegistration& operator=(const HostRegistration&) = delete;

  bool registered() const { return registered_; }
  const std::string& reason() const { return reason_; }

 private:
  void* ptr_ = nullptr;
  bool registered_ = false;
  std::string reason_ = "not attempted";
};

}  // namespace ckpt
