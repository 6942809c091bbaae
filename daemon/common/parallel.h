// RunOnThreads: a bounded fan-out of independent items (fsyncs of a publish
// group, a step's objects to upload or fetch), each item once, on at most
// `threads` threads, the calling one among them. Returns when every item
// is done; the threads live only for the call.
#pragma once

#include <cstddef>
#include <functional>

namespace ckpt {

// Calls body(i) once for each i in [0, count), on min(threads, count)
// threads (at least the caller's). `body` must be safe to run concurrently
// for distinct i.
void RunOnThreads(size_t count, size_t threads, const std::function<void(size_t)>& body);

}  // namespace ckpt
