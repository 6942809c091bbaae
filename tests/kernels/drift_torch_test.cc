// The drift kernels against real PyTorch optimizer steps.
//
// tests/kernels/make_torch_golden.py (run with the tests' interpreter,
// CKPT_PYTHON) takes 3 AdamW / Adam / SGD steps on parameters of awkward sizes and dumps, after
// the last step, W_{t-1}, W_t and the optimizer state as raw f32. The kernel
// reconstructs ΔW from (W_t, state) alone; the truth is Σ(W_t - W_{t-1})² in
// f64 from the dumped weights. PyTorch updates in f32, so the two differ by
// the f32 rounding of W (≈6e-8 absolute against |ΔW| ≈ 1e-3): within 1e-3.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kernels/drift.h"
#include "tests/kernels/drift_test_util.h"

#ifndef CKPT_SOURCE_DIR
#error "CKPT_SOURCE_DIR must name the source tree"
#endif

namespace ckpt::drift {
namespace {

using testing::Array;
using testing::Encode;
using testing::RelErr;

constexpr char kPython[] = CKPT_PYTHON;

std::vector<float> ReadF32(const std::string& path, uint64_t n) {
  std::vector<float> v(n);
  std::ifstream in(path, std::ios::binary);
  in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n * sizeof(float)));
  if (!in || in.gcount() != static_cast<std::streamsize>(n * sizeof(float))) v.clear();
  return v;
}

struct Param {
  std::vector<float> w_prev, w, m, v;
};

struct GoldenRun {
  std::string name;
  Optimizer optimizer = Optimizer::kNone;
  double lr = 0, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0;
  uint64_t step = 0;
  std::vector<Param> params;
};

class DriftTorchTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (std::system((std::string(kPython) + " -c 'import torch' >/dev/null 2>&1").c_str()) != 0) {
      skip_reason_ = new std::string(std::string(kPython) + " cannot import torch");
      return;
    }
    std::string tmpl = (std::filesystem::temp_directory_path() / "drift_torch_XXXXXX").string();
    if (mkdtemp(tmpl.data()) == nullptr) {
      error_ = new std::string("mkdtemp failed");
      return;
    }
    dir_ = new std::string(tmpl);
    const std::string cmd = std::string(kPython) + " " + CKPT_SOURCE_DIR +
                            "/tests/kernels/make_torch_golden.py " + *dir_;
    if (std::system(cmd.c_str()) != 0) {
      error_ = new std::string("failed: " + cmd);
      return;
    }
    std::ifstream in(*dir_ + "/golden.json");
    const nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.contains("runs")) {
      error_ = new std::string("bad golden.json");
      return;
    }
    runs_ = new std::vector<GoldenRun>();
    for (const auto& r : j["runs"]) {
      GoldenRun run;
      run.name = r["name"].get<std::string>();
      run.optimizer = run.name == "adamw"  ? Optimizer::kAdamW
                      : run.name == "adam" ? Optimizer::kAdam
                                           : Optimizer::kSgd;
      run.lr = r["lr"].get<double>();
      run.weight_decay = r["weight_decay"].get<double>();
      if (r.contains("beta1")) {
        run.beta1 = r["beta1"].get<double>();
        run.beta2 = r["beta2"].get<double>();
        run.eps = r["eps"].get<double>();
      }
      run.step = r["step"].get<uint64_t>();
      for (const auto& p : r["params"]) {
        const uint64_t n = p["n"].get<uint64_t>();
        Param param;
        param.w_prev = ReadF32(p["wprev"].get<std::string>(), n);
        param.w = ReadF32(p["w"].get<std::string>(), n);
        param.m = ReadF32(p["m"].get<std::string>(), n);
        if (p.contains("v")) param.v = ReadF32(p["v"].get<std::string>(), n);
        if (param.w.size() != n || param.w_prev.size() != n || param.m.size() != n ||
            (p.contains("v") && param.v.size() != n)) {
          error_ = new std::string("short golden file for " + run.name);
          return;
        }
        run.params.push_back(std::move(param));
      }
      runs_->push_back(std::move(run));
    }
  }

  static void TearDownTestSuite() {
    if (dir_ != nullptr) {
      std::error_code ec;
      std::filesystem::remove_all(*dir_, ec);
    }
    delete dir_;
    delete runs_;
    delete skip_reason_;
    delete error_;
    dir_ = nullptr;
    runs_ = nullptr;
    skip_reason_ = nullptr;
    error_ = nullptr;
  }

  void SetUp() override {
    if (skip_reason_ != nullptr) GTEST_SKIP() << *skip_reason_;
    ASSERT_EQ(error_, nullptr) << *error_;
    ASSERT_NE(runs_, nullptr);
    ASSERT_EQ(runs_->size(), 3u);
  }

  // One task per parameter (layer = parameter index) over arrays of `dtype`
  // encoded from the dumped f32 values; `keep` owns the arrays.
  static std::vector<TensorTask> Tasks(const GoldenRun& run, DType dtype,
                                       std::vector<Array>* keep) {
    std::vector<TensorTask> tasks;
    keep->clear();
    keep->reserve(3 * run.params.size());
    for (size_t i = 0; i < run.params.size(); ++i) {
      const Param& p = run.params[i];
      keep->push_back(Encode(p.w, dtype));
      keep->push_back(Encode(p.m, dtype));
      keep->push_back(Encode(p.v, dtype));
      TensorTask t;
      t.layer = static_cast<uint32_t>(i);
      t.n = p.w.size();
      t.w = (*keep)[3 * i].data();
      t.w_dtype = dtype;
      t.m = (*keep)[3 * i + 1].data();
      t.m_dtype = dtype;
      t.v = p.v.empty() ? nullptr : (*keep)[3 * i + 2].data();
      t.v_dtype = dtype;
      t.optimizer = run.optimizer;
      t.lr = run.lr;
      t.beta1 = run.beta1;
      t.beta2 = run.beta2;
      t.eps = run.eps;
      t.weight_decay = run.weight_decay;
      t.step = run.step;
      tasks.push_back(t);
    }
    return tasks;
  }

  static double TrueDw2(const Param& p) {
    double s = 0;
    for (size_t k = 0; k < p.w.size(); ++k) {
      const double d = static_cast<double>(p.w[k]) - p.w_prev[k];
      s += d * d;
    }
    return s;
  }

  static std::string* dir_;
  static std::vector<GoldenRun>* runs_;
  static std::string* skip_reason_;
  static std::string* error_;
};

