// LayerStore (layer_store.h): reading committed versions back (Read,
// ReadUnchecked, PrepareRead, OpenCommitted, CheckFile) and the checks of a
// file's image against its record (CheckImage); Adopt, which commits a
// version whose bytes come from elsewhere and are checked the same way.
#include <sys/mman.h>

#include <memory>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "daemon/store/layer_store.h"
#include "daemon/store/layer_store_internal.h"

namespace ckpt {

using layer_store_internal::AtPath;
using layer_store_internal::LeaseSegments;
using layer_store_internal::TempName;

absl::StatusOr<LoadedVersion> LayerStore::Read(const VersionKey& key,
                                               const store::VersionRecord& rec, IoBackend* io,
                                               StagingPool* pool, absl::Time deadline) {
  LoadedVersion out;
  CKPT_ASSIGN_OR_RETURN(out.lease, pool->Acquire(rec.file_bytes(), deadline));
  CKPT_RETURN_IF_ERROR(ReadUnchecked(key, rec, io, out.lease));
  CKPT_ASSIGN_OR_RETURN(out.decoded, CheckImage(key, rec, LeaseImage(out.lease)));
  return out;
}

absl::Status LayerStore::ReadUnchecked(const VersionKey& key, const store::VersionRecord& rec,
                                       IoBackend* io, const StagingLease& lease) {
  CKPT_ASSIGN_OR_RETURN(VersionRead read, PrepareRead(key, rec, lease));
  return io->ReadAll(read.fd.get(), read.segments);
}

absl::StatusOr<VersionRead> LayerStore::PrepareRead(const VersionKey& key,
                                                    const store::VersionRecord& rec,
                                                    const StagingLease& lease) {
  CKPT_ASSIGN_OR_RETURN(const DirRef dir_ref, RankDir(key.job, key.rank, /*create=*/false));
  const int dir = dir_ref->get();
  bool direct_used = false;
  absl::StatusOr<UniqueFd> fd = fs_->OpenForRead(dir, rec.file(), use_direct_io_, &direct_used);
  if (!fd.ok()) {
    if (absl::IsNotFound(fd.status())) {
      return absl::DataLossError(
          absl::StrCat("file ", rec.file(), " of a committed version is missing"));
    }
    return fd.status();
  }
  CKPT_ASSIGN_OR_RETURN(uint64_t size, fs_->FileSize(fd->get()));
  if (size != rec.file_bytes()) {
    return absl::DataLossError(absl::StrCat("file ", rec.file(), " has ", size,
                                            " bytes; the index says ", rec.file_bytes()));
  }
  if (lease.capacity() < size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a lease of ", lease.capacity(), " bytes cannot hold ", rec.file(), " (", size, ")"));
  }
  return VersionRead{*std::move(fd), LeaseSegments(lease, 0, size)};
}

absl::StatusOr<DecodedHeader> CheckImageHeader(const VersionKey& key,
                                               const store::VersionRecord& rec,
                                               const ByteImage& image) {
  CKPT_ASSIGN_OR_RETURN(DecodedHeader decoded, DecodeHeader(image, rec.file_bytes()));
  const store::LayerFileHeader& h = decoded.header;
  if (decoded.body_xxh3 != rec.header_xxh3() || h.job_id() != key.job || h.rank() != key.rank ||
      h.layer() != key.layer || h.step() != key.step) {
    return absl::DataLossError(
        absl::StrCat("file ", rec.file(), " does not match its index record"));
  }
  return decoded;
}

absl::StatusOr<DecodedHeader> CheckImage(const VersionKey& key, const store::VersionRecord& rec,
                                         const ByteImage& image) {
  CKPT_ASSIGN_OR_RETURN(DecodedHeader decoded, CheckImageHeader(key, rec, image));
  CKPT_RETURN_IF_ERROR(VerifyPayload(decoded, image));
  return decoded;
}

absl::StatusOr<UniqueFd> LayerStore::OpenCommitted(const VersionKey& key,
                                                   const store::VersionRecord& rec) {
  CKPT_ASSIGN_OR_RETURN(const DirRef dir_ref, RankDir(key.job, key.rank, /*create=*/false));
  const int dir = dir_ref->get();
  bool direct_used = false;
  absl::StatusOr<UniqueFd> fd = fs_->OpenForRead(dir, rec.file(), /*direct=*/false, &direct_used);
  if (absl::IsNotFound(fd.status())) {
    return absl::DataLossError(
        absl::StrCat("file ", rec.file(), " of a committed version is missing"));
  }
  if (!fd.ok()) return fd.status();
  CKPT_ASSIGN_OR_RETURN(uint64_t size, fs_->FileSize(fd->get()));
  if (size != rec.file_bytes()) {
    return absl::DataLossError(absl::StrCat("file ", rec.file(), " has ", size,
                                            " bytes; the index says ", rec.file_bytes()));
  }
  return fd;
}

namespace {

// A file mapped read-only, as a ByteImage for the format's checks.
class MappedFile final : public ByteImage {
 public:
  static absl::StatusOr<std::unique_ptr<MappedFile>> Map(int fd, uint64_t size) {
    if (size == 0) return absl::DataLossError("empty file");
    void* p = mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) return ErrnoStatus(errno, "mmap");
    return std::unique_ptr<MappedFile>(new MappedFile(static_cast<char*>(p), size));
  }
  ~MappedFile() override { munmap(data_, size_); }
  uint64_t size() const override { return size_; }
  void ForEachPiece(uint64_t offset, uint64_t len,
                    const std::function<void(char*, uint64_t)>& fn) const override {
    if (len > 0) fn(data_ + offset, len);
  }

 private:
  MappedFile(char* data, uint64_t size) : data_(data), size_(size) {}
  char* const data_;
  const uint64_t size_;
};

}  // namespace

