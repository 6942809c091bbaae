// What the remote tier's files (remote_tier.cc, remote_upload.cc,
// remote_gc.cc, remote_pull.cc) share: reading a manifest, and how a
// failure is labelled.
// Internal to RemoteTier.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/remote/remote_layout.h"
#include "daemon/remote/remote_store.h"

namespace ckpt::remote_tier {

// How long a pull or an upload waits for GC of the rank to finish.
inline constexpr absl::Duration kLeaseWait = absl::Seconds(30);

// The metric label of a failed remote operation.
const char* FailureLabel(const absl::Status& s);

// A manifest or object that is not there whole: the step it belongs to is
// not usable, but the store itself answered.
bool Unusable(const absl::Status& s);

// The version objects a manifest names.
std::vector<std::string> FilesOf(const store::RemoteManifest& m);

}  // namespace ckpt::remote_tier
