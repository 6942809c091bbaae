// GpuExport (client/src/gpu_export.h) through a fake CudaDriver: which
// tensors are refused and how they are named, one region per allocation,
// the handover it builds, and the step event.
#include "gpu_export.h"

#include <map>
#include <memory>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ckpt::internal {
namespace {

using ::testing::HasSubstr;

// Device memory as a table of allocations: base -> (device, size, legacy).
class FakeDriver final : public CudaDriver {
 public:
  struct Allocation {
    int device = 0;
    uint64_t size = 0;
    bool legacy = true;  // false: virtual memory management (expandable segments)
  };
  std::map<uint64_t, Allocation> allocations;
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
  auto vmm = export_->Add(At(0xc00000), 64, "seg.w");
  EXPECT_THAT(vmm.status().message(), HasSubstr("'seg.w' lives in an allocation that legacy"));
  EXPECT_THAT(vmm.status().message(), HasSubstr("expandable_segments"));
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
  EXPECT_EQ(export_->Handover().status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(export_->RecordStep(nullptr).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(export_->Add(At(0x400000), 8, "a").ok());
  ASSERT_TRUE(export_->Add(At(0x100000), 8, "b").ok());
  for (int i = 0; i < 2; ++i) {  // a re-registration hands the same over
    absl::StatusOr<v1::GpuHandover> h = export_->Handover();
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

}  // namespace
}  // namespace ckpt::internal
