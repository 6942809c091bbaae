// RemoteKey: the cluster key that authenticates what ckptd writes to the
// remote tier, so that a manifest, an object or a job's owner record that
// no ckptd of the cluster wrote is never served (docs/remote.md, "Trust").
//
// A remote tier may be writable by more than ckptd: an object store's
// bucket by anyone holding its credentials, a shared directory by a careless
// mode. ckptd therefore signs everything it writes there with HMAC-SHA256
// under a secret every node of the cluster shares (remote_key_file, a
// credential file): each manifest and owner record carries its MAC, and
// each manifest carries the MAC of every version object it names. A reader
// checks the MAC before it trusts a byte; a file-format checksum (XXH3) is
// no defence against someone who can write the store.
//
// Every MAC is domain-separated by a purpose ("manifest", "object",
// "owner"), so bytes signed for one use are never accepted for another.
// Version objects, the bulk of the bytes, get a faster MAC (ObjectMac,
// below) taken in the same pass as the bytes are sent or received.
//
// Thread-safety: immutable after construction; safe to share.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

struct evp_mac_ctx_st;

namespace ckpt::remote {

class RemoteKey {
 public:
  static constexpr size_t kMacBytes = 32;  // HMAC-SHA256
  static constexpr size_t kMinSecretBytes = 32;
  static constexpr size_t kMaxSecretBytes = 4096;

  // Reads the secret from `path`: a regular file (never a link or a FIFO)
  // that only its owner may read or write (mode 0600 or stricter), holding
  // at least kMinSecretBytes after trimming a final newline.
  // FAILED_PRECONDITION naming the path otherwise; NOT_FOUND when missing.
  static absl::StatusOr<RemoteKey> FromFile(const std::string& path);
  // INVALID_ARGUMENT when shorter than kMinSecretBytes.
  static absl::StatusOr<RemoteKey> FromSecret(std::string secret);

  // The MAC of `data` for `purpose`: kMacBytes raw bytes.
  std::string Mac(std::string_view purpose, std::string_view data) const;
  // The MAC of the first `size` bytes of `fd` (read with pread from 0).
  // DATA_LOSS when the file is shorter; the read's errno otherwise.
  absl::StatusOr<std::string> MacOfFile(std::string_view purpose, int fd, uint64_t size) const;
  // Whether `mac` is the MAC of `data` (compared in constant time).
  bool Verify(std::string_view purpose, std::string_view data, std::string_view mac) const;
  // A short public name of the key (the first bytes of the MAC of nothing),
  // for logs: never the secret.
  std::string Fingerprint() const;

 private:
  friend class ObjectMac;
  explicit RemoteKey(std::string secret) : secret_(std::move(secret)) {}
  std::string secret_;
};

// ObjectMac: the MAC a manifest records for one version object, fed the
// object's bytes in order as they are sent or received, so the object is
// read once (docs/remote.md, "Trust").
//
// Recorded form (kObjectMacBytes): the format byte 2, a random 16-byte
// nonce, and the Poly1305 tag of the bytes under the one-time key
// HMAC-SHA256(secret, "object-key" NUL nonce). Poly1305 takes a fresh key
// per message to be a MAC, which the nonce gives; it runs at about seven
// times HMAC-SHA256's speed (12.8 against 1.8 GB/s on one core of the
// machine the figures in docs/peer.md come from). Manifests written
// before it record HMAC-SHA256 under purpose "object" (kMacBytes, the
// legacy form); Check accepts both.
//
// Thread-safety: one object per thread.
class ObjectMac {
 public:
  static constexpr size_t kObjectMacBytes = 1 + 16 + 16;
  static constexpr char kFormat = 2;

  // The MAC of a new object: a fresh nonce. INTERNAL when OpenSSL lacks
  // the primitives.
  static absl::StatusOr<ObjectMac> Begin(const RemoteKey& key);
  // Recomputes the MAC a manifest recorded (`recorded`, either form) over
  // bytes fed afterwards; DATA_LOSS when it is of neither form.
  static absl::StatusOr<ObjectMac> ForCheck(const RemoteKey& key, std::string_view recorded);

  ObjectMac(ObjectMac&& other) noexcept;
  ObjectMac& operator=(ObjectMac&& other) noexcept;
  ObjectMac(const ObjectMac&) = delete;
  ObjectMac& operator=(const ObjectMac&) = delete;
  ~ObjectMac();

  void Update(std::string_view bytes);
  // The recorded form over everything fed; "" when OpenSSL failed.
  std::string Finish();
  // Finish() equals `recorded` (constant time).
  bool Matches(std::string_view recorded);

 private:
  ObjectMac() = default;
  evp_mac_ctx_st* ctx_ = nullptr;
  std::string prefix_;  // the format byte and nonce; empty for the legacy form
  bool failed_ = false;
};

// The contents of a credential file: a regular file (not a link, a FIFO
// or a device), readable by its owner only, owned by ckptd's uid or root,
// at most `max_bytes` long. `setting` names it in errors (the path, never
// the contents).
absl::StatusOr<std::string> ReadSecretFile(const char* setting, const std::string& path,
                                           size_t max_bytes);

// Whether two MACs are equal, in time that does not depend on where they
// differ.
bool MacEqual(std::string_view a, std::string_view b);

}  // namespace ckpt::remote
