#include "daemon/common/parallel.h"

#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

namespace ckpt {

void RunOnThreads(size_t count, size_t threads, const std::function<void(size_t)>& body) {
  std::atomic<size_t> next{0};
  auto worker = [&] {
    for (size_t i; (i = next.fetch_add(1)) < count;) body(i);
  };
  const size_t n = std::min(std::max<size_t>(threads, 1), count);
  std::vector<std::thread> helpers;
  for (size_t i = 1; i < n; ++i) helpers.emplace_back(worker);
  worker();
  for (std::thread& t : helpers) t.join();
}

}  // namespace ckpt
