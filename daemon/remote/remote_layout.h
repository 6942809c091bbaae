// What ckptd keeps in the remote tier and under which keys (docs/remote.md).
//
//   jobs/<job>/rank-<rank:8>/v/<file>        one layer version: the local
//                                            file's bytes (format.h), named
//                                            like the local file
//   jobs/<job>/rank-<rank:8>/m/S<step:16>    the step's manifest
//                                            (store.proto RemoteManifest)
//   jobs/<job>/owner                         the uid the job belongs to on
//                                            every node (store.proto RemoteJob)
//
// A manifest object is "CKPTMF\0\2", the HMAC-SHA256 of the body under the
// cluster key (remote_auth.h, purpose "manifest", 32 bytes), then the
// serialized RemoteManifest. It is written after every object it names (with
// a conditional create where the store has one): a step is remote-durable
// exactly when its manifest exists. An owner record is "CKPTJO\0\1", its MAC
// (purpose "owner") and the serialized RemoteJob, created once with a
// conditional create. Everything is checked on read: a manifest or owner
// record by its MAC, each version object by the MAC its manifest records
// (purpose "object") and then by the file format's own checksums.
//
// Thread-safety: free functions.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/remote/remote_auth.h"
#include "daemon/store/store.pb.h"

namespace ckpt::remote {

// The largest manifest ckptd reads back (a table of 100k tensors and a 1 MiB
// aux blob fit many times).
inline constexpr uint64_t kMaxManifestBytes = uint64_t{64} << 20;

std::string JobsPrefix();                       // "jobs/"
std::string JobPrefix(const std::string& job);  // "jobs/<job>/"
std::string RankPrefix(const std::string& job, uint32_t rank);
std::string VersionObjectKey(const std::string& job, uint32_t rank, const std::string& file);
std::string ManifestPrefix(const std::string& job, uint32_t rank);
std::string ManifestKey(const std::string& job, uint32_t rank, uint64_t step);
std::string OwnerKey(const std::string& job);  // "jobs/<job>/owner"

// INVALID_ARGUMENT unless `key` is one every backend can hold: relative,
// '/'-separated, at most kMaxKeyBytes, no empty, ".", ".." or ".tmp.*"
// component (POSIX temp files), no NUL.
inline constexpr size_t kMaxKeyBytes = 1024;
absl::Status CheckObjectKey(absl::string_view key);

// Parse keys as List returns them. False for anything else.
bool ParseManifestKey(const std::string& key, const std::string& job, uint32_t rank,
                      uint64_t* step);
bool ParseVersionObjectKey(const std::string& key, const std::string& job, uint32_t rank,
                           std::string* file);
// The generation in a version file's name (L...-S...-G<gen>.ckv).
bool GenerationOfFile(const std::string& file, uint64_t* generation);
// "jobs/<job>/rank-<rank:8>/..." -> job and rank; false for anything else.
bool ParseRankOfKey(const std::string& key, std::string* job, uint32_t* rank);

std::string EncodeManifest(const store::RemoteManifest& manifest, const RemoteKey& key);
// DATA_LOSS when the magic, the format version, the MAC or the body is wrong.
absl::StatusOr<store::RemoteManifest> DecodeManifest(const std::string& bytes,
                                                     const RemoteKey& key);
std::string EncodeOwner(const store::RemoteJob& job, const RemoteKey& key);
absl::StatusOr<store::RemoteJob> DecodeOwner(const std::string& bytes, const RemoteKey& key);

}  // namespace ckpt::remote