absl::Status LayerStore::FillChecked(int dir, const VersionKey& key,
                                     const store::VersionRecord& rec,
                                     const std::function<absl::StatusOr<uint64_t>(int fd)>& fill,
                                     const std::string& tmp_name) {
  uint32_t layer = 0;
  uint64_t step = 0;
  if (!ParseFileName(rec.file(), &layer, &step) || layer != key.layer || step != key.step) {
    return absl::DataLossError(absl::StrCat("version file name \"", rec.file(),
                                            "\" does not name layer ", key.layer, " step ",
                                            key.step));
  }
  bool direct_used = false;
  CKPT_ASSIGN_OR_RETURN(UniqueFd fd,
                        fs_->CreateExclusive(dir, tmp_name, /*direct=*/false, &direct_used));
  auto fail = [&](absl::Status s) {
    DropTemp(dir, &fd, tmp_name);
    return s;
  };
  if (absl::Status s = fs_->Allocate(fd.get(), rec.file_bytes()); !s.ok()) return fail(s);
  absl::StatusOr<uint64_t> wrote = fill(fd.get());
  if (!wrote.ok()) return fail(wrote.status());
  if (*wrote != rec.file_bytes()) {
    return fail(absl::DataLossError(absl::StrCat("version ", rec.file(), " arrived with ", *wrote,
                                                 " bytes; its record says ", rec.file_bytes())));
  }
  if (absl::Status s = fs_->DataSync(fd.get()); !s.ok()) return fail(s);
  {
    // Checked through a read-only descriptor of its own, mapped whole.
    bool direct = false;
    absl::StatusOr<UniqueFd> rd = fs_->OpenForRead(dir, tmp_name, /*direct=*/false, &direct);
    if (!rd.ok()) return fail(rd.status());
    absl::StatusOr<std::unique_ptr<MappedFile>> image =
        MappedFile::Map(rd->get(), rec.file_bytes());
    if (!image.ok()) return fail(image.status());
    if (absl::StatusOr<DecodedHeader> d = CheckImage(key, rec, **image); !d.ok()) {
      return fail(d.status());
    }
  }
  if (absl::Status s = fd.Close(); !s.ok()) return fail(s);
  return absl::OkStatus();
}

absl::Status LayerStore::Adopt(const VersionKey& key, const store::VersionRecord& rec,
                               const std::function<absl::StatusOr<uint64_t>(int fd)>& fill) {
  CKPT_ASSIGN_OR_RETURN(const DirRef dir_ref, RankDir(key.job, key.rank, /*create=*/true));
  const int dir = dir_ref->get();
  const std::string tmp_name = TempName(rec.file());
  CKPT_RETURN_IF_ERROR(FillChecked(dir, key, rec, fill, tmp_name));
  if (absl::Status s = fs_->RenameNoReplace(dir, tmp_name, rec.file()); !s.ok()) {
    IgnoreError(fs_->Unlink(dir, tmp_name), "a temp file is removed at the next start");
    return s;
  }
  auto fail_renamed = [&](absl::Status s) {
    IgnoreError(fs_->Unlink(dir, rec.file()), "an orphan file is quarantined at the next start");
    return s;
  };
  if (absl::Status s = fs_->SyncDir(dir); !s.ok()) return fail_renamed(s);
  if (absl::Status s = index_->PutVersion(key, rec); !s.ok()) return fail_renamed(s);
  return absl::OkStatus();
}

absl::Status LayerStore::Replace(const VersionKey& key, const store::VersionRecord& rec,
                                 const std::function<absl::StatusOr<uint64_t>(int fd)>& fill,
                                 const std::string& why) {
  CKPT_ASSIGN_OR_RETURN(const DirRef dir_ref, RankDir(key.job, key.rank, /*create=*/false));
  const int dir = dir_ref->get();
  const std::string tmp_name = TempName(rec.file());
  // The copy is whole and checked before the damaged file is touched: a
  // copy that fails leaves everything as it was.
  CKPT_RETURN_IF_ERROR(FillChecked(dir, key, rec, fill, tmp_name));
  auto fail = [&](absl::Status s) {
    IgnoreError(fs_->Unlink(dir, tmp_name), "a temp file is removed at the next start");
    return s;
  };
  if (absl::StatusOr<uint64_t> size = fs_->FileSizeAt(dir, rec.file()); size.ok()) {
    if (absl::Status s = Quarantine(key.job, key.rank, dir, rec.file(), why); !s.ok()) {
      return fail(s);
    }
  } else if (!absl::IsNotFound(size.status())) {
    return fail(AtPath(size.status(), RankDirPath(key.job, key.rank)));
  }
  // The record never changed: between the two renames it names a missing
  // file, which a crash there leaves for start-up to find.
  if (absl::Status s = fs_->RenameNoReplace(dir, tmp_name, rec.file()); !s.ok()) return fail(s);
  return fs_->SyncDir(dir);
}

absl::Status LayerStore::CheckFile(const VersionKey& key, const store::VersionRecord& rec) {
  CKPT_ASSIGN_OR_RETURN(const DirRef dir_ref, RankDir(key.job, key.rank, /*create=*/false));
  const int dir = dir_ref->get();
  absl::StatusOr<uint64_t> size = fs_->FileSizeAt(dir, rec.file());
  if (!size.ok()) {
    return absl::DataLossError(absl::StrCat("file ", rec.file(), ": ", size.status().message()));
  }
  if (*size != rec.file_bytes()) {
    return absl::DataLossError(absl::StrCat("file ", rec.file(), " has ", *size,
                                            " bytes; the index says ", rec.file_bytes()));
  }
  return absl::OkStatus();
}

}  // namespace ckpt
