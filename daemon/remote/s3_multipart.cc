#include "daemon/remote/s3_multipart.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/logging.h"
#include "base/status.h"
#include "daemon/remote/s3_options.h"
#include "daemon/remote/s3_xml.h"

namespace ckpt::remote::s3_internal {

absl::Status PreadFull(int fd, char* buf, size_t len, uint64_t offset) {
  size_t done = 0;
  while (done < len) {
    const ssize_t n = ::pread(fd, buf + done, len - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoStatus(errno, "reading the file to upload");
    if (n == 0) {
      return absl::InvalidArgumentError(absl::StrCat("the file to upload ends at byte ",
                                                     offset + done, ", before the size given"));
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

namespace {

// One part transfer of a multipart upload.
struct PartSlot {
  enum class State { kIdle, kRunning, kWaiting };
  EasyLease easy;
  std::unique_ptr<char[]> buffer;
  State state = State::kIdle;
  uint64_t part = 0;  // 0-based index
  unsigned attempt = 0;
  absl::Time not_before;
  Request request;
  Transfer transfer;

  explicit PartSlot(HandlePool* pool) : easy(pool) {}
};

// Removes every running transfer from the multi handle on the way out, so
// that the handles go back to the pool detached.
class MultiSession {
 public:
  explicit MultiSession(std::vector<std::unique_ptr<PartSlot>>* slots)
      : multi_(curl_multi_init()), slots_(slots) {}
  ~MultiSession() {
    for (auto& slot : *slots_) {
      if (slot->state == PartSlot::State::kRunning) {
        curl_multi_remove_handle(multi_.get(), slot->easy.get());
        slot->state = PartSlot::State::kIdle;
      }
    }
  }
  MultiSession(const MultiSession&) = delete;
  MultiSession& operator=(const MultiSession&) = delete;
  CURLM* get() const { return multi_.get(); }

 private:
  MultiPtr multi_;
  std::vector<std::unique_ptr<PartSlot>>* slots_;
};

// Uploads every part of one multipart upload through one multi handle: a
// loop that starts parts on idle slots and due retries, lets curl run, takes
// the finished parts, and sleeps until there is something to do. Used once,
// by one thread.
class PartUploader {
 public:
  PartUploader(Transport* transport, const std::string& full_key, const std::string& upload_id,
               int fd, uint64_t size, uint64_t part_size)
      : transport_(transport),
        options_(transport->options()),
        full_key_(full_key),
        upload_id_(upload_id),
        fd_(fd),
        size_(size),
        part_size_(part_size),
        parts_((size + part_size - 1) / part_size) {}

  // Uploads every part; fills `etags` (index = part number - 1). The status
  // of the first part that failed for good, naming it.
  absl::Status Run(std::vector<std::string>* etags);

 private:
  // Reads the next part into `slot`'s buffer and starts it.
  absl::Status StartNextPart(PartSlot* slot);
  // (Re)starts the transfer of `slot`'s part.
  absl::Status Start(PartSlot* slot);
  // Starts a part on each idle slot and each retry that is due; lowers
  // *earliest_retry to the retries that are not.
  absl::Status StartSlots(absl::Time* earliest_retry);
  // Takes every transfer curl has finished.
  absl::Status CollectFinished(absl::Time* earliest_retry);
  // One finished attempt of `slot`'s part: its ETag kept, a retry scheduled
  // (lowering *earliest_retry), or the error that ends the upload.
  absl::Status FinishAttempt(PartSlot* slot, CURLcode rc, absl::Time* earliest_retry);
  // Sleeps until a socket is ready, a retry is due, or at most 1 s.
  absl::Status Poll(absl::Time earliest_retry);

  Transport* const transport_;
  const S3Options& options_;
  const std::string& full_key_;
  const std::string& upload_id_;
  const int fd_;
  const uint64_t size_;
  const uint64_t part_size_;
  const uint64_t parts_;

  std::vector<std::string>* etags_ = nullptr;
  // Declared before multi_, which detaches them before they are destroyed.
  std::vector<std::unique_ptr<PartSlot>> slots_;
  MultiSession multi_{&slots_};
  uint64_t next_part_ = 0;
  uint64_t parts_done_ = 0;
};

absl::Status PartUploader::Run(std::vector<std::string>* etags) {
  etags_ = etags;
  etags_->assign(parts_, std::string());
  const size_t slot_count =
      static_cast<size_t>(std::min<uint64_t>(options_.parallel_parts, parts_));
  for (size_t i = 0; i < slot_count; ++i) {
    slots_.push_back(std::make_unique<PartSlot>(transport_->pool()));
    if (slots_.back()->easy.get() == nullptr) {
      return absl::ResourceExhaustedError("curl_easy_init failed");
    }
  }
  if (multi_.get() == nullptr) return absl::ResourceExhaustedError("curl_multi_init failed");

  while (parts_done_ < parts_) {
    absl::Time earliest_retry = absl::InfiniteFuture();
    CKPT_RETURN_IF_ERROR(StartSlots(&earliest_retry));
    int running = 0;
    const CURLMcode mc = curl_multi_perform(multi_.get(), &running);
    if (mc != CURLM_OK) {
      return absl::InternalError(absl::StrCat("curl_multi_perform: ", curl_multi_strerror(mc)));
    }
    CKPT_RETURN_IF_ERROR(CollectFinished(&earliest_retry));
    if (parts_done_ == parts_) break;
    CKPT_RETURN_IF_ERROR(Poll(earliest_retry));
  }
  return absl::OkStatus();
}

absl::Status PartUploader::StartNextPart(PartSlot* slot) {
  const uint64_t offset = next_part_ * part_size_;
  const size_t len = static_cast<size_t>(std::min(part_size_, size_ - offset));
  if (slot->buffer == nullptr) slot->buffer.reset(new char[part_size_]);
  CKPT_RETURN_IF_ERROR(PreadFull(fd_, slot->buffer.get(), len, offset));
  slot->part = next_part_++;
  slot->attempt = 0;
  slot->request = Request();
  slot->request.method = "PUT";
  slot->request.key = full_key_;
  slot->request.query = {{"partNumber", absl::StrCat(slot->part + 1)}, {"uploadId", upload_id_}};
  slot->request.body = absl::string_view(slot->buffer.get(), len);
  slot->request.payload_sha256 = Sha256Hex(slot->request.body);
  return Start(slot);
}

absl::Status PartUploader::Start(PartSlot* slot) {
  ++slot->attempt;
  slot->transfer.easy = slot->easy.get();
  CKPT_RETURN_IF_ERROR(transport_->Prepare(slot->request, &slot->transfer));
  const CURLMcode mc = curl_multi_add_handle(multi_.get(), slot->easy.get());
  if (mc != CURLM_OK) {
    return absl::InternalError(absl::StrCat("curl_multi_add_handle: ", curl_multi_strerror(mc)));
  }
  slot->state = PartSlot::State::kRunning;
  return absl::OkStatus();
}

absl::Status PartUploader::StartSlots(absl::Time* earliest_retry) {
  const absl::Time now = absl::Now();
  for (auto& slot_ptr : slots_) {
    PartSlot* slot = slot_ptr.get();
    if (slot->state == PartSlot::State::kIdle && next_part_ < parts_) {
      CKPT_RETURN_IF_ERROR(StartNextPart(slot));
    } else if (slot->state == PartSlot::State::kWaiting) {
      if (now >= slot->not_before) {
        CKPT_RETURN_IF_ERROR(Start(slot));
      } else {
        *earliest_retry = std::min(*earliest_retry, slot->not_before);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status PartUploader::CollectFinished(absl::Time* earliest_retry) {
  int queued = 0;
  while (CURLMsg* msg = curl_multi_info_read(multi_.get(), &queued)) {
    if (msg->msg != CURLMSG_DONE) continue;
    PartSlot* slot = nullptr;
    for (auto& s : slots_) {
      if (s->easy.get() == msg->easy_handle) slot = s.get();
    }
    if (slot == nullptr) continue;
    const CURLcode rc = msg->data.result;
    curl_multi_remove_handle(multi_.get(), slot->easy.get());
    slot->state = PartSlot::State::kIdle;
    CKPT_RETURN_IF_ERROR(FinishAttempt(slot, rc, earliest_retry));
  }
  return absl::OkStatus();
}

absl::Status PartUploader::FinishAttempt(PartSlot* slot, CURLcode rc, absl::Time* earliest_retry) {
  bool retryable = false;
  absl::Status status = transport_->Classify(slot->request, &slot->transfer, rc, &retryable);
  if (status.ok() && slot->transfer.etag.empty()) {
    status = absl::UnavailableError(absl::StrCat("S3 PUT ", Sanitize(full_key_), " part ",
                                                 slot->part + 1, " at ", options_.endpoint,
                                                 ": no ETag in the answer"));
    retryable = true;
  }
  if (status.ok()) {
    (*etags_)[slot->part] = slot->transfer.etag;
    ++parts_done_;
    return absl::OkStatus();
  }
  if (!retryable || slot->attempt >= options_.max_attempts) {
    std::string where = absl::StrCat(" (part ", slot->part + 1);
    if (slot->attempt > 1) absl::StrAppend(&where, ", after ", slot->attempt, " attempts");
    return absl::Status(status.code(), absl::StrCat(status.message(), where, ")"));
  }
  const absl::Duration wait = transport_->Backoff(slot->attempt);
  CKPT_LOG(WARNING) << status.message() << "; part " << slot->part + 1 << " attempt "
                    << slot->attempt << " of " << options_.max_attempts << ", retrying in " << wait;
  slot->state = PartSlot::State::kWaiting;
  slot->not_before = absl::Now() + wait;
  *earliest_retry = std::min(*earliest_retry, slot->not_before);
  return absl::OkStatus();
}

absl::Status PartUploader::Poll(absl::Time earliest_retry) {
  absl::Duration timeout = absl::Seconds(1);
  if (earliest_retry != absl::InfiniteFuture()) {
    timeout = std::clamp(earliest_retry - absl::Now(), absl::ZeroDuration(), timeout);
  }
  const bool slot_free = std::any_of(slots_.begin(), slots_.end(), [&](const auto& s) {
    return s->state == PartSlot::State::kIdle && next_part_ < parts_;
  });
  if (slot_free) timeout = absl::ZeroDuration();
  const CURLMcode mc = curl_multi_poll(
      multi_.get(), nullptr, 0, static_cast<int>(absl::ToInt64Milliseconds(timeout)), nullptr);
  if (mc != CURLM_OK) {
    return absl::InternalError(absl::StrCat("curl_multi_poll: ", curl_multi_strerror(mc)));
  }
  return absl::OkStatus();
}

// The part size for `size` bytes: part_bytes, or, when that would take more
// than kMaxParts parts, larger parts in whole MiB.
absl::StatusOr<uint64_t> PartSize(const std::string& full_key, uint64_t size, uint64_t part_bytes) {
  uint64_t part_size = part_bytes;
  if ((size + part_size - 1) / part_size > kMaxParts) {
    constexpr uint64_t kMiB = uint64_t{1} << 20;
    part_size = ((size + kMaxParts - 1) / kMaxParts + kMiB - 1) / kMiB * kMiB;
    if (part_size > kMaxPartBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("S3 object ", Sanitize(full_key), " of ", size,
                       " bytes is over S3's limit (10000 parts of 5 GiB)"));
    }
  }
  return part_size;
}

// CreateMultipartUpload: the upload id.
absl::StatusOr<std::string> CreateUpload(Transport* transport, const std::string& full_key) {
  Request create;
  create.method = "POST";
  create.key = full_key;
  create.query = {{"uploads", ""}};
  Transfer created;
  CKPT_RETURN_IF_ERROR(transport->Execute(create, &created));
  std::optional<std::string> upload_id = ElementText(created.body, "UploadId");
  if (!upload_id.has_value() || upload_id->empty()) {
    return absl::UnavailableError(absl::StrCat("S3 POST ", Sanitize(full_key), " at ",
                                               transport->options().endpoint,
                                               ": no UploadId in the answer to "
                                               "CreateMultipartUpload"));
  }
  return std::move(*upload_id);
}

absl::Status CompleteMultipart(Transport* transport, const std::string& full_key,
                               const std::string& upload_id,
                               const std::vector<std::string>& etags) {
  std::string xml = "<CompleteMultipartUpload xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">";
  for (size_t i = 0; i < etags.size(); ++i) {
    absl::StrAppend(&xml, "<Part><PartNumber>", i + 1, "</PartNumber><ETag>", XmlEscape(etags[i]),
                    "</ETag></Part>");
  }
  absl::StrAppend(&xml, "</CompleteMultipartUpload>");
  Request request;
  request.method = "POST";
  request.key = full_key;
  request.query = {{"uploadId", upload_id}};
  request.headers = {{"content-type", "application/xml"}};
  request.body = xml;
  request.payload_sha256 = Sha256Hex(xml);
  request.error_in_ok_body = true;
  Transfer t;
  absl::Status status = transport->Execute(request, &t);
  if (status.code() == absl::StatusCode::kNotFound) {
    // NoSuchUpload: the upload is gone (an earlier attempt may even have
    // completed it); the caller uploads again.
    return absl::UnavailableError(
        absl::StrCat(status.message(), " (CompleteMultipartUpload; upload the object again)"));
  }
  return status;
}

void AbortMultipart(Transport* transport, const std::string& full_key,
                    const std::string& upload_id) {
  Request request;
  request.method = "DELETE";
  request.key = full_key;
  request.query = {{"uploadId", upload_id}};
  Transfer t;
  const absl::Status status = transport->Execute(request, &t);
  if (!status.ok() && status.code() != absl::StatusCode::kNotFound) {
    // The parts stay until a lifecycle rule or ListMultipartUploads removes them.
    CKPT_LOG(WARNING) << "AbortMultipartUpload failed: " << status.message();
  }
  IgnoreError(status, "the upload already failed; the parts left are garbage, not state");
}

}  // namespace

absl::Status PutMultipart(Transport* transport, const std::string& full_key, int fd,
                          uint64_t size) {
  CKPT_ASSIGN_OR_RETURN(const uint64_t part_size,
                        PartSize(full_key, size, transport->options().part_bytes));
  CKPT_ASSIGN_OR_RETURN(const std::string upload_id, CreateUpload(transport, full_key));
  std::vector<std::string> etags;
  absl::Status status;
  {
    // Its handles go back to the pool before the upload is completed.
    PartUploader uploader(transport, full_key, upload_id, fd, size, part_size);
    status = uploader.Run(&etags);
  }
  if (status.ok()) status = CompleteMultipart(transport, full_key, upload_id, etags);
  if (!status.ok()) AbortMultipart(transport, full_key, upload_id);
  return status;
}

}  // namespace ckpt::remote::s3_internal
