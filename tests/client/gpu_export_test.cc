// GpuExport (client/src/gpu_export.h) through a fake CudaDriver: which
// tensors are refused and how they are named, one region per allocation,
// the handover it builds, and the step event.
#include "gpu_export.h"

#include <fcntl.h>
#include <sys/mman.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "base/handover_wire.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/lib/test_util.h"

namespace ckpt::internal {
namespace {

using ::testing::HasSubstr;

// Device memory as a table of allocations: base -> (device, size, legacy).
// An allocation that is not legacy is one page of virtual-memory-management
// memory (an expandable segment's), with the handle types it allows.
class FakeDriver final : public CudaDriver {
 public:
  struct Allocation {
    int device = 0;
    uint64_t size = 0;
    bool legacy = true;  // false: virtual memory management (expandable segments)
    bool posix_fd = false;
    bool fabric = false;
  };
  std::map<uint64_t, Allocation> allocations;
  std::vector<int> exported_fds;  // every page descriptor handed out, in order
  int fail_export_at = -1;        // the export that fails (its index), if any
  int fabric_exported = 0;
  int handles_exported = 0;
  int events_created = 0;
  int events_recorded = 0;

  absl::StatusOr<int> DeviceOf(uint64_t ptr) override {
    const auto* a = Find(ptr);
    if (a == nullptr) return absl::InvalidArgumentError("not in CUDA device memory");
    return a->second.device;
  }
  absl::StatusOr<Range> AllocationRange(uint64_t ptr) override {
    const auto* a = Find(ptr);
    if (a == nullptr) return absl::InvalidArgumentError("the driver knows no allocation at it");
    return Range{a->first, a->second.size};
  }
  absl::StatusOr<bool> LegacyIpcCapable(uint64_t ptr) override { return Find(ptr)->second.legacy; }
  absl::StatusOr<std::string> IpcMemHandle(uint64_t base) override {
    ++handles_exported;
    std::string h(64, '\0');
    h.replace(0, 8, reinterpret_cast<const char*>(&base), 8);
    return h;
  }
  absl::StatusOr<Page> PageAt(uint64_t ptr) override {
    const auto* a = Find(ptr);
    if (a == nullptr || a->second.legacy) return absl::InvalidArgumentError("not VMM memory");
    return Page{a->first, a->second.size, a->second.posix_fd, a->second.fabric};
  }
  absl::StatusOr<int> ExportPageFd(uint64_t base) override {
    EXPECT_TRUE(allocations.at(base).posix_fd);
    if (static_cast<int>(exported_fds.size()) == fail_export_at) {
      return absl::FailedPreconditionError("cuMemExportToShareableHandle: CUresult 801");
    }
    const int fd = ::memfd_create("page", MFD_CLOEXEC);
    exported_fds.push_back(fd);
    return fd;
  }
  absl::StatusOr<std::string> ExportPageFabric(uint64_t base) override {
    EXPECT_TRUE(allocations.at(base).fabric);
    ++fabric_exported;
    std::string h(64, 'f');
    h.replace(0, 8, reinterpret_cast<const char*>(&base), 8);
    return h;
  }
  absl::StatusOr<std::string> DeviceUuid(int device) override {
    return "GPU-0000000" + std::to_string(device) + "-0000-0000-0000-000000000000";
  }
  absl::StatusOr<std::string> CreateStepEvent(int) override {
    ++events_created;
    return std::string(64, 'e');
  }
  absl::Status RecordStepEvent(void*) override {
    ++events_recorded;
    return absl::OkStatus();
  }

