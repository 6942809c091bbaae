#include "daemon/remote/remote_auth.h"

#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/params.h>
#include <openssl/rand.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <memory>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status.h"
#include "base/unique_fd.h"

namespace ckpt::remote {
namespace {

constexpr size_t kReadBuffer = 1 << 20;

struct MacCtxFree {
  void operator()(EVP_MAC_CTX* c) const { EVP_MAC_CTX_free(c); }
};
struct MacFree {
  void operator()(EVP_MAC* m) const { EVP_MAC_free(m); }
};

// An HMAC-SHA256 context keyed with `secret`, fed with `purpose` and a NUL.
std::unique_ptr<EVP_MAC_CTX, MacCtxFree> BeginHmac(const std::string& secret,
                                                   std::string_view purpose) {
  std::unique_ptr<EVP_MAC, MacFree> mac(EVP_MAC_fetch(nullptr, "HMAC", nullptr));
  if (mac == nullptr) return nullptr;
  std::unique_ptr<EVP_MAC_CTX, MacCtxFree> ctx(EVP_MAC_CTX_new(mac.get()));
  if (ctx == nullptr) return nullptr;
  char digest[] = "SHA256";
  OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string("digest", digest, 0),
                         OSSL_PARAM_construct_end()};
  if (EVP_MAC_init(ctx.get(), reinterpret_cast<const unsigned char*>(secret.data()), secret.size(),
                   params) != 1) {
    return nullptr;
  }
  const unsigned char nul = 0;
  if (EVP_MAC_update(ctx.get(), reinterpret_cast<const unsigned char*>(purpose.data()),
                     purpose.size()) != 1 ||
      EVP_MAC_update(ctx.get(), &nul, 1) != 1) {
    return nullptr;
  }
  return ctx;
}

// A Poly1305 context keyed with the 32-byte one-time `key`.
std::unique_ptr<EVP_MAC_CTX, MacCtxFree> BeginPoly1305(const std::string& key) {
  std::unique_ptr<EVP_MAC, MacFree> mac(EVP_MAC_fetch(nullptr, "POLY1305", nullptr));
  if (mac == nullptr) return nullptr;
  std::unique_ptr<EVP_MAC_CTX, MacCtxFree> ctx(EVP_MAC_CTX_new(mac.get()));
  if (ctx == nullptr || key.size() != 32 ||
      EVP_MAC_init(ctx.get(), reinterpret_cast<const unsigned char*>(key.data()), key.size(),
                   nullptr) != 1) {
    return nullptr;
  }
  return ctx;
}

std::string Finish(EVP_MAC_CTX* ctx) {
  unsigned char out[EVP_MAX_MD_SIZE];
  size_t len = 0;
  if (EVP_MAC_final(ctx, out, &len, sizeof(out)) != 1 || len != RemoteKey::kMacBytes) return "";
  return std::string(reinterpret_cast<char*>(out), len);
}

}  // namespace

