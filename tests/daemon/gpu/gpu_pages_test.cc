// GPU memory of CUDA's virtual memory management API (PyTorch's expandable
// segments) without a GPU: a region is a run of pages, each handed over as a
// descriptor (or a fabric handle), and ckptd maps each run into one range of
// exactly its size. The fake's pages are memfds mapped into a reserved
// range, so what the test writes into a page is what ckptd reads.
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/unique_fd.h"
#include "daemon/engine/engine.h"
#include "daemon/gpu/ipc_memory.h"
#include "daemon/rpc/convert.h"
#include "gtest/gtest.h"
#include "tests/daemon/gpu/gpu_engine_fixture.h"
#include "tests/daemon/gpu/gpu_test_util.h"
#include "tests/lib/test_util.h"

namespace ckpt {
namespace {

using ::ckpt::gpu_test::FakeCudaIpc;
using ::ckpt::gpu_test::GpuEngineFixture;
using ::ckpt::gpu_test::GpuRequest;
using ::ckpt::gpu_test::Handle;
using ::ckpt::gpu_test::kEventId;
using ::ckpt::gpu_test::kFloats;
using ::ckpt::gpu_test::kLayers;
using ::ckpt::gpu_test::kUuid;
using ::ckpt::gpu_test::Reg;
using ::ckpt::gpu_test::Value;

constexpr uint64_t kPage = 64 << 10;

// A page of "physical memory": a memfd of `bytes`, mapped for the test.
struct Page {
  UniqueFd fd;
  char* data = nullptr;
  uint64_t bytes = 0;

  static Page Make(uint64_t bytes, char fill) {
    Page p;
    p.bytes = bytes;
    p.fd = UniqueFd(::memfd_create("gpu-page", MFD_CLOEXEC));
    EXPECT_TRUE(p.fd.valid());
    EXPECT_EQ(::ftruncate(p.fd.get(), static_cast<off_t>(bytes)), 0);
    void* m = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, p.fd.get(), 0);
    EXPECT_NE(m, MAP_FAILED);
    p.data = static_cast<char*>(m);
    std::memset(p.data, fill, bytes);
    return p;
  }
  Page() = default;
  Page(Page&& o) noexcept
      : fd(std::move(o.fd)), data(std::exchange(o.data, nullptr)), bytes(o.bytes) {}
  ~Page() {
    if (data != nullptr) ::munmap(data, bytes);
  }
};

// A region of pages: descriptor indices `fds` with the given sizes.
v1::GpuRegion* AddRun(v1::GpuHandover* h, const std::vector<uint32_t>& fds,
                      const std::vector<uint64_t>& bytes) {
  v1::GpuRegion* r = h->add_regions();
  uint64_t sum = 0;
  for (size_t i = 0; i < fds.size(); ++i) {
    v1::GpuPage* p = r->add_pages();
    p->set_fd(fds[i]);
    p->set_bytes(bytes[i]);
    sum += bytes[i];
  }
  r->set_bytes(sum);
  return r;
}

v1::GpuHandover Pages() {
  v1::GpuHandover h;
  h.set_device_uuid(kUuid);
  h.set_step_event(Handle(kEventId));
  return h;
}

std::vector<UniqueFd> Dups(const std::vector<const Page*>& pages) {
  std::vector<UniqueFd> fds;
  for (const Page* p : pages) fds.emplace_back(::dup(p->fd.get()));
  return fds;
}

TEST(GpuPagesTest, EachRunIsOneRangeOfItsPagesInOrder) {
  FakeCudaIpc ipc;
  Page a = Page::Make(kPage, 'a'), b = Page::Make(kPage, 'b'), c = Page::Make(2 * kPage, 'c');
  v1::GpuHandover h = Pages();
  AddRun(&h, {0, 1}, {kPage, kPage});  // a and b, contiguous in the trainer
  AddRun(&h, {2}, {2 * kPage});        // c, elsewhere
  {
    CKPT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<GpuMemory> m,
                              GpuMemory::Open(GpuHandoverOf(h), Dups({&a, &b, &c}), &ipc));
    EXPECT_EQ(ipc.open_runs(), 2) << "one reserved range per run, not per page";
    EXPECT_EQ(ipc.pages_mapped(), 3);
    ASSERT_EQ(m->region_count(), 2u);
    EXPECT_EQ(m->region_size(0), 2 * kPage);
    EXPECT_EQ(m->base(0)[0], 'a');
    EXPECT_EQ(m->base(0)[kPage - 1], 'a');
    EXPECT_EQ(m->base(0)[kPage], 'b');
    EXPECT_EQ(m->base(1)[2 * kPage - 1], 'c');
    // The trainer's writes are what ckptd reads: the same pages.
    b.data[7] = 'B';
    EXPECT_EQ(m->base(0)[kPage + 7], 'B');
    EXPECT_EQ(OpenGpuMappings().mappings, 2u);
  }
  EXPECT_EQ(ipc.open_runs(), 0);
  EXPECT_EQ(OpenGpuMappings().mappings, 0u);
}

