// What ckptd keeps in the remote tier and under which keys (docs/remote.md).
//
//   jobs/<job>/rank-<rank:8>/v/<file>        one layer version: the local
//                                            file's bytes (format.h), named
//                                            like the local file
//   jobs/<job>/rank-<rank:8>/m/S<step:16>    the step's manifest
//                                            (store.proto RemoteManifest)
//
// A manifest object is "CKPTMF\0\1", the XXH3-64 of the body (8 bytes,
// little-endian), then the serialized RemoteManifest. It is written after
// every object it names (with a conditional create where the store has
// one): a step is remote-durable exactly when its manifest exists. Objects
// are checked on read: the manifest by its checksum, each version by the
// file format's own checksums and the record's header_xxh3.
//
// Thread-safety: free functions.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/store/store.pb.h"

namespace ckpt::remote {

// The largest manifest ckptd reads back (a table of 100k tensors and a 1 MiB
// aux blob fit many times).
inline constexpr uint64_t kMaxManifestBytes = uint64_t{64} << 20;

std::string JobsPrefix();                                    // "jobs/"
std::string JobPrefix(const std::string& job);               // "jobs/<job>/"
std::string RankPrefix(const std::string& job, uint32_t rank);
std::string VersionObjectKey(const std::string& job, uint32_t rank, const std::string& file);
std::string ManifestPrefix(const std::string& job, uint32_t rank);
std::string ManifestKey(const std::string& job, uint32_t rank, uint64_t step);

// Parse keys as List returns them. False for anything else.
bool ParseManifestKey(const std::string& key, const std::string& job, uint32_t rank,
                      uint64_t* step);
bool ParseVersionObjectKey(const std::string& key, const std::string& job, uint32_t rank,
                           std::string* file);
// The generation in a version file's name (L...-S...-G<gen>.ckv).
bool GenerationOfFile(const std::string& file, uint64_t* generation);
// "jobs/<job>/rank-<rank:8>/..." -> job and rank; false for anything else.
bool ParseRankOfKey(const std::string& key, std::string* job, uint32_t* rank);

std::string EncodeManifest(const store::RemoteManifest& manifest);
// DATA_LOSS when the magic, the checksum or the body is wrong.
absl::StatusOr<store::RemoteManifest> DecodeManifest(const std::string& bytes);

}  // namespace ckpt::remote
