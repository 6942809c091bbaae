// ckpt_bench paths B and D (ckpt_bench.h): the raw baselines. B writes the
// same payload bytes as path A, sequentially with O_DIRECT, one file per
// writer, through the same IoBackend kind, chunk size and queue depth, then
// fdatasync; D reads B's files back, one thread per rank, each a contiguous
// share kept in one queue (the most a reader gets from this disk).
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/status.h"
#include "tools/ckpt_bench.h"

namespace ckpt::bench {

std::string Bench::RawName(uint32_t w) { return absl::StrCat("raw.", w, ".bench"); }

uint64_t Bench::RawFileBytes(uint32_t w) const {
  const uint64_t blocks = versions_ / a_.writers + (w < versions_ % a_.writers ? 1 : 0);
  return AlignUp(blocks * a_.layer_bytes, kDirectAlignment);
}

absl::Status Bench::WriteRawFile(uint32_t w, std::vector<char>* created) {
  const uint64_t size = RawFileBytes(w);
  bool direct_used = false;
  CKPT_ASSIGN_OR_RETURN(UniqueFd fd,
                        fs_->CreateExclusive(dir_fd_.get(), RawName(w), true, &direct_used));
  (*created)[w] = 1;  // one element per thread
  const StagingLease& lease = leases_[w];
  std::vector<IoSegment> segs;
  segs.reserve(size / a_.chunk_bytes + 1);
  for (uint64_t off = 0, k = 0; off < size; off += a_.chunk_bytes, ++k) {
    segs.push_back(
        IoSegment{lease.chunk(k % lease.chunk_count()), std::min(a_.chunk_bytes, size - off), off});
  }
  CKPT_RETURN_IF_ERROR(io_[w]->WriteAll(fd.get(), segs));
  CKPT_RETURN_IF_ERROR(fs_->DataSync(fd.get()));
  return fd.Close();
}

absl::StatusOr<absl::Duration> Bench::RunRaw() {
  absl::Mutex mu;
  absl::Status first_error;
  std::vector<char> created(a_.writers, 0);  // not vector<bool>: written concurrently
  absl::Duration d = TimeThreads(a_.writers, [&](uint32_t w) {
    absl::Status s = WriteRawFile(w, &created);
    if (!s.ok()) {
      absl::MutexLock lock(&mu);
      if (first_error.ok()) first_error = s;
    }
  });
  raw_created_ = std::move(created);
  if (!first_error.ok()) {
    IgnoreError(RemoveRaw(), "the round already failed");
    return first_error;
  }
  return d;
}

absl::Status Bench::RemoveRaw() {
  absl::Status first_error;
  for (uint32_t w = 0; w < raw_created_.size(); ++w) {
    if (!raw_created_[w]) continue;
    absl::Status s = fs_->Unlink(dir_fd_.get(), RawName(w));
    if (first_error.ok() && !s.ok()) first_error = s;
    raw_created_[w] = 0;
  }
  if (first_error.ok()) first_error = fs_->SyncDir(dir_fd_.get());
  return first_error;
}

absl::StatusOr<absl::Duration> Bench::RunRawRead() {
  struct Piece {
    uint32_t file;
    uint64_t offset, len;
  };
  std::vector<Piece> pieces;
  for (uint32_t w = 0; w < a_.writers; ++w) {
    if (!raw_created_[w]) return absl::FailedPreconditionError("read before a raw write round");
    const uint64_t size = RawFileBytes(w);
    for (uint64_t off = 0; off < size; off += a_.chunk_bytes) {
      pieces.push_back(Piece{w, off, std::min(a_.chunk_bytes, size - off)});
    }
  }
  std::vector<UniqueFd> fds;
  for (uint32_t w = 0; w < a_.writers; ++w) {
    bool direct_used = false;
    CKPT_ASSIGN_OR_RETURN(UniqueFd fd,
                          fs_->OpenForRead(dir_fd_.get(), RawName(w), true, &direct_used));
    fds.push_back(std::move(fd));
  }
  absl::Mutex mu;
  absl::Status first_error;
  const double cpu = ProcessCpuSeconds();
  absl::Duration d = TimeThreads(a_.ranks, [&](uint32_t r) {
    const size_t begin = pieces.size() * r / a_.ranks, end = pieces.size() * (r + 1) / a_.ranks;
    const StagingLease& lease = read_leases_[r];
    absl::Status s;
    for (size_t i = begin; i < end && s.ok();) {
      std::vector<IoSegment> segs;
      const uint32_t file = pieces[i].file;
      for (; i < end && pieces[i].file == file; ++i) {
        segs.push_back(IoSegment{lease.chunk(segs.size() % lease.chunk_count()), pieces[i].len,
                                 pieces[i].offset});
      }
      s = io_[r]->ReadAll(fds[file].get(), segs);
    }
    if (!s.ok()) {
      absl::MutexLock lock(&mu);
      if (first_error.ok()) first_error = s;
    }
  });
  raw_read_cpu_seconds_ = ProcessCpuSeconds() - cpu;
  CKPT_RETURN_IF_ERROR(first_error);
  return d;
}

// The raw files of an interrupted earlier run.
absl::Status Bench::RemoveRawLeftovers() {
  for (uint32_t w = 0; w < a_.writers; ++w) {
    absl::Status s = fs_->Unlink(dir_fd_.get(), RawName(w));
    if (!s.ok() && !absl::IsNotFound(s)) return s;
  }
  return absl::OkStatus();
}

}  // namespace ckpt::bench
