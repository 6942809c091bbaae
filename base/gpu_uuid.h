// The text form of a GPU's 16-byte UUID, as nvidia-smi prints it
// ("GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"). Shared by the client, which
// names the device of its GPU regions, and ckptd, which finds it by that name.
#pragma once

#include <string>

#include "absl/strings/str_cat.h"

namespace ckpt {

inline std::string GpuUuidString(const void* uuid16) {
  const auto* b = static_cast<const unsigned char*>(uuid16);
  std::string s = "GPU-";
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) s += '-';
    absl::StrAppend(&s, absl::Hex(b[i], absl::kZeroPad2));
  }
  return s;
}

}  // namespace ckpt