 private:
  const std::pair<const uint64_t, Allocation>* Find(uint64_t ptr) const {
    auto it = allocations.upper_bound(ptr);
    if (it == allocations.begin()) return nullptr;
    --it;
    return ptr < it->first + it->second.size ? &*it : nullptr;
  }
};

const void* At(uint64_t a) { return reinterpret_cast<const void*>(a); }

// A handover of legacy handles only: no page descriptor is sent.
absl::StatusOr<std::string> NoPages(absl::Span<const int>) {
  ADD_FAILURE() << "no page descriptor was expected";
  return absl::InternalError("unexpected");
}

bool IsOpen(int fd) { return ::fcntl(fd, F_GETFD) != -1; }

class GpuExportTest : public ::testing::Test {
 protected:
  GpuExportTest() {
    auto d = std::make_unique<FakeDriver>();
    driver_ = d.get();
    driver_->allocations[0x100000] = {0, 1 << 20, true};
    driver_->allocations[0x400000] = {0, 2 << 20, true};
    driver_->allocations[0x800000] = {1, 1 << 20, true};
    driver_->allocations[0xc00000] = {0, 2 << 20, false};
    export_ = std::make_unique<GpuExport>(std::move(d));
  }
  FakeDriver* driver_;
  std::unique_ptr<GpuExport> export_;
};

TEST_F(GpuExportTest, TensorsOfOneAllocationShareItsRegion) {
  auto a = export_->Add(At(0x100000), 4096, "a");
  auto b = export_->Add(At(0x100000 + 8192), 4096, "b");
  auto c = export_->Add(At(0x400000 + 64), 1024, "c");
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(*a, std::make_pair(0u, uint64_t{0}));
  EXPECT_EQ(*b, std::make_pair(0u, uint64_t{8192}));
  EXPECT_EQ(*c, std::make_pair(1u, uint64_t{64}));
  EXPECT_EQ(driver_->handles_exported, 2);  // one per allocation
}

TEST_F(GpuExportTest, RefusalsNameTheTensor) {
  auto host = export_->Add(At(0x50), 8, "host.w");
  EXPECT_THAT(host.status().message(), HasSubstr("tensor 'host.w' is not in CUDA device memory"));
  auto past = export_->Add(At(0x100000 + (1 << 20) - 8), 16, "past.w");
  EXPECT_THAT(past.status().message(), HasSubstr("'past.w' (16 bytes) runs past the end"));
  // A page that allows no export (PyTorch 2.4, or 2.10+ with
  // TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC=0) says what to set.
  auto vmm = export_->Add(At(0xc00000), 64, "seg.w");
  EXPECT_THAT(vmm.status().message(), HasSubstr("'seg.w' lives in PyTorch expandable segments"));
  EXPECT_THAT(vmm.status().message(), HasSubstr("TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC"));
  ASSERT_TRUE(export_->Add(At(0x100000), 8, "first").ok());
  auto other = export_->Add(At(0x800000), 8, "dev1.w");
  EXPECT_THAT(other.status().message(),
              HasSubstr("'dev1.w' is on device 1; this rank's other tensors are on device 0"));
  for (const auto* s : {&host, &past, &vmm, &other}) {
    EXPECT_EQ(s->status().code(), absl::StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(driver_->handles_exported, 1);  // nothing exported for a refused tensor
}

TEST_F(GpuExportTest, HandoverCarriesEveryRegionAndOneEvent) {
  EXPECT_TRUE(export_->empty());
  EXPECT_EQ(export_->Handover(NoPages).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(export_->RecordStep(nullptr).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(export_->Add(At(0x400000), 8, "a").ok());
  ASSERT_TRUE(export_->Add(At(0x100000), 8, "b").ok());
  for (int i = 0; i < 2; ++i) {  // a re-registration hands the same over
    absl::StatusOr<v1::GpuHandover> h = export_->Handover(NoPages);
    ASSERT_TRUE(h.ok()) << h.status();
    EXPECT_EQ(h->device_uuid(), "GPU-00000000-0000-0000-0000-000000000000");
    ASSERT_EQ(h->regions_size(), 2);
    EXPECT_EQ(h->regions(0).bytes(), uint64_t{2} << 20);
    EXPECT_EQ(h->regions(1).bytes(), uint64_t{1} << 20);
    EXPECT_EQ(h->regions(0).ipc_handle().size(), 64u);
    EXPECT_NE(h->regions(0).ipc_handle(), h->regions(1).ipc_handle());
    EXPECT_EQ(h->step_event(), std::string(64, 'e'));
  }
  EXPECT_EQ(driver_->events_created, 1);
  EXPECT_TRUE(export_->RecordStep(nullptr).ok());
  EXPECT_EQ(driver_->events_recorded, 1);
}

// ---- Expandable segments: pages of the virtual memory management API ----

constexpr uint64_t kSeg = 0x10000000;
constexpr uint64_t kPage = 2 << 20;

class GpuPagesExportTest : public GpuExportTest {
 protected:
  // `n` pages of `size` from `base`, allowing a POSIX descriptor or only a
  // fabric handle.
  void Segment(uint64_t base, int n, uint64_t size = kPage, bool fabric_only = false) {
    for (int i = 0; i < n; ++i) {
      driver_->allocations[base + i * size] = {0, size, false, !fabric_only, fabric_only};
    }
  }
  // Sends like the client: records each batch's size and that its
  // descriptors are open while sent, and names it by its index.
  GpuExport::SendFds Sender() {
    return [this](absl::Span<const int> fds) -> absl::StatusOr<std::string> {
      for (int fd : fds) EXPECT_TRUE(IsOpen(fd));
      batches_.push_back(fds.size());
      return "token" + std::to_string(batches_.size());
    };
  }
  std::vector<size_t> batches_;
};

TEST_F(GpuPagesExportTest, TensorsOfASegmentFormRunsOfItsPages) {
  Segment(kSeg, 4);
  auto a = export_->Add(At(kSeg + 16), 1 << 20, "a");        // inside page 0
  auto b = export_->Add(At(kSeg + kPage - 512), 1024, "b");  // pages 0-1
  auto c = export_->Add(At(kSeg + 3 * kPage), 4096, "c");    // page 3 alone
  auto d = export_->Add(At(kSeg + 2 * kPage - 8), 16, "d");  // pages 1-2
  ASSERT_TRUE(a.ok() && b.ok() && c.ok() && d.ok()) << a.status() << b.status() << c.status();
  EXPECT_EQ(*a, std::make_pair(0u, uint64_t{16}));
  EXPECT_EQ(*b, std::make_pair(0u, kPage - 512));
  EXPECT_EQ(*c, std::make_pair(1u, uint64_t{0}));
  EXPECT_EQ(*d, std::make_pair(0u, 2 * kPage - 8)) << "a run grows at its end, offsets stay";
  EXPECT_EQ(driver_->handles_exported, 0);
  EXPECT_TRUE(driver_->exported_fds.empty()) << "pages are exported at the handover, not before";

  CKPT_ASSERT_OK_AND_ASSIGN(v1::GpuHandover h, export_->Handover(Sender()));
  ASSERT_EQ(h.regions_size(), 2);
  EXPECT_TRUE(h.regions(0).ipc_handle().empty());
  EXPECT_EQ(h.regions(0).bytes(), 3 * kPage);
  ASSERT_EQ(h.regions(0).pages_size(), 3);
  ASSERT_EQ(h.regions(1).pages_size(), 1);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(h.regions(0).pages(i).fd(), static_cast<uint32_t>(i));
    EXPECT_EQ(h.regions(0).pages(i).bytes(), kPage);
  }
  EXPECT_EQ(h.regions(1).pages(0).fd(), 3u);
  EXPECT_EQ(h.page_tokens_size(), 1);
  EXPECT_EQ(driver_->exported_fds.size(), 4u) << "each page once";
  for (int fd : driver_->exported_fds) EXPECT_FALSE(IsOpen(fd)) << "closed once sent";
}

TEST_F(GpuPagesExportTest, DescriptorsGoInBatchesOfAtMostTheSocketsLimit) {
  constexpr int kPages = 600;
  Segment(kSeg, kPages, 4096);
  CKPT_ASSERT_OK(export_->Add(At(kSeg), kPages * 4096, "big").status());
  CKPT_ASSERT_OK_AND_ASSIGN(v1::GpuHandover h, export_->Handover(Sender()));
  EXPECT_EQ(batches_,
            (std::vector<size_t>{kMaxHandoverFds, kMaxHandoverFds, kPages - 2 * kMaxHandoverFds}));
  ASSERT_EQ(h.page_tokens_size(), 3);
  EXPECT_EQ(h.page_tokens(2), "token3");
  ASSERT_EQ(h.regions(0).pages_size(), kPages);
  EXPECT_EQ(h.regions(0).pages(kPages - 1).fd(), static_cast<uint32_t>(kPages - 1));
  for (int fd : driver_->exported_fds) EXPECT_FALSE(IsOpen(fd));
}

TEST_F(GpuPagesExportTest, FabricOnlyPagesTravelAsHandles) {
  Segment(kSeg, 2, kPage, /*fabric_only=*/true);
  CKPT_ASSERT_OK(export_->Add(At(kSeg + 100), kPage, "w").status());
  CKPT_ASSERT_OK_AND_ASSIGN(v1::GpuHandover h, export_->Handover(NoPages));
  ASSERT_EQ(h.regions(0).pages_size(), 2);
  EXPECT_EQ(h.regions(0).pages(1).fabric_handle().size(), 64u);
  EXPECT_EQ(h.page_tokens_size(), 0);
  EXPECT_EQ(driver_->fabric_exported, 2);
}

TEST_F(GpuPagesExportTest, AFailedSendClosesTheDescriptorsAndSaysWhy) {
  Segment(kSeg, 2);
  CKPT_ASSERT_OK(export_->Add(At(kSeg), 2 * kPage, "w").status());
  absl::Status s = export_
                       ->Handover([](absl::Span<const int>) -> absl::StatusOr<std::string> {
                         return absl::ResourceExhaustedError("handover_max_fds_per_uid");
                       })
                       .status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  ASSERT_EQ(driver_->exported_fds.size(), 2u);
  for (int fd : driver_->exported_fds) EXPECT_FALSE(IsOpen(fd));
}

// A tensor that starts before a run and overlaps it gets a run of its own;
// the page they share is exported once and named by both.
TEST_F(GpuPagesExportTest, APageInTwoRunsIsExportedOnce) {
  Segment(kSeg, 3);
  auto a = export_->Add(At(kSeg + kPage + 64), kPage, "a");  // pages 1-2
  auto b = export_->Add(At(kSeg + 64), kPage, "b");          // pages 0-1
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(*a, std::make_pair(0u, uint64_t{64}));
  EXPECT_EQ(*b, std::make_pair(1u, uint64_t{64}));
  CKPT_ASSERT_OK_AND_ASSIGN(v1::GpuHandover h, export_->Handover(Sender()));
  ASSERT_EQ(h.regions(0).pages_size(), 2);
  ASSERT_EQ(h.regions(1).pages_size(), 2);
  EXPECT_EQ(h.regions(0).pages(0).fd(), h.regions(1).pages(1).fd()) << "page 1, in both runs";
  EXPECT_EQ(driver_->exported_fds.size(), 3u);
}

TEST_F(GpuPagesExportTest, AFailedExportClosesWhatWasExported) {
  Segment(kSeg, 3);
  driver_->fail_export_at = 2;
  CKPT_ASSERT_OK(export_->Add(At(kSeg), 3 * kPage, "w").status());
  absl::Status s = export_->Handover(Sender()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("gpu region 0"));
  ASSERT_EQ(driver_->exported_fds.size(), 2u);
  for (int fd : driver_->exported_fds) EXPECT_FALSE(IsOpen(fd));
  EXPECT_TRUE(batches_.empty());
}

TEST_F(GpuPagesExportTest, LegacyAllocationsAndPagesMixInOneRank) {
  Segment(kSeg, 1);
  auto legacy = export_->Add(At(0x100000), 64, "legacy");
  auto paged = export_->Add(At(kSeg), 64, "paged");
  ASSERT_TRUE(legacy.ok() && paged.ok());
  EXPECT_EQ(paged->first, 1u);
  CKPT_ASSERT_OK_AND_ASSIGN(v1::GpuHandover h, export_->Handover(Sender()));
  EXPECT_EQ(h.regions(0).ipc_handle().size(), 64u);
  EXPECT_EQ(h.regions(0).pages_size(), 0);
  EXPECT_EQ(h.regions(1).pages_size(), 1);
}

}  // namespace
}  // namespace ckpt::internal
