#include "daemon/remote/faulty_store.h"

namespace ckpt::remote {

void FaultyStore::FailPuts(int n, absl::Status status) {
  absl::MutexLock lock(&mu_);
  fail_puts_ = n;
  fail_status_ = std::move(status);
}

void FaultyStore::set_before_put(std::function<void(const std::string& key)> hook) {
  absl::MutexLock lock(&mu_);
  before_put_ = std::move(hook);
}

absl::Status FaultyStore::CheckUp() const {
  if (down_.load()) return absl::UnavailableError("the remote store is down (injected)");
  return absl::OkStatus();
}

absl::Status FaultyStore::BeforePut(const std::string& key) {
  puts_.fetch_add(1);
  if (absl::Status s = CheckUp(); !s.ok()) return s;
  std::function<void(const std::string&)> hook;
  {
    absl::MutexLock lock(&mu_);
    if (fail_puts_ > 0) {
      --fail_puts_;
      return fail_status_;
    }
    hook = before_put_;
  }
  if (hook) hook(key);
  // The hook may have taken the store down (a test stopping it mid-upload).
  return CheckUp();
}

absl::Status FaultyStore::PutFile(const std::string& key, int fd, uint64_t size) {
  if (absl::Status s = BeforePut(key); !s.ok()) return s;
  return base_->PutFile(key, fd, size);
}

absl::Status FaultyStore::PutBytes(const std::string& key, std::string_view data, bool if_absent) {
  if (absl::Status s = BeforePut(key); !s.ok()) return s;
  return base_->PutBytes(key, data, if_absent);
}

void FaultyStore::FailGetAfter(int skip, absl::Status status) {
  absl::MutexLock lock(&mu_);
  get_skip_ = skip;
  get_status_ = std::move(status);
}

absl::StatusOr<uint64_t> FaultyStore::GetToFile(const std::string& key, int fd,
                                                uint64_t max_bytes) {
  gets_.fetch_add(1);
  if (absl::Status s = CheckUp(); !s.ok()) return s;
  {
    absl::MutexLock lock(&mu_);
    if (get_skip_ == 0) {
      get_skip_ = -1;
      return get_status_;
    }
    if (get_skip_ > 0) --get_skip_;
  }
  return base_->GetToFile(key, fd, max_bytes);
}

absl::StatusOr<std::string> FaultyStore::GetBytes(const std::string& key, uint64_t max_bytes) {
  gets_.fetch_add(1);
  if (absl::Status s = CheckUp(); !s.ok()) return s;
  return base_->GetBytes(key, max_bytes);
}

absl::StatusOr<std::vector<ObjectInfo>> FaultyStore::List(const std::string& prefix) {
  lists_.fetch_add(1);
  if (absl::Status s = CheckUp(); !s.ok()) return s;
  return base_->List(prefix);
}

absl::Status FaultyStore::Delete(const std::string& key) {
  deletes_.fetch_add(1);
  if (absl::Status s = CheckUp(); !s.ok()) return s;
  return base_->Delete(key);
}

}  // namespace ckpt::remote
