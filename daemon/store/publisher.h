// Publisher: the thread that finishes layer-version commits.
//
// A writer writes a version's bytes to its temp file (LayerStore::Write),
// hands it here, and goes on with the next version's data. The publisher
// takes whatever has queued up meanwhile, at most max_group versions, and
// publishes it as one group (LayerStore::Publish): every version's
// fdatasync at once, each version's rename, one fsync per rank directory,
// one synchronous index batch. The disk streams data while a group's names and records are made
// durable, and a group of n versions costs one directory fsync and one index
// sync instead of n of each. Each version keeps the commit protocol's order
// (layer_store.h).
//
// Each version's `done` runs on the publisher's thread, once its result is
// known, in the order the versions were submitted.
//
// Thread-safety: Submit may be called from any thread; Stop once.
#pragma once

#include <cstddef>
#include <deque>
#include <thread>
#include <utility>

#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "daemon/store/layer_store.h"

namespace ckpt {

class Publisher {
 public:
  // The version's record as the index now holds it, or why it failed
  // (nothing of it is visible then), and where its commit spent its time.
  using Done = absl::AnyInvocable<void(absl::StatusOr<store::VersionRecord> rec,
                                       const CommitTimings& timings) &&>;
  static constexpr size_t kDefaultMaxGroup = 64;

  explicit Publisher(LayerStore* store, size_t max_group = kDefaultMaxGroup);
  Publisher(const Publisher&) = delete;
  Publisher& operator=(const Publisher&) = delete;
  ~Publisher();  // Stop()

  // Queues `v` for the next group. After Stop, publishes it on the caller's
  // thread before returning: a written version is never dropped.
  void Submit(WrittenVersion v, Done done) ABSL_LOCKS_EXCLUDED(mu_);
  // Publishes everything submitted, then ends the thread.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

  // Groups published so far, and the versions in them (tests, metrics).
  size_t groups() const ABSL_LOCKS_EXCLUDED(mu_);
  size_t versions() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Item {
    WrittenVersion version;
    Done done;
  };
  void Loop() ABSL_LOCKS_EXCLUDED(mu_);
  void PublishGroup(std::deque<Item>* items) ABSL_LOCKS_EXCLUDED(mu_);

  LayerStore* const store_;
  const size_t max_group_;
  mutable absl::Mutex mu_;
  std::deque<Item> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  size_t groups_ ABSL_GUARDED_BY(mu_) = 0;
  size_t versions_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

}  // namespace ckpt