TEST(GpuPagesTest, APageSmallerThanDeclaredReleasesEveryRun) {
  FakeCudaIpc ipc;
  Page a = Page::Make(kPage, 'a'), b = Page::Make(kPage, 'b');
  v1::GpuHandover h = Pages();
  AddRun(&h, {0}, {kPage});
  AddRun(&h, {1}, {2 * kPage});  // b is one page, declared two
  absl::Status s = GpuMemory::Open(GpuHandoverOf(h), Dups({&a, &b}), &ipc).status();
  CKPT_EXPECT_CODE(s, kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("gpu region 1"), std::string::npos) << s;
  EXPECT_EQ(ipc.open_runs(), 0) << "the first run must be released too";
  EXPECT_EQ(OpenGpuMappings().mappings, 0u);
}

// A handover of one page given as the fabric handle `fabric`.
v1::GpuHandover OneFabricPage(const std::string& fabric) {
  v1::GpuHandover h = Pages();
  v1::GpuRegion* r = h.add_regions();
  r->set_bytes(kPage);
  v1::GpuPage* p = r->add_pages();
  p->set_fabric_handle(fabric);
  p->set_bytes(kPage);
  return h;
}

TEST(GpuPagesTest, FabricHandlesMapWithoutDescriptorsWhenAllowed) {
  FakeCudaIpc ipc;
  Page a = Page::Make(kPage, 'f');
  const std::string fabric = Handle(77);
  ipc.AddFabricPage(fabric, a.fd.get());
  GpuMemoryOptions options;
  options.fabric_handles = true;
  CKPT_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<GpuMemory> m,
      GpuMemory::Open(GpuHandoverOf(OneFabricPage(fabric)), {}, &ipc, options));
  EXPECT_EQ(m->base(0)[kPage / 2], 'f');
}

// Importing a fabric handle needs an IMEX channel ckptd may hold where the
// trainer's user does not: by default such pages are refused, naming the
// option, before anything is imported.
TEST(GpuPagesTest, FabricHandlesAreRefusedByDefault) {
  FakeCudaIpc ipc;
  Page a = Page::Make(kPage, 'f');
  const std::string fabric = Handle(77);
  ipc.AddFabricPage(fabric, a.fd.get());
  const GpuHandover h = GpuHandoverOf(OneFabricPage(fabric));
  absl::Status s = CheckGpuHandover(h, 0).status();
  CKPT_EXPECT_CODE(s, kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("gpu_fabric_handles"), std::string::npos) << s;
  CKPT_EXPECT_OK(CheckGpuHandover(h, 0, /*fabric_handles=*/true).status());
  CKPT_EXPECT_CODE(GpuMemory::Open(h, {}, &ipc).status(), kInvalidArgument);
  EXPECT_EQ(ipc.pages_mapped(), 0);
}

TEST(GpuPagesTest, MalformedRunsAreRefusedBeforeAnythingIsMapped) {
  struct Case {
    const char* what;
    void (*mutate)(v1::GpuHandover*);
  };
  const Case cases[] = {
      {"a descriptor index past those handed over",
       [](v1::GpuHandover* h) { h->mutable_regions(0)->mutable_pages(1)->set_fd(2); }},
      {"sizes that do not add up to the region's",
       [](v1::GpuHandover* h) { h->mutable_regions(0)->set_bytes(3 * kPage); }},
      {"a legacy handle and pages",
       [](v1::GpuHandover* h) { h->mutable_regions(0)->set_ipc_handle(Handle(1)); }},
      {"a page of size zero",
       [](v1::GpuHandover* h) {
         h->mutable_regions(0)->mutable_pages(0)->set_bytes(0);
         h->mutable_regions(0)->set_bytes(kPage);
       }},
      {"a fabric handle of the wrong length",
       [](v1::GpuHandover* h) {
         h->mutable_regions(0)->mutable_pages(0)->set_fabric_handle("short");
       }},
      {"a page past the region size limit",
       [](v1::GpuHandover* h) {
         h->mutable_regions(0)->mutable_pages(0)->set_bytes(kMaxRegionBytes);
         h->mutable_regions(0)->set_bytes(kMaxRegionBytes + kPage);
       }},
  };
  for (const Case& c : cases) {
    FakeCudaIpc ipc;
    Page a = Page::Make(kPage, 'a'), b = Page::Make(kPage, 'b');
    v1::GpuHandover h = Pages();
    AddRun(&h, {0, 1}, {kPage, kPage});
    CKPT_EXPECT_OK(CheckGpuHandover(GpuHandoverOf(h), 2).status()) << c.what;
    c.mutate(&h);
    CKPT_EXPECT_CODE(CheckGpuHandover(GpuHandoverOf(h), 2, /*fabric_handles=*/true).status(),
                     kInvalidArgument)
        << c.what;
    CKPT_EXPECT_CODE(GpuMemory::Open(GpuHandoverOf(h), Dups({&a, &b}), &ipc).status(),
                     kInvalidArgument)
        << c.what;
    EXPECT_EQ(ipc.pages_mapped(), 0) << c.what;
  }
}

