// Device resolution and the model's device/dtype placement (common/model/device.h, Model::Copy/To).
// References: the fp32 CPU model (checked against transformers in model_test) and libtorch's
// own fp32 -> bf16 rounding.
#include "common/model/device.h"

#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cmath>

#include "../precision_test_util.h"
#include "../test_util.h"

namespace grpo::common {
namespace {

using grpo::testing::MaxAbsDiff;
using grpo::testing::PrecisionIds;
using grpo::testing::PrecisionTinyModel;
using grpo::testing::SequenceLogprobs;

TEST(ResolveDevice, CpuIsAlwaysCpuAndAutoFollowsTheVisibleGpus) {
  auto cpu = ResolveDevice("cpu");
  ASSERT_TRUE(cpu.ok()) << cpu.status().ToString();
  EXPECT_TRUE(cpu->is_cpu());
  auto automatic = ResolveDevice("auto");
  ASSERT_TRUE(automatic.ok()) << automatic.status().ToString();
  EXPECT_EQ(automatic->is_cuda(), CudaAvailable());
}

TEST(ResolveDevice, UnknownSpellingsAreInvalidArgumentNamingTheKey) {
  for (const char* bad : {"gpu", "CPU", "cuda:", "cuda:x", "cuda0", "", "mps"}) {
    auto d = ResolveDevice(bad);
    ASSERT_FALSE(d.ok()) << bad;
    EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(d.status().message().find("'device'"), std::string::npos) << d.status().ToString();
  }
}

TEST(ResolveDevice, CudaWithoutAVisibleGpuIsInvalidArgument) {
  if (CudaAvailable()) GTEST_SKIP() << "a CUDA device is visible";
  for (const char* want : {"cuda", "cuda:0", "cuda:3"}) {
    auto d = ResolveDevice(want);
    ASSERT_FALSE(d.ok()) << want;
    EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(d.status().message().find("no CUDA device is visible"), std::string::npos)
        << d.status().ToString();
  }
}

TEST(ResolveDevice, CudaIndexPastTheVisibleGpusIsInvalidArgument) {
  if (!CudaAvailable()) GTEST_SKIP() << "no CUDA device";
  auto d = ResolveDevice("cuda:999");
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
}

// The warning of bf16 on a CPU that emulates it: none under 4x (a CPU with bf16 instructions
// multiplies bf16 no slower than fp32), the measured factor and the way out above.
TEST(CpuBf16, TheWarningNamesTheSlowdownAndTheKnobAboveFourTimes) {
  EXPECT_EQ(CpuBf16Warning({1e-3, 0.5e-3}), "");
  EXPECT_EQ(CpuBf16Warning({1e-3, 3.9e-3}), "");
  const std::string slow = CpuBf16Warning({1e-3, 155e-3});
  EXPECT_NE(slow.find("155x slower than fp32"), std::string::npos) << slow;
  EXPECT_NE(slow.find("set bf16: false"), std::string::npos) << slow;
  EXPECT_NE(CpuBf16Warning({1e-3, 4.5e-3}).find("4.5x slower"), std::string::npos);
  EXPECT_EQ(CpuBf16Warning({0, 1e-3}), "");  // nothing measured
}

// The measurement times the same product in both dtypes without touching the process's random
// state (seeded runs stay reproducible) or the caller's intra-op threads, and agrees with PyTorch's
// own timing of that product (tests/reference/bf16_matmul_speed.py, one intra-op thread too) on
// whether this CPU emulates bf16, wherever PyTorch's factor is clear: under 2x (bf16 instructions)
// or over 10x.
TEST(CpuBf16, TheMeasurementAgreesWithPyTorchOnWhetherThisCpuEmulatesBf16) {
  ASSERT_TRUE(grpo::testing::ReferencePythonHas("torch"));
  at::manual_seed(5);
  const at::Tensor before = at::rand({4});
  at::manual_seed(5);
  const int threads = at::get_num_threads();
  const CpuBf16Speed ours = MeasureCpuBf16Matmul();
  EXPECT_TRUE(at::equal(at::rand({4}), before)) << "the measurement drew from the global generator";
  EXPECT_EQ(at::get_num_threads(), threads) << "the measurement changed the caller's threads";
  ASSERT_TRUE(std::isfinite(ours.slowdown()) && ours.fp32_seconds > 0 && ours.bf16_seconds > 0);
  const nlohmann::json theirs = grpo::testing::RunReference(
      "bf16_matmul_speed.py", {{"m", 64}, {"k", 256}, {"n", 256}, {"threads", 1}});
  ASSERT_FALSE(theirs.is_null());
  const double factor = theirs["slowdown"].get<double>();
  std::printf("bf16 / fp32 on this CPU: %.2fx here, %.2fx in PyTorch\n", ours.slowdown(), factor);
  if (factor > 2 && factor < 10) {
    GTEST_SKIP() << "PyTorch's own factor " << factor << " is too near the threshold to decide";
  }
  EXPECT_EQ(!CpuBf16Warning(ours).empty(), factor >= 10)
      << "here " << ours.slowdown() << "x, PyTorch " << factor << "x";
}

TEST(ModelPlacement, Bf16CopyHoldsTheRoundedMasterAndLeavesItFp32) {
  auto master = PrecisionTinyModel();
  auto copy = master->Copy(at::kCPU, at::kBFloat16);
  ASSERT_TRUE(copy.ok()) << copy.status().ToString();
  EXPECT_EQ((*copy)->dtype(), at::kBFloat16);
  EXPECT_EQ(master->dtype(), at::kFloat);
  const auto m = master->NamedParameters(), c = (*copy)->NamedParameters();
  ASSERT_EQ(m.size(), c.size());
  for (size_t i = 0; i < m.size(); ++i) {
    EXPECT_EQ(m[i].first, c[i].first);
    EXPECT_EQ(c[i].second.scalar_type(), at::kBFloat16) << c[i].first;
    EXPECT_TRUE(at::equal(c[i].second, m[i].second.to(at::kBFloat16))) << c[i].first;
    EXPECT_EQ(m[i].second.scalar_type(), at::kFloat) << m[i].first;
  }
}

TEST(ModelPlacement, Fp32CopyHasItsOwnStorageAndTheSameOutputs) {
  auto master = PrecisionTinyModel();
  auto copy = master->Copy(at::kCPU, at::kFloat);
  ASSERT_TRUE(copy.ok());
  const at::Tensor ids = PrecisionIds();
  EXPECT_TRUE(at::equal(SequenceLogprobs(*master, ids), SequenceLogprobs(**copy, ids)));
  {
    at::NoGradGuard no_grad;
    (*copy)->Parameters()[0].add_(1.0);
  }
  EXPECT_FALSE(at::equal(master->Parameters()[0], (*copy)->Parameters()[0]));
}

TEST(ModelPlacement, InitRandomInBf16IsTheCastOfTheFp32Draw) {
  auto config = ModelConfigPreset("tiny");
  ASSERT_TRUE(config.ok());
  auto fp32 = Model::InitRandom(*config, 3);
  auto bf16 = Model::InitRandom(*config, 3, at::kCPU, at::kBFloat16);
  ASSERT_TRUE(fp32.ok() && bf16.ok());
  const auto a = (*fp32)->Parameters(), b = (*bf16)->Parameters();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(b[i], a[i].to(at::kBFloat16)));
}

TEST(ModelPlacement, IntegerDtypeIsInvalidArgument) {
  auto model = PrecisionTinyModel();
  EXPECT_EQ(model->To(at::kCPU, at::kLong).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(model->Copy(at::kCPU, at::kInt).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(model->dtype(), at::kFloat);
}

TEST(ModelPlacement, KvCacheFollowsTheModelDtype) {
  auto model = PrecisionTinyModel(at::kCPU, at::kBFloat16);
  const KvCache cache = model->NewCache(2, 8);
  EXPECT_EQ(cache.keys[0].scalar_type(), at::kBFloat16);
  EXPECT_EQ(cache.values[0].scalar_type(), at::kBFloat16);
  EXPECT_EQ(cache.next_position.scalar_type(), at::kLong);
}

// bf16 keeps 8 bits of mantissa (relative rounding 2^-9 per operation); logits of magnitude up
// to ~8 have a bf16 spacing of 0.03. Through 2 layers and an fp32 log-softmax over 259 tokens
// the per-token log-probs stay within 0.05 nats of fp32's (measured 0.01 on this model).
constexpr double kBf16LogprobTolerance = 0.05;

TEST(ModelPlacement, Bf16LogprobsAreWithinToleranceOfFp32) {
  auto fp32 = PrecisionTinyModel();
  auto bf16 = fp32->Copy(at::kCPU, at::kBFloat16);
  ASSERT_TRUE(bf16.ok());
  const at::Tensor ids = PrecisionIds();
  const at::Tensor a = SequenceLogprobs(*fp32, ids), b = SequenceLogprobs(**bf16, ids);
  EXPECT_EQ(b.scalar_type(), at::kFloat);
  const double diff = MaxAbsDiff(a, b);
  std::printf("bf16 vs fp32 log-probs: max |diff| %.5f nats\n", diff);
  EXPECT_LT(diff, kBf16LogprobTolerance);
  EXPECT_GT(diff, 0.0) << "the bf16 copy computed in fp32";
}

// The KV-cache decode in bf16 against the bf16 full forward of the same sequence: the two
// paths the worker and the learner run.
TEST(ModelPlacement, Bf16DecodeAgreesWithBf16FullForward) {
  auto model = PrecisionTinyModel(at::kCPU, at::kBFloat16);
  const at::Tensor ids = PrecisionIds();  // [3, 20]
  const at::Tensor full = SequenceLogprobs(*model, ids);
  at::NoGradGuard no_grad;
  KvCache cache = model->NewCache(ids.size(0), ids.size(1));
  at::Tensor logits = model->Prefill(ids.narrow(1, 0, 1), at::ones({3, 1}, at::kLong), cache);
  std::vector<at::Tensor> steps;
  for (int64_t t = 1; t < ids.size(1); ++t) {
    const at::Tensor next = ids.select(1, t);
    steps.push_back(logits.to(at::kFloat).log_softmax(-1).gather(-1, next.unsqueeze(1)).squeeze(1));
    logits = model->DecodeStep(next, cache);
  }
  EXPECT_LT(MaxAbsDiff(at::stack(steps, 1), full), kBf16LogprobTolerance);
}

// On the CPU in bf16/fp16 a KV-cache forward attends to its columns rounded up to 64 (at most
// the cache's capacity), so that oneDNN compiles a kernel per 64 columns, not per token; fp32
// (MKL's GEMM) and every CUDA device attend to the columns filled, as before.
TEST(ModelPlacement, HalfPrecisionOnTheCpuAttendsToColumnsRoundedUpTo64) {
  auto bf16 = PrecisionTinyModel(at::kCPU, at::kBFloat16);
  EXPECT_EQ(bf16->AttendedColumns(1, 200), 64);
  EXPECT_EQ(bf16->AttendedColumns(64, 200), 64);
  EXPECT_EQ(bf16->AttendedColumns(65, 200), 128);
  EXPECT_EQ(bf16->AttendedColumns(65, 100), 100);  // the capacity bounds it
  EXPECT_EQ(bf16->AttendedColumns(150, 150), 150);
  auto fp16 = PrecisionTinyModel(at::kCPU, at::kHalf);
  EXPECT_EQ(fp16->AttendedColumns(3, 200), 64);
  auto fp32 = PrecisionTinyModel();
  EXPECT_EQ(fp32->AttendedColumns(65, 200), 65);
  EXPECT_EQ(fp32->AttendedColumns(1, 200), 1);
}

// The columns past the filled ones are blocked whatever they hold: a cache whose unfilled
// columns hold large keys and values, and a key mask that says "real" there (what a reused
// buffer could hold), decodes exactly as a clean one. Without the blocking the decode attends
// to them and its logits move.
TEST(ModelPlacement, Bf16DecodeBlocksTheColumnsPastTheFilledOnes) {
  auto model = PrecisionTinyModel(at::kCPU, at::kBFloat16);
  const at::Tensor ids = PrecisionIds();  // [3, 20]
  at::NoGradGuard no_grad;
  const auto decode = [&](bool stale) {
    KvCache cache = model->NewCache(ids.size(0), 200);
    if (stale) {
      for (size_t li = 0; li < cache.keys.size(); ++li) {
        cache.keys[li].fill_(8.0);
        cache.values[li].fill_(-8.0);
      }
      cache.key_mask.fill_(true);
    }
    at::Tensor logits = model->Prefill(ids.narrow(1, 0, 4), at::ones({3, 4}, at::kLong), cache);
    std::vector<at::Tensor> out = {logits};
    for (int64_t t = 4; t < ids.size(1); ++t)
      out.push_back(model->DecodeStep(ids.select(1, t), cache));
    return at::stack(out, 1);
  };
  const at::Tensor clean = decode(false), stale = decode(true);
  EXPECT_TRUE(at::equal(clean, stale)) << "max |diff| " << MaxAbsDiff(clean, stale);
  // And the clean decode is the full forward's, within bf16's tolerance.
  const at::Tensor full = SequenceLogprobs(*model, ids);
  const at::Tensor next = ids.narrow(1, 4, ids.size(1) - 4);
  const at::Tensor steps = clean.narrow(1, 0, ids.size(1) - 4)
                               .to(at::kFloat)
                               .log_softmax(-1)
                               .gather(-1, next.unsqueeze(-1))
                               .squeeze(-1);
  EXPECT_LT(MaxAbsDiff(steps, full.narrow(1, 3, ids.size(1) - 4)), kBf16LogprobTolerance);
}

TEST(ModelPlacement, ABf16ModelSavesFp32ThatLoadsBackToItsValues) {
  auto bf16 = PrecisionTinyModel(at::kCPU, at::kBFloat16);
  const std::string dir = ::testing::TempDir() + "/grpo_device_test_bf16_save";
  ASSERT_TRUE(bf16->Save(dir).ok());
  auto loaded = Model::Load(dir);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  const auto a = bf16->Parameters(), b = (*loaded)->Parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(b[i].scalar_type(), at::kFloat);
    EXPECT_TRUE(at::equal(b[i], a[i].to(at::kFloat))) << i;
  }
  auto as_bf16 = Model::Load(dir, at::kCPU, at::kBFloat16);
  ASSERT_TRUE(as_bf16.ok());
  EXPECT_TRUE(at::equal((*as_bf16)->Parameters()[0], a[0]));
}

}  // namespace
}  // namespace grpo::common
