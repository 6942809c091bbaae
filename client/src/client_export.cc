// Client::Plan and Client::Export: reading a job's checkpoint without
// registering, its bytes streamed or handed over through a shared window
// (base/export_region.h).
#include <grpcpp/grpcpp.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <optional>

#include "absl/strings/str_cat.h"
#include "base/export_region.h"
#include "base/handover_wire.h"
#include "base/logging.h"
#include "base/region.h"
#include "base/status.h"
#include "ckpt/client.h"
#include "client_internal.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14
#endif

namespace ckpt {
namespace {

using internal::FromGrpc;
using internal::SetDeadline;

// A memfd for an export's bytes, its pages populated here so that they are
// this process's memory, not ckptd's (ckptd writes into them), and left
// open to the seal ckptd adds against holes.
absl::StatusOr<MemfdRegion> MakeExportRegion(uint64_t bytes) {
  CKPT_ASSIGN_OR_RETURN(MemfdRegion r,
                        MemfdRegion::Create("ckpt-export", bytes, /*open_to_seals=*/true));
  if (::madvise(r.data(), r.size(), MADV_POPULATE_WRITE) != 0) {
    // Out of memory: no window (the stream needs none).
    if (errno != EINVAL) return ErrnoStatus(errno, "MADV_POPULATE_WRITE");
    // A kernel without it: touch each page.
    const long page = ::sysconf(_SC_PAGESIZE);
    auto* p = static_cast<volatile char*>(r.data());
    for (uint64_t off = 0; off < r.size(); off += static_cast<uint64_t>(page)) p[off] = 0;
  }
  return r;
}

// The messages of one Export stream, checked against its header and handed
// to the caller's sink tensor by tensor.
class ExportStream {
 public:
  ExportStream(const Client::ExportSink& sink, const std::optional<MemfdRegion>& region)
      : sink_(sink), region_(region) {}

  // One message: the header first, then bytes in the message or (in_region)
  // at the start of the region's window, which goes back to ckptd after.
  absl::Status Take(v1::ExportChunk& chunk) {
    if (chunk.has_header()) {
      if (have_header_) return absl::DataLossError("the export stream sent a second header");
      header_ = std::move(*chunk.mutable_header());
      have_header_ = true;
      if (header_.in_region() && !region_.has_value()) {
        return absl::DataLossError("ckptd chose a region for an export that gave it none");
      }
      return sink_.header(header_);
    }
    if (!have_header_) {
      return absl::DataLossError("the export stream sent data before its header");
    }
    const bool from_region = chunk.payload_case() == v1::ExportChunk::kRegionBytes;
    if (from_region != header_.in_region() && (from_region || !chunk.data().empty())) {
      return absl::DataLossError("the export stream mixed bytes in the region and in messages");
    }
    std::string_view piece = chunk.data();
    if (from_region) {
      if (chunk.region_bytes() > region_->size() - kExportRegionControlBytes) {
        return absl::DataLossError("the export stream named more bytes than the region holds");
      }
      piece =
          std::string_view(static_cast<const char*>(region_->data()) + kExportRegionControlBytes,
                           chunk.region_bytes());
    }
    CKPT_RETURN_IF_ERROR(Deliver(piece));
    if (from_region) BumpExportAck(region_->data());  // the window is ckptd's again
    return absl::OkStatus();
  }

  // The stream ended well: every tensor's bytes must have come.
  absl::Status Finish() {
    if (!have_header_) return absl::DataLossError("the export stream ended without a header");
    SkipFinished();
    if (tensor_ != header_.tensors_size()) {
      return absl::DataLossError("the export stream ended before the bytes of every tensor");
    }
    return absl::OkStatus();
  }

 private:
  // On to the next tensor whose bytes are still due.
  void SkipFinished() {
    while (tensor_ < header_.tensors_size() && offset_ == header_.tensors(tensor_).nbytes()) {
      ++tensor_;
      offset_ = 0;
    }
  }

  absl::Status Deliver(std::string_view piece) {
    while (!piece.empty()) {
      SkipFinished();
      if (tensor_ == header_.tensors_size()) {
        return absl::DataLossError("the export stream sent more bytes than its header lists");
      }
      const v1::ExportTensor& t = header_.tensors(tensor_);
      const uint64_t n = std::min<uint64_t>(piece.size(), t.nbytes() - offset_);
      CKPT_RETURN_IF_ERROR(sink_.data(t, offset_, piece.substr(0, n)));
      offset_ += n;
      piece.remove_prefix(n);
    }
    return absl::OkStatus();
  }

  const Client::ExportSink& sink_;
  const std::optional<MemfdRegion>& region_;
  bool have_header_ = false;
  v1::ExportHeader header_;
  int tensor_ = 0;
  uint64_t offset_ = 0;
};

}  // namespace

absl::StatusOr<v1::Plan> Client::Plan(uint64_t target_step, uint64_t older_within_steps) {
  return Plan(spec_.job_id, spec_.rank, target_step, older_within_steps);
}

absl::StatusOr<v1::Plan> Client::Plan(const std::string& job, uint32_t rank, uint64_t target_step,
                                      uint64_t older_within_steps) {
  v1::PlanRequest req;
  req.set_job_id(job);
  req.set_rank(rank);
  req.set_target_step(target_step);
  req.set_older_within_steps(older_within_steps);
  grpc::ClientContext ctx;
  SetDeadline(&ctx, options_.call_timeout);
  v1::Plan plan;
  CKPT_RETURN_IF_ERROR(FromGrpc(impl_->stub->Plan(&ctx, req, &plan)));
  return plan;
}

absl::Status Client::Export(const std::string& job, uint32_t rank, uint64_t target_step,
                            const ExportSink& sink, uint64_t older_within_steps) {
  v1::ExportRequest req;
  req.set_job_id(job);
  req.set_rank(rank);
  req.set_target_step(target_step);
  req.set_older_within_steps(older_within_steps);
  // The window is a shortcut: without it (no memory for it, the handover
  // refused), the bytes are streamed.
  std::optional<MemfdRegion> region;
  if (sink.region_bytes > 0) {
    absl::StatusOr<MemfdRegion> made =
        MakeExportRegion(kExportRegionControlBytes + sink.region_bytes);
    absl::StatusOr<std::string> token = absl::UnknownError("no region");
    if (made.ok()) {
      const int fd = made->fd();
      token = HandOverFds(options_.handover_socket_path, {&fd, 1}, options_.call_timeout);
    } else {
      token = made.status();
    }
    if (token.ok()) {
      region = std::move(*made);
      req.set_region_token(*token);
    } else {
      CKPT_LOG(WARNING) << "export of job " << job << " rank " << rank
                        << " is streamed: no shared window (" << token.status() << ")";
    }
  }
  grpc::ClientContext ctx;
  SetDeadline(&ctx, options_.restore_timeout);
  std::unique_ptr<grpc::ClientReader<v1::ExportChunk>> reader = impl_->admin->Export(&ctx, req);
  ExportStream stream(sink, region);
  absl::Status local;
  v1::ExportChunk chunk;
  while (local.ok() && reader->Read(&chunk)) local = stream.Take(chunk);
  if (!local.ok()) ctx.TryCancel();
  const absl::Status s = FromGrpc(reader->Finish());
  if (!local.ok()) return local;
  CKPT_RETURN_IF_ERROR(s);
  return stream.Finish();
}

}  // namespace ckpt
