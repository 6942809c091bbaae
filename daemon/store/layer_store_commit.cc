// LayerStore (layer_store.h): the commit protocol -- Write, the data
// written to a temp file; Publish, the group's data, names and records made
// durable and visible; Commit, both for one version -- and Remove, which
// takes a committed version away again.
#include <map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/status.h"
#include "daemon/common/kill_point.h"
#include "daemon/common/parallel.h"
#include "daemon/store/layer_store.h"
#include "daemon/store/layer_store_internal.h"

namespace ckpt {

using layer_store_internal::LeaseSegments;
using layer_store_internal::TempName;

static_assert(kChunkAlignment % kDirectAlignment == 0, "staging chunks are written with O_DIRECT");

namespace {

// A failed commit step's status, tagged with what failed (metric labels,
// logs); a full file system is a full disk whatever step met it.
absl::Status CommitFailure(absl::Status s, ErrorReason reason) {
  if (absl::IsResourceExhausted(s)) reason = ErrorReason::kDiskFull;
  return WithReason(std::move(s), reason);
}

}  // namespace

void LayerStore::DropTemp(int dir, UniqueFd* fd, const std::string& tmp_name) {
  IgnoreError(fd->Close(), "the version already failed");
  IgnoreError(fs_->Unlink(dir, tmp_name), "a leftover temp file is removed at the next start");
}

absl::StatusOr<store::VersionRecord> LayerStore::Commit(StagedVersion* v, IoBackend* io,
                                                        CommitTimings* timings) {
  std::vector<WrittenVersion> group;
  CKPT_ASSIGN_OR_RETURN(WrittenVersion w, Write(v, io));
  group.push_back(std::move(w));
  std::vector<absl::StatusOr<store::VersionRecord>> rec = Publish(&group);
  if (timings != nullptr) *timings = group[0].timings;
  return std::move(rec[0]);
}

absl::StatusOr<WrittenVersion> LayerStore::Write(StagedVersion* v, IoBackend* io) {
  WrittenVersion w;
  w.key = v->key;
  w.start = absl::Now();
  CKPT_ASSIGN_OR_RETURN(w.dir, RankDir(v->key.job, v->key.rank, /*create=*/true));
  const int dir = w.dir->get();

  // The payload's padding is final before a byte of it is written; its
  // checksums go into the header, written last (below).
  LeaseImage image(v->lease);
  ZeroPayloadGaps(v->header, v->layout, &image);

  const std::string final_name = FileName(v->key, v->generation);
  w.tmp_name = TempName(final_name);

  bool direct_used = false;
  CKPT_ASSIGN_OR_RETURN(w.fd, fs_->CreateExclusive(dir, w.tmp_name, use_direct_io_, &direct_used));
  auto fail = [&](absl::Status s, ErrorReason reason = ErrorReason::kWrite) {
    DropTemp(dir, &w.fd, w.tmp_name);
    return CommitFailure(std::move(s), reason);
  };
  if (absl::Status s = fs_->Allocate(w.fd.get(), v->layout.file_bytes); !s.ok()) return fail(s);
  CKPT_KILL_POINT("commit.before_write");

  // Checksums come from the staged bytes: exactly what is written. They are
  // computed while the payload is on its way to the disk (reading the bytes
  // the kernel is writing), so the disk does not wait for the CPU; the
  // header that holds them follows. Before, hashing came first and took
  // about 14 % of a commit's time on the development VM.
  const absl::Time write_start = absl::Now();
  absl::StatusOr<uint64_t> body_hash = absl::UnknownError("not encoded");
  auto hash = [&] {
    const absl::Time hash_start = absl::Now();
    for (store::TensorEntry& t : *v->header.mutable_tensors()) {
      t.set_xxh3(HashImage(image, v->layout.header_bytes + t.offset(), t.nbytes()));
    }
    v->header.set_created_unix_ms(absl::ToUnixMillis(absl::Now()));
    body_hash = EncodeHeaderRegion(v->header, v->layout, &image);
    w.timings.hash_seconds = absl::ToDoubleSeconds(absl::Now() - hash_start);
  };
  io->Submit(IoDirection::kWrite, w.fd.get(),
             LeaseSegments(v->lease, v->layout.header_bytes, v->layout.file_bytes));
  hash();
  if (absl::Status s = io->Wait(); !s.ok()) return fail(s);
  if (!body_hash.ok()) return fail(body_hash.status());
  if (absl::Status s = io->WriteAll(w.fd.get(), LeaseSegments(v->lease, 0, v->layout.header_bytes));
      !s.ok()) {
    return fail(s);
  }
  w.timings.write_seconds = absl::ToDoubleSeconds(absl::Now() - write_start);
  CKPT_KILL_POINT("commit.after_write");
  // Its fdatasync comes in Publish, with the group's others: the writer
  // goes on with the next version's bytes meanwhile.

  store::VersionRecord& rec = w.record;
  rec.set_file(final_name);
  rec.set_file_bytes(v->layout.file_bytes);
  rec.set_payload_bytes(v->layout.payload_bytes);
  rec.set_header_xxh3(*body_hash);
  rec.set_generation(v->generation);
  *rec.mutable_group_steps() = v->header.group_steps();
  return w;
}

std::vector<absl::Status> LayerStore::SyncData(std::vector<WrittenVersion>* group) {
  std::vector<absl::Status> synced(group->size());
  const absl::Time start = absl::Now();
  RunOnThreads(group->size(), kSyncThreads,
               [&](size_t i) { synced[i] = fs_->DataSync((*group)[i].fd.get()); });
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  for (WrittenVersion& w : *group) w.timings.sync_seconds = seconds;
  return synced;
}

std::vector<absl::StatusOr<store::VersionRecord>> LayerStore::Publish(
    std::vector<WrittenVersion>* group) {
  std::vector<absl::StatusOr<store::VersionRecord>> out;
  out.reserve(group->size());
  // First every version's data is made durable, the group's fdatasyncs at
  // once (the file system's journal commits them together). A failed
  // fdatasync is final for that data: the version fails, never retried.
  const std::vector<absl::Status> synced = SyncData(group);
  CKPT_KILL_POINT("commit.after_datasync");
  // Then each file gets its final name.
  for (size_t i = 0; i < group->size(); ++i) {
    WrittenVersion& w = (*group)[i];
    const int dir = w.dir->get();
    auto fail = [&](absl::Status s, ErrorReason reason = ErrorReason::kWrite) {
      DropTemp(dir, &w.fd, w.tmp_name);
      out.push_back(CommitFailure(std::move(s), reason));
    };
    if (!synced[i].ok()) {
      fail(synced[i], ErrorReason::kFsync);
      continue;
    }
    if (absl::Status s = w.fd.Close(); !s.ok()) {
      fail(s);
      continue;
    }
    if (absl::Status s = fs_->RenameNoReplace(dir, w.tmp_name, w.record.file()); !s.ok()) {
      fail(s);
      continue;
    }
    CKPT_KILL_POINT("commit.after_rename");
    out.push_back(w.record);
  }
  auto fail_renamed = [&](size_t i, const absl::Status& s, ErrorReason reason) {
    const WrittenVersion& w = (*group)[i];
    IgnoreError(fs_->Unlink(w.dir->get(), w.record.file()),
                "an orphan file is removed at the next start");
    out[i] = CommitFailure(s, reason);
  };
  // Then the names are durable: one fsync per rank directory of the group.
  std::map<int, absl::Status> dir_synced;
  for (size_t i = 0; i < group->size(); ++i) {
    if (!out[i].ok()) continue;
    auto [it, first] = dir_synced.try_emplace((*group)[i].dir->get());
    if (first) {
      it->second = fs_->SyncDir(it->first);
      CKPT_KILL_POINT("commit.after_dirsync");
    }
    if (!it->second.ok()) fail_renamed(i, it->second, ErrorReason::kFsync);
  }
  // Then the records, in one synchronous batch: the versions are visible.
  std::vector<VersionKey> keys;
  std::vector<store::VersionRecord> records;
  const int64_t now_ms = absl::ToUnixMillis(absl::Now());
  for (size_t i = 0; i < group->size(); ++i) {
    if (!out[i].ok()) continue;
    out[i]->set_committed_unix_ms(now_ms);
    keys.push_back((*group)[i].key);
    records.push_back(*out[i]);
  }
  if (!keys.empty()) {
    if (absl::Status s = index_->PutVersions(keys, records); !s.ok()) {
      for (size_t i = 0; i < group->size(); ++i) {
        if (out[i].ok()) fail_renamed(i, s, ErrorReason::kIndex);
      }
    } else {
      CKPT_KILL_POINT("commit.after_index");
    }
  }
  const absl::Time end = absl::Now();
  for (WrittenVersion& w : *group) w.timings.total_seconds = absl::ToDoubleSeconds(end - w.start);
  return out;
}

absl::Status LayerStore::Remove(const VersionKey& key, const store::VersionRecord& rec) {
  CKPT_RETURN_IF_ERROR(index_->DeleteVersion(key));
  absl::StatusOr<DirRef> dir = RankDir(key.job, key.rank, /*create=*/false);
  if (!dir.ok()) return absl::IsNotFound(dir.status()) ? absl::OkStatus() : dir.status();
  absl::Status s = fs_->Unlink((*dir)->get(), rec.file());
  if (!s.ok() && !absl::IsNotFound(s)) return s;
  return fs_->SyncDir((*dir)->get());
}

}  // namespace ckpt