std::string* DriftTorchTest::dir_ = nullptr;
std::vector<GoldenRun>* DriftTorchTest::runs_ = nullptr;
std::string* DriftTorchTest::skip_reason_ = nullptr;
std::string* DriftTorchTest::error_ = nullptr;

// Measured relative error of dw2 against the f32 truth (Debian torch 1.13.1,
// sizes 1 / 4097 / 10000): adamw 2.0e-6 / 2.1e-6 / 1.3e-7,
// adam 8.9e-7 / 2.9e-6 / 2.3e-7, sgd 1.0e-7 / 6.1e-8 / 4.2e-8.
TEST_F(DriftTorchTest, F32MatchesRealSteps) {
  for (const GoldenRun& run : *runs_) {
    EXPECT_EQ(run.step, 3u) << run.name;
    std::vector<Array> keep;
    const std::vector<TensorTask> tasks = Tasks(run, DType::kF32, &keep);
    std::vector<LayerSums> out(tasks.size());
    ComputeDriftCpu(tasks, &out, 2);
    for (size_t i = 0; i < run.params.size(); ++i) {
      const Param& p = run.params[i];
      double w2 = 0;
      for (float x : p.w) w2 += static_cast<double>(x) * x;
      const double truth = TrueDw2(p);
      const double err = RelErr(out[i].dw2, truth);
      std::printf("%-5s n=%-6zu dw2 %.9g truth %.9g rel err %.3g\n", run.name.c_str(), p.w.size(),
                  out[i].dw2, truth, err);
      EXPECT_GT(truth, 0.0);
      EXPECT_LE(err, 1e-3) << run.name << " param " << i;
      EXPECT_LE(RelErr(out[i].w2, w2), 1e-9) << run.name << " param " << i;
    }
  }
}

// bf16 and f16 copies of the same state (W_t, m, v rounded from the f32
// dumps): the blocked kernel agrees with the scalar reference on the converted
// arrays within 1e-9. Against the f32 truth the narrowing costs, as measured
// (sizes 1 / 4097 / 10000):
//   bf16: adamw 3.0e-3 / 7.7e-5 / 8.8e-6, adam 3.1e-3 / 1.1e-4 / 3.8e-5,
//         sgd 3.8e-4 / 6.8e-5 / 2.8e-5
//   f16:  adamw 6.0e-5 / 1.5e-5 / 6.0e-6, adam 1.7e-4 / 4.9e-6 / 1.1e-5,
//         sgd 3.8e-4 / 1.3e-5 / 1.3e-6
TEST_F(DriftTorchTest, NarrowDTypesMatchScalarReference) {
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    for (const GoldenRun& run : *runs_) {
      std::vector<Array> keep;
      const std::vector<TensorTask> tasks = Tasks(run, dtype, &keep);
      std::vector<LayerSums> got(tasks.size()), want(tasks.size());
      ComputeDriftCpu(tasks, &got, 2);
      ComputeDriftScalar(tasks, &want);
      for (size_t i = 0; i < run.params.size(); ++i) {
        const double truth = TrueDw2(run.params[i]);
        std::printf("%-4s %-5s n=%-6zu rel err vs f32 truth %.3g\n", testing::DTypeName(dtype),
                    run.name.c_str(), run.params[i].w.size(), RelErr(got[i].dw2, truth));
        EXPECT_LE(RelErr(got[i].dw2, want[i].dw2), 1e-9) << run.name << " param " << i;
        EXPECT_LE(RelErr(got[i].w2, want[i].w2), 1e-9) << run.name << " param " << i;
        EXPECT_LE(RelErr(got[i].dw2, truth), 2e-2) << run.name << " param " << i;
      }
    }
  }
}

}  // namespace
}  // namespace ckpt::drift
