// Command-line flags of the developer tools: "--name=value".
#pragma once

#include <string>
#include <utility>

namespace ckpt::tools {

// {"--name", "value"}; an argument without '=' is all name, with an empty value.
inline std::pair<std::string, std::string> SplitFlag(const std::string& arg) {
  const size_t eq = arg.find('=');
  if (eq == std::string::npos) return {arg, ""};
  return {arg.substr(0, eq), arg.substr(eq + 1)};
}

}  // namespace ckpt::tools
