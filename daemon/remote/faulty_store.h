// FaultyStore: a RemoteStore twin that forwards to a real backend and fails,
// on demand, the way a remote tier fails: the store down (every call
// UNAVAILABLE), the next N uploads refused with a chosen status, a hook
// before each upload (a test's sync point, to stop the store mid-upload).
// Counts the calls of each kind. Used by the engine tests; ckptd itself
// never builds one.
//
// Thread-safety: thread-safe.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>

#include "absl/synchronization/mutex.h"
#include "daemon/remote/remote_store.h"

namespace ckpt::remote {

class FaultyStore final : public RemoteStore {
 public:
  explicit FaultyStore(RemoteStore* base) : base_(base) {}

  // While down, every call returns UNAVAILABLE without reaching the base.
  void set_down(bool down) { down_.store(down); }
  // The next `n` PutFile/PutBytes calls fail with `status` (not reaching the
  // base).
  void FailPuts(int n, absl::Status status);
  // The `skip`+1-th next GetToFile fails with `status`, after `skip` that
  // go through (not reaching the base).
  void FailGetAfter(int skip, absl::Status status);
  // Called with the key before every PutFile/PutBytes that reaches the base.
  void set_before_put(std::function<void(const std::string& key)> hook);

  uint64_t puts() const { return puts_.load(); }
  uint64_t gets() const { return gets_.load(); }
  uint64_t lists() const { return lists_.load(); }
  uint64_t deletes() const { return deletes_.load(); }

  std::string Describe() const override { return "faulty " + base_->Describe(); }
  absl::Status PutFile(const std::string& key, int fd, uint64_t size) override;
  absl::Status PutBytes(const std::string& key, std::string_view data, bool if_absent) override;
  absl::StatusOr<uint64_t> GetToFile(const std::string& key, int fd, uint64_t max_bytes) override;
  absl::StatusOr<std::string> GetBytes(const std::string& key, uint64_t max_bytes) override;
  absl::StatusOr<std::vector<ObjectInfo>> List(const std::string& prefix) override;
  absl::Status Delete(const std::string& key) override;

 private:
  // OK when the call may go to the base.
  absl::Status BeforePut(const std::string& key);
  absl::Status CheckUp() const;

  RemoteStore* const base_;
  std::atomic<bool> down_{false};
  std::atomic<uint64_t> puts_{0}, gets_{0}, lists_{0}, deletes_{0};
  absl::Mutex mu_;
  int fail_puts_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status fail_status_ ABSL_GUARDED_BY(mu_);
  std::function<void(const std::string&)> before_put_ ABSL_GUARDED_BY(mu_);
  int get_skip_ ABSL_GUARDED_BY(mu_) = -1;  // -1: no get failure armed
  absl::Status get_status_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ckpt::remote