TEST(GpuPagesTest, PagesAreCountedAgainstTheirOwnLimit) {
  v1::GpuHandover h = Pages();
  std::vector<uint32_t> fds(kMaxGpuPages / 2, 0);
  std::vector<uint64_t> bytes(kMaxGpuPages / 2, 4096);
  AddRun(&h, fds, bytes);
  AddRun(&h, fds, bytes);
  CKPT_EXPECT_OK(CheckGpuHandover(GpuHandoverOf(h), 1).status());
  AddRun(&h, {0}, {4096});
  absl::Status s = CheckGpuHandover(GpuHandoverOf(h), 1).status();
  CKPT_EXPECT_CODE(s, kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("pages"), std::string::npos) << s;
}

// The trainer's view of a run: its pages mapped one after another (as the
// fake maps them for ckptd). Unmapped by the test's end only with the process.
char* TrainerView(const std::vector<const Page*>& pages) {
  uint64_t total = 0;
  for (const Page* p : pages) total += p->bytes;
  void* range = ::mmap(nullptr, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  EXPECT_NE(range, MAP_FAILED);
  char* base = static_cast<char*>(range);
  uint64_t off = 0;
  for (const Page* p : pages) {
    EXPECT_NE(::mmap(base + off, p->bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
                     p->fd.get(), 0),
              MAP_FAILED);
    off += p->bytes;
  }
  return base;
}

// The engine's GPU path over pages: layers 0 and 1 in a run of two pages
// (layer 1 straddles the boundary between them), layer 2 in a run of one;
// snapshots read, and a restore writes, through the mapped runs, and every
// range is released on unregister.
class GpuPagesEngineTest : public GpuEngineFixture {
 protected:
  static constexpr uint64_t kSize = 4096;
  static constexpr uint64_t kStraddle = kSize - 512;  // layer 1's offset

  void SetUp() override {
    OpenStore();
    StartEngine(BaseOptions());
    for (char fill : {'x', 'y', 'z'}) pages_.push_back(Page::Make(kSize, fill));
    char* run0 = TrainerView({&pages_[0], &pages_[1]});
    layers_.layer[0] = run0;
    layers_.layer[1] = run0 + kStraddle;
    layers_.layer[2] = TrainerView({&pages_[2]});
  }
  void TearDown() override { StopEngine(); }

  v1::RegisterRequest Request() {
    v1::RegisterRequest req = GpuRequest("pjob");
    v1::GpuHandover* h = req.mutable_gpu();
    h->clear_regions();
    AddRun(h, {0, 1}, {kSize, kSize});
    AddRun(h, {2}, {kSize});
    req.mutable_layers(1)->mutable_tensors(0)->set_offset(kStraddle);
    return req;
  }
  std::vector<UniqueFd> Fds() { return Dups({&pages_[0], &pages_[1], &pages_[2]}); }
  static RankRef Ref(uint64_t generation) { return RankRef{"pjob", 0, generation}; }

  std::vector<Page> pages_;
  gpu_test::GpuLayers layers_;
};

TEST_F(GpuPagesEngineTest, SnapshotAndRestoreThroughMappedRuns) {
  static_assert(kStraddle + kFloats * 4 > kSize, "layer 1 must straddle the page boundary");
  CKPT_ASSERT_OK_AND_ASSIGN(Registered reg, engine_->Register(Reg(Request()), Fds(), owner_));
  EXPECT_EQ(ipc_.open_runs(), 2);
  EXPECT_EQ(ipc_.opens(), 0) << "no legacy IPC handle is opened for pages";
  for (uint64_t step = 1; step <= 2; ++step) {
    layers_.Fill(step);
    CKPT_ASSERT_OK(StepDone(Ref(reg.generation), step));
    CKPT_ASSERT_OK(
        engine_->WaitSnapshot(Ref(reg.generation), step, owner_, absl::Now() + gpu_test::kWait)
            .status());
    layers_.Fill(step + 100);  // the trainer moves on at once after the fence
  }
  CKPT_ASSERT_OK(
      engine_->WaitDurable(Ref(reg.generation), 2, owner_, absl::Now() + gpu_test::kWait).status());
  layers_.Fill(0);
  CKPT_ASSERT_OK_AND_ASSIGN(Restored restored, engine_->Restore(Ref(reg.generation), 0, owner_));
  EXPECT_EQ(restored.plan.target_step, 2u);
  EXPECT_TRUE(layers_.Holds(2)) << "the restore must write step 2 across the page boundary";
  CKPT_ASSERT_OK(engine_->Unregister(Ref(reg.generation), /*drain=*/false, owner_,
                                     absl::Now() + gpu_test::kWait));
  EXPECT_EQ(ipc_.open_runs(), 0);
  EXPECT_EQ(OpenGpuMappings().mappings, 0u);
}

TEST_F(GpuPagesEngineTest, TooFewDescriptorsMapNothing) {
  std::vector<UniqueFd> fds = Fds();
  fds.pop_back();
  CKPT_EXPECT_CODE(engine_->Register(Reg(Request()), std::move(fds), owner_).status(),
                   kInvalidArgument);
  EXPECT_EQ(ipc_.pages_mapped(), 0);
}

}  // namespace
}  // namespace ckpt
