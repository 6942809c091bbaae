// The CUDA drift kernel against the CPU reference. Skips when
// MakeCudaDriftKernel declines (no driver, no device, failed self-test).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "kernels/drift.h"
#include "tests/kernels/drift_test_util.h"

namespace ckpt::drift {
namespace {

using testing::MakeRandomSet;
using testing::RandomSet;
using testing::RelErr;

// Device copies of a RandomSet's arrays; tasks() points at them.
class DeviceSet {
 public:
  explicit DeviceSet(const RandomSet& set) : tasks_(set.tasks) {
    dev_.resize(set.storage.size(), nullptr);
    for (size_t i = 0; i < set.storage.size(); ++i) {
      const size_t bytes = set.storage[i].size_bytes();
      if (bytes == 0) continue;
      if (cudaMalloc(&dev_[i], bytes) != cudaSuccess ||
          cudaMemcpy(dev_[i], set.storage[i].data(), bytes, cudaMemcpyHostToDevice) !=
              cudaSuccess) {
        ok_ = false;
        return;
      }
    }
    for (size_t i = 0; i < tasks_.size(); ++i) {
      tasks_[i].w = dev_[3 * i];
      tasks_[i].m = dev_[3 * i + 1];
      tasks_[i].v = dev_[3 * i + 2];
    }
  }
  ~DeviceSet() {
    for (void* p : dev_) {
      if (p != nullptr) cudaFree(p);
    }
  }
  DeviceSet(const DeviceSet&) = delete;
  DeviceSet& operator=(const DeviceSet&) = delete;

  bool ok() const { return ok_; }
  const std::vector<TensorTask>& tasks() const { return tasks_; }

 private:
  std::vector<TensorTask> tasks_;
  std::vector<void*> dev_;
  bool ok_ = true;
};

class DriftCudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    kernel_ = MakeCudaDriftKernel(&why);
    if (kernel_ == nullptr) GTEST_SKIP() << "no CUDA drift kernel: " << why;
  }

  // Runs the CUDA kernel on device copies of `set` and compares every layer
  // with ComputeDriftCpu on the host arrays.
  void CheckAgainstCpu(const RandomSet& set) {
    DeviceSet dev(set);
    ASSERT_TRUE(dev.ok());
    std::vector<LayerSums> want(set.layers), got(set.layers, LayerSums{-1.0, -1.0});
    ComputeDriftCpu(set.tasks, &want, 2);
    std::string error;
    ASSERT_TRUE(kernel_->Compute(dev.tasks(), &got, &error)) << error;
    for (uint32_t l = 0; l < set.layers; ++l) {
      EXPECT_LE(RelErr(got[l].dw2, want[l].dw2), 1e-9) << "layer " << l;
      EXPECT_LE(RelErr(got[l].w2, want[l].w2), 1e-9) << "layer " << l;
    }
  }

  std::unique_ptr<DriftKernel> kernel_;
};

TEST_F(DriftCudaTest, Name) { EXPECT_STREQ(kernel_->name(), "cuda"); }

TEST_F(DriftCudaTest, MatchesCpuAwkwardSizes) {
  CheckAgainstCpu(MakeRandomSet(21, {1, 3, 4095, 4097, 100003, 1048577}, 7));
}

// One tensor per layer, so no layer sum hides a wrong combination.
TEST_F(DriftCudaTest, MatchesCpuOneLayerPerTensor) {
  const RandomSet probe = MakeRandomSet(22, {8193}, 1);
  CheckAgainstCpu(MakeRandomSet(22, {8193}, static_cast<uint32_t>(probe.tasks.size())));
}

// More layers than blocks and tensors smaller than a warp.
TEST_F(DriftCudaTest, ManySmallTensors) {
  std::vector<uint64_t> sizes;
  for (uint64_t n = 1; n < 40; ++n) sizes.push_back(n);
  CheckAgainstCpu(MakeRandomSet(23, sizes, 500));
}

// A tensor large enough that every block walks several chunks of it.
TEST_F(DriftCudaTest, LargeTensor) { CheckAgainstCpu(MakeRandomSet(24, {1 << 23}, 2)); }

TEST_F(DriftCudaTest, EmptyInputs) {
  std::vector<LayerSums> out(3, LayerSums{5.0, 5.0});
  std::string error;
  ASSERT_TRUE(kernel_->Compute({}, &out, &error)) << error;
  for (const LayerSums& s : out) {
    EXPECT_EQ(s.dw2, 0.0);
    EXPECT_EQ(s.w2, 0.0);
  }
  TensorTask empty;
  empty.layer = 1;
  empty.n = 0;
  ASSERT_TRUE(kernel_->Compute({empty}, &out, &error)) << error;
  EXPECT_EQ(out[1].w2, 0.0);
}

TEST_F(DriftCudaTest, RejectsLayerOutOfRange) {
  const RandomSet set = MakeRandomSet(25, {10}, 3);
  DeviceSet dev(set);
  ASSERT_TRUE(dev.ok());
  std::vector<LayerSums> out(2);
  std::string error;
  EXPECT_FALSE(kernel_->Compute(dev.tasks(), &out, &error));
  EXPECT_FALSE(error.empty());
}

// Repeated calls reuse the kernel's buffers and give the same sums.
TEST_F(DriftCudaTest, Repeatable) {
  const RandomSet set = MakeRandomSet(26, {4097, 65537}, 4);
  DeviceSet dev(set);
  ASSERT_TRUE(dev.ok());
  std::vector<LayerSums> first(set.layers), again(set.layers);
  std::string error;
  ASSERT_TRUE(kernel_->Compute(dev.tasks(), &first, &error)) << error;
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE(kernel_->Compute(dev.tasks(), &again, &error)) << error;
    for (uint32_t l = 0; l < set.layers; ++l) {
      EXPECT_LE(RelErr(again[l].dw2, first[l].dw2), 1e-12);
      EXPECT_LE(RelErr(again[l].w2, first[l].w2), 1e-12);
    }
  }
}

}  // namespace
}  // namespace ckpt::drift
