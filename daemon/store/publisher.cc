#include "daemon/store/publisher.h"

#include <algorithm>
#include <vector>

#include "daemon/common/kill_point.h"

namespace ckpt {

Publisher::Publisher(LayerStore* store, size_t max_group)
    : store_(store), max_group_(std::max<size_t>(max_group, 1)) {
  thread_ = std::thread([this] { Loop(); });
}

Publisher::~Publisher() { Stop(); }

void Publisher::Submit(WrittenVersion v, Done done) {
  {
    absl::MutexLock lock(&mu_);
    if (!stop_) {
      queue_.push_back(Item{std::move(v), std::move(done)});
      return;
    }
  }
  std::deque<Item> alone;
  alone.push_back(Item{std::move(v), std::move(done)});
  PublishGroup(&alone);
}

void Publisher::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

size_t Publisher::groups() const {
  absl::MutexLock lock(&mu_);
  return groups_;
}

size_t Publisher::versions() const {
  absl::MutexLock lock(&mu_);
  return versions_;
}

void Publisher::Loop() {
  for (;;) {
    std::deque<Item> group;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !queue_.empty(); };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;  // stopping, and everything is published
      const size_t n = std::min(queue_.size(), max_group_);
      for (size_t i = 0; i < n; ++i) {
        group.push_back(std::move(queue_.front()));
        queue_.pop_front();
      }
    }
    // A test holds the publisher here to let a group build up.
    CKPT_DELAY_POINT("publisher.before_group");
    PublishGroup(&group);
  }
}

void Publisher::PublishGroup(std::deque<Item>* items) {
  std::vector<WrittenVersion> group;
  group.reserve(items->size());
  for (Item& item : *items) group.push_back(std::move(item.version));
  std::vector<absl::StatusOr<store::VersionRecord>> results = store_->Publish(&group);
  {
    absl::MutexLock lock(&mu_);
    ++groups_;
    versions_ += group.size();
  }
  for (size_t i = 0; i < group.size(); ++i) {
    std::move((*items)[i].done)(std::move(results[i]), group[i].timings);
  }
}

}  // namespace ckpt