bool MacEqual(std::string_view a, std::string_view b) {
  return a.size() == b.size() && !a.empty() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

absl::StatusOr<RemoteKey> RemoteKey::FromSecret(std::string secret) {
  if (secret.size() < kMinSecretBytes) {
    return absl::InvalidArgumentError(absl::StrCat("the remote tier's key must hold at least ",
                                                   kMinSecretBytes, " bytes, not ", secret.size()));
  }
  return RemoteKey(std::move(secret));
}

absl::StatusOr<std::string> ReadSecretFile(const char* setting, const std::string& path,
                                           size_t max_bytes) {
  // O_NONBLOCK: a FIFO planted in its place must not block start-up.
  UniqueFd fd(open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
  if (!fd.valid()) {
    if (errno == ENOENT)
      return absl::NotFoundError(absl::StrCat(setting, " ", path, " does not exist"));
    if (errno == ELOOP) {
      return absl::FailedPreconditionError(
          absl::StrCat(setting, " ", path, " is a symbolic link; name the file itself"));
    }
    return ErrnoStatus(errno, absl::StrCat("open ", setting, " ", path));
  }
  struct stat st;
  if (fstat(fd.get(), &st) != 0) return ErrnoStatus(errno, absl::StrCat("stat ", path));
  if (!S_ISREG(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(setting, " ", path, " is not a file"));
  }
  if ((st.st_mode & 077) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(setting, " ", path, " may be read or written by others (mode ",
                     absl::StrFormat("%04o", st.st_mode & 07777), "); chmod 600 it"));
  }
  if (st.st_uid != geteuid() && st.st_uid != 0) {
    return absl::FailedPreconditionError(absl::StrCat(setting, " ", path, " belongs to uid ",
                                                      st.st_uid, ", neither ckptd's nor root"));
  }
  if (static_cast<uint64_t>(st.st_size) > max_bytes) {
    return absl::FailedPreconditionError(
        absl::StrCat(setting, " ", path, " holds more than ", max_bytes, " bytes"));
  }
  std::string secret(static_cast<size_t>(st.st_size), '\0');
  size_t done = 0;
  while (done < secret.size()) {
    ssize_t r =
        pread(fd.get(), secret.data() + done, secret.size() - done, static_cast<off_t>(done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return ErrnoStatus(errno, absl::StrCat("read ", path));
    if (r == 0) break;
    done += static_cast<size_t>(r);
  }
  secret.resize(done);
  return secret;
}

absl::StatusOr<RemoteKey> RemoteKey::FromFile(const std::string& path) {
  CKPT_ASSIGN_OR_RETURN(std::string secret,
                        ReadSecretFile("remote_key_file", path, kMaxSecretBytes));
  while (!secret.empty() && (secret.back() == '\n' || secret.back() == '\r')) secret.pop_back();
  absl::StatusOr<RemoteKey> key = FromSecret(std::move(secret));
  if (!key.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("remote_key_file ", path, ": ", key.status().message(),
                     " (make one with: head -c 32 /dev/urandom | base64 > FILE)"));
  }
  return key;
}

std::string RemoteKey::Mac(std::string_view purpose, std::string_view data) const {
  auto ctx = BeginHmac(secret_, purpose);
  if (ctx == nullptr ||
      EVP_MAC_update(ctx.get(), reinterpret_cast<const unsigned char*>(data.data()), data.size()) !=
          1) {
    return "";
  }
  return Finish(ctx.get());
}

absl::StatusOr<std::string> RemoteKey::MacOfFile(std::string_view purpose, int fd,
                                                 uint64_t size) const {
  auto ctx = BeginHmac(secret_, purpose);
  if (ctx == nullptr) return absl::InternalError("HMAC-SHA256 is not available in OpenSSL");
  std::string buf(static_cast<size_t>(std::min<uint64_t>(kReadBuffer, size)), '\0');
  uint64_t done = 0;
  while (done < size) {
    const size_t want = static_cast<size_t>(std::min<uint64_t>(buf.size(), size - done));
    ssize_t r = pread(fd, buf.data(), want, static_cast<off_t>(done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return ErrnoStatus(errno, "read for the MAC");
    if (r == 0)
      return absl::DataLossError(absl::StrCat("short file: ", done, " of ", size, " bytes"));
    if (EVP_MAC_update(ctx.get(), reinterpret_cast<const unsigned char*>(buf.data()),
                       static_cast<size_t>(r)) != 1) {
      return absl::InternalError("HMAC-SHA256 failed in OpenSSL");
    }
    done += static_cast<uint64_t>(r);
  }
  std::string mac = Finish(ctx.get());
  if (mac.empty()) return absl::InternalError("HMAC-SHA256 failed in OpenSSL");
  return mac;
}

bool RemoteKey::Verify(std::string_view purpose, std::string_view data,
                       std::string_view mac) const {
  return MacEqual(Mac(purpose, data), mac);
}

std::string RemoteKey::Fingerprint() const {
  return absl::BytesToHexString(Mac("fingerprint", "").substr(0, 6));
}

namespace {
constexpr size_t kNonceBytes = 16;
constexpr size_t kTagBytes = 16;
static_assert(ObjectMac::kObjectMacBytes == 1 + kNonceBytes + kTagBytes);
}  // namespace

absl::StatusOr<ObjectMac> ObjectMac::Begin(const RemoteKey& key) {
  std::string nonce(kNonceBytes, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(nonce.data()), kNonceBytes) != 1) {
    return absl::InternalError("OpenSSL could not make a nonce");
  }
  return ForCheck(key, std::string(1, kFormat) + nonce + std::string(kTagBytes, '\0'));
}

absl::StatusOr<ObjectMac> ObjectMac::ForCheck(const RemoteKey& key, std::string_view recorded) {
  ObjectMac out;
  std::unique_ptr<EVP_MAC_CTX, MacCtxFree> ctx;
  if (recorded.size() == kObjectMacBytes && recorded[0] == kFormat) {
    out.prefix_ = std::string(recorded.substr(0, 1 + kNonceBytes));
    ctx = BeginPoly1305(key.Mac("object-key", recorded.substr(1, kNonceBytes)));
  } else if (recorded.size() == RemoteKey::kMacBytes) {
    ctx = BeginHmac(key.secret_, "object");
  } else {
    return absl::DataLossError(
        absl::StrCat("an object MAC of ", recorded.size(), " bytes is of no form ckptd writes"));
  }
  if (ctx == nullptr) return absl::InternalError("Poly1305 or HMAC-SHA256 is not in OpenSSL");
  out.ctx_ = ctx.release();
  return out;
}

ObjectMac::ObjectMac(ObjectMac&& other) noexcept { *this = std::move(other); }

ObjectMac& ObjectMac::operator=(ObjectMac&& other) noexcept {
  if (this != &other) {
    EVP_MAC_CTX_free(ctx_);
    ctx_ = std::exchange(other.ctx_, nullptr);
    prefix_ = std::move(other.prefix_);
    failed_ = other.failed_;
  }
  return *this;
}

ObjectMac::~ObjectMac() { EVP_MAC_CTX_free(ctx_); }

void ObjectMac::Update(std::string_view bytes) {
  if (ctx_ == nullptr || failed_ || bytes.empty()) return;
  if (EVP_MAC_update(ctx_, reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size()) !=
      1) {
    failed_ = true;
  }
}

std::string ObjectMac::Finish() {
  if (ctx_ == nullptr || failed_) return "";
  unsigned char out[EVP_MAX_MD_SIZE];
  size_t len = 0;
  const size_t want = prefix_.empty() ? RemoteKey::kMacBytes : kTagBytes;
  const bool ok = EVP_MAC_final(ctx_, out, &len, sizeof(out)) == 1 && len == want;
  EVP_MAC_CTX_free(std::exchange(ctx_, nullptr));
  if (!ok) return "";
  return prefix_ + std::string(reinterpret_cast<char*>(out), len);
}

bool ObjectMac::Matches(std::string_view recorded) { return MacEqual(Finish(), recorded); }

}  // namespace ckpt::remote
