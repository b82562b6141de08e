// common/model/safetensors: files are hand-built byte by byte here, or written/read by the
// independent Python implementation in tests/reference/safetensors_ref.py (struct + json + numpy).
#include "common/model/safetensors.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "tests/test_util.h"

namespace grpo::common {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// ---- byte helpers -------------------------------------------------------------------------

std::string U64Le(uint64_t v) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return out;
}

std::string Bytes(std::initializer_list<int> bytes) {
  std::string out;
  for (int b : bytes) out.push_back(static_cast<char>(b));
  return out;
}

// length prefix + header + data, exactly as given (no padding added).
std::string MakeFile(const std::string& header, const std::string& data) {
  return U64Le(header.size()) + header + data;
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<double> ToDoubles(const at::Tensor& t) {
  at::Tensor d = t.to(at::kDouble).contiguous();
  return std::vector<double>(d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
}

std::vector<int64_t> ToInt64s(const at::Tensor& t) {
  at::Tensor d = t.to(at::kLong).contiguous();
  return std::vector<int64_t>(d.data_ptr<int64_t>(), d.data_ptr<int64_t>() + d.numel());
}

at::Tensor FromDoubles(std::vector<double> values, at::ScalarType dtype,
                       std::vector<int64_t> shape) {
  return at::tensor(values, at::kDouble).to(dtype).reshape(shape);
}

at::Tensor FromInt64s(std::vector<int64_t> values, at::ScalarType dtype,
                      std::vector<int64_t> shape) {
  return at::tensor(values, at::kLong).to(dtype).reshape(shape);
}

// A valid two-tensor file: "a" F32 [2] = {1.5, -2.0} at [0, 8), "i" I64 [1] = {-3} at [8, 16).
constexpr char kValidHeader[] = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                R"("i":{"dtype":"I64","shape":[1],"data_offsets":[8,16]}})";
std::string ValidData() {
  return Bytes({0x00, 0x00, 0xC0, 0x3F, 0x00, 0x00, 0x00, 0xC0,    // 1.5f, -2.0f
                0xFD, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF});  // int64 -3
}

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "safetensors_test.XXXXXX").string();
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  std::string Path(const std::string& name) const { return (fs::path(dir_) / name).string(); }

  // Writes `bytes` to a file and expects Open to fail with `code` and a message that names the
  // file and contains `problem`.
  void ExpectOpenFails(const std::string& bytes, StatusCode code, const std::string& problem) {
    const std::string path = Path("bad.safetensors");
    WriteBytes(path, bytes);
    auto file = SafetensorsFile::Open(path);
    ASSERT_FALSE(file.ok());
    EXPECT_EQ(file.status().code(), code) << file.status().ToString();
    EXPECT_NE(file.status().message().find(path), std::string::npos) << file.status().ToString();
    EXPECT_NE(file.status().message().find(problem), std::string::npos) << file.status().ToString();
  }

  std::string dir_;
};

// ---- reading hand-built files -------------------------------------------------------------

TEST_F(SafetensorsTest, ReadsHandBuiltFileOfEveryCoreDtype) {
  const std::string header = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                             R"("h":{"dtype":"F16","shape":[2],"data_offsets":[8,12]},)"
                             R"("b":{"dtype":"BF16","shape":[2],"data_offsets":[12,16]},)"
                             R"("i":{"dtype":"I64","shape":[1],"data_offsets":[16,24]},)"
                             R"("j":{"dtype":"I32","shape":[1,1],"data_offsets":[24,28]}})";
  const std::string data = Bytes({
      0x00, 0x00, 0xC0, 0x3F, 0x00, 0x00, 0x00, 0xC0,  // F32 0x3FC00000 = 1.5, 0xC0000000 = -2
      0x00, 0x3C, 0x00, 0xC1,                          // F16 0x3C00 = 1, 0xC100 = -2.5
      0x49, 0x40, 0xF7, 0xC2,                          // BF16 0x4049 = 3.140625, 0xC2F7 = -123.5
      0xFD, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF,  // I64 -3
      0x04, 0x03, 0x02, 0x01,                          // I32 0x01020304 = 16909060
  });
  const std::string path = Path("hand.safetensors");
  WriteBytes(path, MakeFile(header, data));

  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  auto a = (*file)->Get("a");
  auto h = (*file)->Get("h");
  auto b = (*file)->Get("b");
  auto i = (*file)->Get("i");
  auto j = (*file)->Get("j");
  ASSERT_TRUE(a.ok() && h.ok() && b.ok() && i.ok() && j.ok());
  EXPECT_EQ(a->scalar_type(), at::kFloat);
  EXPECT_EQ(h->scalar_type(), at::kHalf);
  EXPECT_EQ(b->scalar_type(), at::kBFloat16);
  EXPECT_EQ(i->scalar_type(), at::kLong);
  EXPECT_EQ(j->scalar_type(), at::kInt);
  EXPECT_EQ(ToDoubles(*a), (std::vector<double>{1.5, -2.0}));
  EXPECT_EQ(ToDoubles(*h), (std::vector<double>{1.0, -2.5}));
  EXPECT_EQ(ToDoubles(*b), (std::vector<double>{3.140625, -123.5}));
  EXPECT_EQ(ToInt64s(*i), (std::vector<int64_t>{-3}));
  EXPECT_EQ(ToInt64s(*j), (std::vector<int64_t>{16909060}));
  EXPECT_EQ(j->sizes().vec(), (std::vector<int64_t>{1, 1}));
}

TEST_F(SafetensorsTest, InfoDescribesEachTensor) {
  const std::string path = Path("valid.safetensors");
  WriteBytes(path, MakeFile(kValidHeader, ValidData()));
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  const SafetensorInfo* info = (*file)->Find("i");
  ASSERT_NE(info, nullptr);
  EXPECT_EQ(info->name, "i");
  EXPECT_EQ(info->dtype, at::kLong);
  EXPECT_EQ(info->shape, (std::vector<int64_t>{1}));
  EXPECT_EQ(info->begin, 8u);
  EXPECT_EQ(info->end, 16u);
  EXPECT_EQ((*file)->Find("missing"), nullptr);
  EXPECT_EQ((*file)->path(), path);
}

TEST_F(SafetensorsTest, AcceptsHeaderPaddedWithTrailingSpaces) {
  const std::string path = Path("padded.safetensors");
  WriteBytes(path, MakeFile(std::string(kValidHeader) + "       ", ValidData()));
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  auto a = (*file)->Get("a");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(ToDoubles(*a), (std::vector<double>{1.5, -2.0}));
}

TEST_F(SafetensorsTest, ReadsMetadataAsStringMap) {
  const std::string header =
      R"({"__metadata__":{"format":"pt","step":"7"},"x":{"dtype":"U8","shape":[1],)"
      R"("data_offsets":[0,1]}})";
  const std::string path = Path("meta.safetensors");
  WriteBytes(path, MakeFile(header, Bytes({0xAB})));
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_EQ((*file)->metadata(),
            (std::map<std::string, std::string>{{"format", "pt"}, {"step", "7"}}));
  EXPECT_EQ((*file)->Names(), (std::vector<std::string>{"x"}));  // __metadata__ is no tensor
  EXPECT_EQ(ToInt64s(*(*file)->Get("x")), (std::vector<int64_t>{0xAB}));
}

TEST_F(SafetensorsTest, NamesFollowDataOffsetsNotHeaderOrder) {
  const std::string header =
      R"({"first_in_header":{"dtype":"U8","shape":[1],"data_offsets":[2,3]},)"
      R"("second":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})";
  const std::string path = Path("order.safetensors");
  WriteBytes(path, MakeFile(header, Bytes({1, 2, 3})));
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_EQ((*file)->Names(), (std::vector<std::string>{"second", "first_in_header"}));
}

TEST_F(SafetensorsTest, ReadsScalarAndEmptyTensors) {
  const std::string header = R"({"scalar":{"dtype":"I32","shape":[],"data_offsets":[0,4]},)"
                             R"("empty":{"dtype":"F32","shape":[0,3],"data_offsets":[4,4]}})";
  const std::string path = Path("scalar.safetensors");
  WriteBytes(path, MakeFile(header, Bytes({0xFF, 0xFF, 0xFF, 0x7F})));
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  auto scalar = (*file)->Get("scalar");
  auto empty = (*file)->Get("empty");
  ASSERT_TRUE(scalar.ok() && empty.ok());
  EXPECT_EQ(scalar->dim(), 0);
  EXPECT_EQ(scalar->item<int32_t>(), 2147483647);
  EXPECT_EQ(empty->sizes().vec(), (std::vector<int64_t>{0, 3}));
}

TEST_F(SafetensorsTest, GetReturnsCopyThatOutlivesTheFile) {
  const std::string path = Path("valid.safetensors");
  WriteBytes(path, MakeFile(kValidHeader, ValidData()));
  at::Tensor a;
  {
    auto file = SafetensorsFile::Open(path);
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    a = *(*file)->Get("a");
  }  // unmapped here
  fs::remove(path);
  EXPECT_EQ(ToDoubles(a), (std::vector<double>{1.5, -2.0}));
}

TEST_F(SafetensorsTest, GetOfAbsentTensorIsNotFoundNamingFileAndTensor) {
  const std::string path = Path("valid.safetensors");
  WriteBytes(path, MakeFile(kValidHeader, ValidData()));
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  auto t = (*file)->Get("nope");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kNotFound);
  EXPECT_NE(t.status().message().find(path), std::string::npos);
  EXPECT_NE(t.status().message().find("'nope'"), std::string::npos);
}

TEST_F(SafetensorsTest, GetRejectsBoolByteOtherThanZeroOrOne) {
  const std::string path = Path("bool.safetensors");
  WriteBytes(path,
             MakeFile(R"({"f":{"dtype":"BOOL","shape":[2],"data_offsets":[0,2]}})", Bytes({1, 2})));
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  auto f = (*file)->Get("f");
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), StatusCode::kInvalidArgument);
}

// ---- malformed files: each is a Status naming the file, never a crash ----------------------

TEST_F(SafetensorsTest, OpenOfMissingFileIsNotFound) {
  const std::string path = Path("absent.safetensors");
  auto file = SafetensorsFile::Open(path);
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.status().code(), StatusCode::kNotFound);
  EXPECT_NE(file.status().message().find(path), std::string::npos);
}

TEST_F(SafetensorsTest, RejectsFileShorterThanLengthPrefix) {
  ExpectOpenFails(Bytes({1, 0, 0}), StatusCode::kDataLoss, "shorter than the 8-byte");
  ExpectOpenFails("", StatusCode::kDataLoss, "shorter than the 8-byte");
}

TEST_F(SafetensorsTest, RejectsHeaderLengthPastEndOfFile) {
  // Claims a 64-byte header; only 10 bytes follow.
  ExpectOpenFails(U64Le(64) + std::string(10, ' '), StatusCode::kDataLoss,
                  "runs past the end of the 18-byte file");
}

TEST_F(SafetensorsTest, RejectsAbsurdHeaderLengthBeforeAllocating) {
  // 2^40 would need a terabyte; the limit is checked before the file size or any allocation.
  ExpectOpenFails(U64Le(1ull << 40) + "{}", StatusCode::kInvalidArgument, "exceeds the");
  ExpectOpenFails(U64Le(100 * 1024 * 1024 + 1) + "{}", StatusCode::kInvalidArgument,
                  "exceeds the 104857600-byte limit");
}

TEST_F(SafetensorsTest, RejectsHeaderThatIsNotJson) {
  ExpectOpenFails(MakeFile(R"({"a": {"dtype": )", ""), StatusCode::kInvalidArgument,
                  "not valid JSON");
  ExpectOpenFails(MakeFile("", ""), StatusCode::kInvalidArgument, "not valid JSON");
  ExpectOpenFails(MakeFile("{\"\xFF\":1}", ""), StatusCode::kInvalidArgument,
                  "not valid JSON");  // invalid UTF-8
}

TEST_F(SafetensorsTest, RejectsHeaderThatIsNotAnObject) {
  ExpectOpenFails(MakeFile("[1, 2]", ""), StatusCode::kInvalidArgument, "not an object");
  ExpectOpenFails(MakeFile("\"text\"", ""), StatusCode::kInvalidArgument, "not an object");
}

TEST_F(SafetensorsTest, RejectsEntryWithMissingField) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"t":{"shape":[1],"data_offsets":[0,4]}})", "\"dtype\" is missing"},
      {R"({"t":{"dtype":"F32","data_offsets":[0,4]}})", "\"shape\" is missing"},
      {R"({"t":{"dtype":"F32","shape":[1]}})", "\"data_offsets\" is missing"},
  };
  for (const auto& [header, problem] : cases) {
    SCOPED_TRACE(header);
    ExpectOpenFails(MakeFile(header, std::string(4, '\0')), StatusCode::kInvalidArgument,
                    "tensor 't': " + problem);
  }
}

TEST_F(SafetensorsTest, RejectsEntryWithMistypedField) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"t":[1,2]})", "not a JSON object"},
      {R"({"t":{"dtype":7,"shape":[1],"data_offsets":[0,4]}})", "\"dtype\""},
      {R"({"t":{"dtype":"F32","shape":"1","data_offsets":[0,4]}})", "\"shape\""},
      {R"({"t":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", "\"shape\""},
      {R"({"t":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})", "\"shape\""},
      {R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", "\"data_offsets\""},
      {R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4,8]}})", "\"data_offsets\""},
      {R"({"t":{"dtype":"F32","shape":[1],"data_offsets":["0","4"]}})", "\"data_offsets\""},
      {R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]}})", "\"data_offsets\""},
  };
  for (const auto& [header, problem] : cases) {
    SCOPED_TRACE(header);
    ExpectOpenFails(MakeFile(header, std::string(8, '\0')), StatusCode::kInvalidArgument, problem);
  }
}

TEST_F(SafetensorsTest, RejectsUnknownDtype) {
  ExpectOpenFails(MakeFile(R"({"t":{"dtype":"Q4","shape":[1],"data_offsets":[0,1]}})", "x"),
                  StatusCode::kInvalidArgument, "unknown or unsupported dtype \"Q4\"");
}

TEST_F(SafetensorsTest, RejectsShapeThatDisagreesWithByteCount) {
  // F32 [2, 3] needs 24 bytes; the offsets span 20.
  ExpectOpenFails(MakeFile(R"({"t":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}})",
                           std::string(24, '\0')),
                  StatusCode::kInvalidArgument,
                  "needs 6 x 4 bytes but data_offsets [0, 20] span 20");
}

TEST_F(SafetensorsTest, RejectsShapeWhoseByteCountOverflows) {
  ExpectOpenFails(
      MakeFile(R"({"t":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", ""),
      StatusCode::kInvalidArgument, "tensor 't'");
}

TEST_F(SafetensorsTest, RejectsReversedOffsets) {
  ExpectOpenFails(
      MakeFile(R"({"t":{"dtype":"U8","shape":[0],"data_offsets":[4,0]}})", std::string(4, '\0')),
      StatusCode::kInvalidArgument, "data_offsets [4, 0] are reversed");
}

TEST_F(SafetensorsTest, RejectsOffsetsPastDataBuffer) {
  // The data buffer holds 8 bytes; "b" claims [100, 104).
  ExpectOpenFails(MakeFile(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                           R"("b":{"dtype":"F32","shape":[1],"data_offsets":[100,104]}})",
                           std::string(8, '\0')),
                  StatusCode::kDataLoss,
                  "tensor 'b' data_offsets [100, 104] run past the end of the 8-byte data buffer");
}

TEST_F(SafetensorsTest, RejectsOverlappingOffsets) {
  ExpectOpenFails(MakeFile(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                           R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                           std::string(12, '\0')),
                  StatusCode::kInvalidArgument, "tensors 'a' [0, 8] and 'b' [4, 12] overlap");
}

TEST_F(SafetensorsTest, RejectsTruncatedData) {
  std::string bytes = MakeFile(kValidHeader, ValidData());
  bytes.resize(bytes.size() - 3);  // the last 3 bytes of "i" are gone
  ExpectOpenFails(bytes, StatusCode::kDataLoss, "tensor 'i' data_offsets [8, 16]");
}

TEST_F(SafetensorsTest, RejectsMetadataThatIsNotAStringMap) {
  ExpectOpenFails(MakeFile(R"({"__metadata__":{"step":7}})", ""), StatusCode::kInvalidArgument,
                  "\"__metadata__\" value for 'step' is not a string");
  ExpectOpenFails(MakeFile(R"({"__metadata__":[]})", ""), StatusCode::kInvalidArgument,
                  "\"__metadata__\" is not an object");
}

// ---- writing -------------------------------------------------------------------------------

TEST_F(SafetensorsTest, WritesSortedHeaderPaddedToEightThenRawLittleEndianData) {
  const std::string path = Path("out.safetensors");
  // "m" is listed first but "w" has the wider element, so "w" goes first in the data buffer.
  const NamedTensors tensors = {{"m", FromDoubles({1.0}, at::kHalf, {1})},
                                {"w", FromDoubles({1.0, 2.0}, at::kFloat, {2})}};
  ASSERT_TRUE(WriteSafetensors(path, tensors, {{"k", "v"}}).ok());

  const std::string expected_json =
      R"({"__metadata__":{"k":"v"},"m":{"data_offsets":[8,10],"dtype":"F16","shape":[1]},)"
      R"("w":{"data_offsets":[0,8],"dtype":"F32","shape":[2]}})";
  const size_t padded = (expected_json.size() + 7) / 8 * 8;
  const std::string expected =
      U64Le(padded) + expected_json + std::string(padded - expected_json.size(), ' ') +
      Bytes({0x00, 0x00, 0x80, 0x3F, 0x00, 0x00, 0x00, 0x40,  // F32 1.0, 2.0
             0x00, 0x3C});                                    // F16 1.0
  EXPECT_EQ(ReadBytes(path), expected);
  EXPECT_FALSE(fs::exists(path + ".tmp"));
}

TEST_F(SafetensorsTest, RoundTripsEachDtype) {
  struct Case {
    at::ScalarType dtype;
    std::vector<double> values;  // exactly representable in dtype
  };
  const std::vector<Case> cases = {
      {at::kDouble, {0, 1, -2.5, 0.1, 1e300, -7}}, {at::kFloat, {0, 1, -2.5, 0.375, 0x1p100, -7}},
      {at::kHalf, {0, 1, -2.5, 0.375, 65504, -7}}, {at::kBFloat16, {0, 1, -2.5, 0.375, 1024, -7}},
      {at::kLong, {0, 1, -2, 1e15, -128, 127}},    {at::kInt, {0, 1, -2, 2e9, -128, 127}},
      {at::kShort, {0, 1, -2, 32767, -128, 127}},  {at::kChar, {0, 1, -2, 100, -128, 127}},
      {at::kByte, {0, 1, 2, 100, 128, 255}},       {at::kBool, {1, 0, 1, 1, 0, 0}},
  };
  NamedTensors tensors;
  for (const Case& c : cases) {
    tensors.emplace_back(c10::toString(c.dtype), FromDoubles(c.values, c.dtype, {2, 3}));
  }
  const std::string path = Path("all.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, tensors).ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  for (const Case& c : cases) {
    SCOPED_TRACE(c10::toString(c.dtype));
    auto t = (*file)->Get(c10::toString(c.dtype));
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    EXPECT_EQ(t->scalar_type(), c.dtype);
    EXPECT_EQ(t->sizes().vec(), (std::vector<int64_t>{2, 3}));
    EXPECT_EQ(ToDoubles(*t), c.values);
  }
}

TEST_F(SafetensorsTest, OutputDoesNotDependOnInputOrder) {
  const at::Tensor a = FromDoubles({1, 2, 3}, at::kHalf, {3});
  const at::Tensor b = FromInt64s({4, 5}, at::kLong, {2});
  const at::Tensor c = FromInt64s({6}, at::kByte, {1});
  ASSERT_TRUE(WriteSafetensors(Path("abc"), {{"a", a}, {"b", b}, {"c", c}}).ok());
  ASSERT_TRUE(WriteSafetensors(Path("cba"), {{"c", c}, {"b", b}, {"a", a}}).ok());
  EXPECT_EQ(ReadBytes(Path("abc")), ReadBytes(Path("cba")));
}

TEST_F(SafetensorsTest, WritesNonContiguousTensorInLogicalOrder) {
  const at::Tensor transposed = FromInt64s({0, 1, 2, 3, 4, 5}, at::kInt, {2, 3}).t();  // [3, 2]
  ASSERT_FALSE(transposed.is_contiguous());
  const std::string path = Path("t.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, {{"t", transposed}}).ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  auto t = (*file)->Get("t");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->sizes().vec(), (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(ToInt64s(*t), (std::vector<int64_t>{0, 3, 1, 4, 2, 5}));
}

TEST_F(SafetensorsTest, RewriteReplacesFileAndLeavesNoTemporary) {
  const std::string path = Path("w.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, {{"x", FromInt64s({1}, at::kInt, {1})}}).ok());
  ASSERT_TRUE(WriteSafetensors(path, {{"y", FromInt64s({2, 3}, at::kInt, {2})}}).ok());
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_EQ((*file)->Names(), (std::vector<std::string>{"y"}));
  EXPECT_EQ(ToInt64s(*(*file)->Get("y")), (std::vector<int64_t>{2, 3}));
}

TEST_F(SafetensorsTest, WriteIntoMissingDirectoryFailsNamingThePath) {
  const std::string path = Path("no/such/dir/w.safetensors");
  Status s = WriteSafetensors(path, {{"x", FromInt64s({1}, at::kInt, {1})}});
  EXPECT_EQ(s.code(), StatusCode::kNotFound) << s.ToString();
  EXPECT_NE(s.message().find(path), std::string::npos) << s.ToString();
}

TEST_F(SafetensorsTest, WriteRejectsDuplicateNames) {
  const at::Tensor t = FromInt64s({1}, at::kInt, {1});
  Status s = WriteSafetensors(Path("d"), {{"x", t}, {"x", t}});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("'x': duplicate name"), std::string::npos) << s.ToString();
  EXPECT_FALSE(fs::exists(Path("d")));
}

TEST_F(SafetensorsTest, WriteRejectsUnsupportedDtype) {
  Status s = WriteSafetensors(Path("c"), {{"z", at::zeros({2}, at::kComplexFloat)}});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("'z'"), std::string::npos) << s.ToString();
  EXPECT_FALSE(fs::exists(Path("c")));
}

TEST_F(SafetensorsTest, WriteRejectsUndefinedTensorAndReservedName) {
  EXPECT_EQ(WriteSafetensors(Path("u"), {{"u", at::Tensor()}}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(WriteSafetensors(Path("r"), {{"__metadata__", FromInt64s({1}, at::kInt, {1})}}).code(),
            StatusCode::kInvalidArgument);
}

// ---- checkpoints ---------------------------------------------------------------------------

// 16 + 8 + 16 + 3 = 43 bytes of data.
NamedTensors CheckpointTensors() {
  return {{"a", FromDoubles({1, 2, 3, 4}, at::kFloat, {4})},
          {"b", FromDoubles({5, 6}, at::kFloat, {2})},
          {"c", FromInt64s({7, 8}, at::kLong, {2})},
          {"d", FromInt64s({9, 10, 11}, at::kByte, {3})}};
}

TEST_F(SafetensorsTest, SmallCheckpointIsOneFile) {
  const std::string dir = Path("ckpt");
  ASSERT_TRUE(WriteSafetensorsCheckpoint(dir, CheckpointTensors()).ok());
  EXPECT_TRUE(fs::exists(fs::path(dir) / "model.safetensors"));
  EXPECT_FALSE(fs::exists(fs::path(dir) / "model.safetensors.index.json"));
  auto ckpt = SafetensorsCheckpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  EXPECT_EQ((*ckpt)->Names(), (std::vector<std::string>{"a", "b", "c", "d"}));
  EXPECT_EQ(ToDoubles(*(*ckpt)->Get("a")), (std::vector<double>{1, 2, 3, 4}));
  EXPECT_EQ((*ckpt)->FileOf("d"), (fs::path(dir) / "model.safetensors").string());
}

TEST_F(SafetensorsTest, LargeCheckpointIsShardedGreedilyWithIndex) {
  const std::string dir = Path("ckpt");
  // Limit 24: a(16)+b(8) fill shard 1; c(16) would overflow it, so c and d(3) form shard 2.
  ASSERT_TRUE(WriteSafetensorsCheckpoint(dir, CheckpointTensors(), 24).ok());
  const std::string s1 = "model-00001-of-00002.safetensors";
  const std::string s2 = "model-00002-of-00002.safetensors";
  EXPECT_FALSE(fs::exists(fs::path(dir) / "model.safetensors"));
  const json index = json::parse(ReadBytes(Path("ckpt/model.safetensors.index.json")));
  EXPECT_EQ(index,
            json::parse(R"({"metadata":{"total_size":43},"weight_map":{"a":")" + s1 + R"(","b":")" +
                        s1 + R"(","c":")" + s2 + R"(","d":")" + s2 + R"("}})"));

  auto ckpt = SafetensorsCheckpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  EXPECT_EQ((*ckpt)->Names(), (std::vector<std::string>{"a", "b", "c", "d"}));
  EXPECT_EQ((*ckpt)->FileOf("b"), (fs::path(dir) / s1).string());
  EXPECT_EQ((*ckpt)->FileOf("c"), (fs::path(dir) / s2).string());
  EXPECT_EQ((*ckpt)->FileOf("zz"), "");
  EXPECT_EQ((*ckpt)->Find("zz"), nullptr);
  ASSERT_NE((*ckpt)->Find("c"), nullptr);
  EXPECT_EQ((*ckpt)->Find("c")->dtype, at::kLong);
  EXPECT_EQ(ToInt64s(*(*ckpt)->Get("c")), (std::vector<int64_t>{7, 8}));
  EXPECT_EQ(ToInt64s(*(*ckpt)->Get("d")), (std::vector<int64_t>{9, 10, 11}));
  EXPECT_EQ((*ckpt)->Get("zz").status().code(), StatusCode::kNotFound);
}

TEST_F(SafetensorsTest, ShardedRewriteRemovesStaleSingleFile) {
  const std::string dir = Path("ckpt");
  ASSERT_TRUE(WriteSafetensorsCheckpoint(dir, {{"old", FromInt64s({1}, at::kByte, {1})}}).ok());
  ASSERT_TRUE(WriteSafetensorsCheckpoint(dir, CheckpointTensors(), 24).ok());
  EXPECT_FALSE(fs::exists(fs::path(dir) / "model.safetensors"));
  auto ckpt = SafetensorsCheckpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  EXPECT_EQ((*ckpt)->Names(), (std::vector<std::string>{"a", "b", "c", "d"}));
}

TEST_F(SafetensorsTest, CheckpointWriteRejectsDuplicateNamesAcrossShards) {
  const at::Tensor t = FromInt64s({1, 2, 3, 4}, at::kLong, {4});
  Status s = WriteSafetensorsCheckpoint(Path("ckpt"), {{"x", t}, {"x", t}}, 32);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
}

TEST_F(SafetensorsTest, OpenOfDirectoryWithoutWeightsIsNotFound) {
  auto ckpt = SafetensorsCheckpoint::Open(dir_);
  ASSERT_FALSE(ckpt.ok());
  EXPECT_EQ(ckpt.status().code(), StatusCode::kNotFound);
  EXPECT_NE(ckpt.status().message().find(dir_), std::string::npos);
}

TEST_F(SafetensorsTest, IndexPointingToMissingShardIsNotFound) {
  WriteBytes(Path("model.safetensors.index.json"),
             R"({"metadata":{},"weight_map":{"w":"model-00001-of-00001.safetensors"}})");
  auto ckpt = SafetensorsCheckpoint::Open(dir_);
  ASSERT_FALSE(ckpt.ok());
  EXPECT_EQ(ckpt.status().code(), StatusCode::kNotFound);
  const std::string& m = ckpt.status().message();
  EXPECT_NE(m.find(Path("model.safetensors.index.json")), std::string::npos) << m;
  EXPECT_NE(m.find("'model-00001-of-00001.safetensors'"), std::string::npos) << m;
}

TEST_F(SafetensorsTest, IndexNamingTensorAbsentFromItsShardIsNotFound) {
  WriteBytes(Path("shard.safetensors"), MakeFile(kValidHeader, ValidData()));
  WriteBytes(Path("model.safetensors.index.json"),
             R"({"weight_map":{"a":"shard.safetensors","ghost":"shard.safetensors"}})");
  auto ckpt = SafetensorsCheckpoint::Open(dir_);
  ASSERT_FALSE(ckpt.ok());
  EXPECT_EQ(ckpt.status().code(), StatusCode::kNotFound);
  const std::string& m = ckpt.status().message();
  EXPECT_NE(m.find("tensor 'ghost'"), std::string::npos) << m;
  EXPECT_NE(m.find(Path("shard.safetensors")), std::string::npos) << m;
}

TEST_F(SafetensorsTest, MalformedIndexIsInvalidArgument) {
  const std::vector<std::string> cases = {
      "not json",
      R"({"metadata":{}})",
      R"({"weight_map":["a"]})",
      R"({"weight_map":{"a":3}})",
      R"({"weight_map":{"a":"../elsewhere.safetensors"}})",
  };
  for (const std::string& text : cases) {
    SCOPED_TRACE(text);
    WriteBytes(Path("model.safetensors.index.json"), text);
    auto ckpt = SafetensorsCheckpoint::Open(dir_);
    ASSERT_FALSE(ckpt.ok());
    EXPECT_EQ(ckpt.status().code(), StatusCode::kInvalidArgument) << ckpt.status().ToString();
    EXPECT_NE(ckpt.status().message().find("model.safetensors.index.json"), std::string::npos);
  }
}

TEST_F(SafetensorsTest, CorruptShardErrorNamesIndexAndShard) {
  WriteBytes(Path("s.safetensors"), Bytes({1, 2}));
  WriteBytes(Path("model.safetensors.index.json"), R"({"weight_map":{"a":"s.safetensors"}})");
  auto ckpt = SafetensorsCheckpoint::Open(dir_);
  ASSERT_FALSE(ckpt.ok());
  EXPECT_EQ(ckpt.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(ckpt.status().message().find(Path("model.safetensors.index.json")), std::string::npos);
  EXPECT_NE(ckpt.status().message().find(Path("s.safetensors")), std::string::npos);
}

// ---- cross-check with the independent Python implementation --------------------------------

std::string ReferenceScript() {
  const char* root = std::getenv("GRPO_SOURCE_DIR");
  const fs::path base = root != nullptr
                            ? fs::path(root)
                            : fs::path(__FILE__).parent_path().parent_path().parent_path();
  return (base / "tests" / "reference" / "safetensors_ref.py").string();
}

// Runs safetensors_ref.py `command` `target` and parses its stdout; fails the test on error.
json RunReference(const std::string& command, const std::string& target) {
  const std::string cmd = "'" + grpo::testing::ReferencePython() + "' '" + ReferenceScript() +
                          "' " + command + " '" + target + "'";
  FILE* pipe = ::popen(cmd.c_str(), "r");
  EXPECT_NE(pipe, nullptr) << cmd;
  if (pipe == nullptr) return json();
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), pipe)) > 0) out.append(buf, n);
  const int rc = ::pclose(pipe);
  EXPECT_EQ(rc, 0) << cmd << "\n" << out;
  return json::parse(out, nullptr, /*allow_exceptions=*/false);
}

#define SKIP_WITHOUT_PYTHON()                             \
  ASSERT_TRUE(grpo::testing::ReferencePythonHas("numpy")) \
      << grpo::testing::ReferencePython() << " cannot import numpy (deploy/setup.sh)"

// Compares a tensor read by C++ with the reference's value list (floats exactly, as float64).
void ExpectMatchesReference(const at::Tensor& t, const json& ref) {
  std::vector<int64_t> shape = ref["shape"].get<std::vector<int64_t>>();
  EXPECT_EQ(t.sizes().vec(), shape);
  EXPECT_EQ(SafetensorsDtypeName(t.scalar_type()).value(), ref["dtype"].get<std::string>());
  const std::string dtype = ref["dtype"];
  if (dtype == "BOOL") {
    std::vector<int64_t> expected;
    for (const json& v : ref["values"]) expected.push_back(v.get<bool>() ? 1 : 0);
    EXPECT_EQ(ToInt64s(t), expected);
  } else if (dtype[0] == 'F' || dtype == "BF16") {
    EXPECT_EQ(ToDoubles(t), ref["values"].get<std::vector<double>>());
  } else {
    EXPECT_EQ(ToInt64s(t), ref["values"].get<std::vector<int64_t>>());
  }
}

TEST_F(SafetensorsTest, PythonReferenceReadsWhatCppWrites) {
  SKIP_WITHOUT_PYTHON();
  const std::string path = Path("cpp.safetensors");
  const NamedTensors tensors = {
      {"f32", FromDoubles({0.5, -1.25, 3e-5}, at::kFloat, {3})},
      {"f16", FromDoubles({1, -2.5, 65504, 0.000060975551605224609375}, at::kHalf, {2, 2})},
      {"bf16", FromDoubles({3.140625, -123.5, 1e30}, at::kBFloat16, {3, 1})},
      {"i64", FromInt64s({-(int64_t{1} << 40), 7, int64_t{1} << 62}, at::kLong, {3})},
      {"i32", FromInt64s({-7, 0, 2147483647}, at::kInt, {3})},
      {"u8", FromInt64s({0, 255}, at::kByte, {2})},
      {"bool", FromInt64s({1, 0, 0}, at::kBool, {3})},
      {"big", at::arange(1000, at::kFloat).reshape({10, 100})},
  };
  ASSERT_TRUE(WriteSafetensors(path, tensors, {{"format", "pt"}}).ok());

  const json ref = RunReference("read", path);
  ASSERT_TRUE(ref.is_object());
  EXPECT_EQ(ref["data_start"].get<uint64_t>() % 8, 0u);
  EXPECT_TRUE(ref["header_padding_is_spaces"].get<bool>());
  EXPECT_EQ(ref["metadata"], json::parse(R"({"format":"pt"})"));
  // 12 + 8 + 6 + 24 + 12 + 2 + 3 + 4000 bytes, no gaps.
  EXPECT_EQ(ref["data_len"].get<uint64_t>(), 4067u);
  const json& t = ref["tensors"];
  EXPECT_EQ(t["f32"]["values"].get<std::vector<double>>(),
            (std::vector<double>{0.5, -1.25, static_cast<double>(3e-5f)}));
  EXPECT_EQ(t["f16"]["values"].get<std::vector<double>>(),
            (std::vector<double>{1, -2.5, 65504, 0.000060975551605224609375}));
  EXPECT_EQ(t["f16"]["shape"], json::parse("[2, 2]"));
  // bf16(1e30): float32 1e30 = 0x7149F2CA rounds to 0x714A, i.e. 1.578125 * 2^99.
  EXPECT_EQ(t["bf16"]["values"].get<std::vector<double>>(),
            (std::vector<double>{3.140625, -123.5, 1.578125 * std::ldexp(1.0, 99)}));
  EXPECT_EQ(t["i64"]["values"].get<std::vector<int64_t>>(),
            (std::vector<int64_t>{-(int64_t{1} << 40), 7, int64_t{1} << 62}));
  EXPECT_EQ(t["i32"]["values"].get<std::vector<int64_t>>(),
            (std::vector<int64_t>{-7, 0, 2147483647}));
  EXPECT_EQ(t["u8"]["values"].get<std::vector<int64_t>>(), (std::vector<int64_t>{0, 255}));
  EXPECT_EQ(t["bool"]["values"], json::parse("[true, false, false]"));
  EXPECT_EQ(t["big"]["sum"].get<double>(), 499500.0);  // 0 + 1 + ... + 999
  EXPECT_EQ(t["big"]["dtype"], "F32");
}

TEST_F(SafetensorsTest, CppReadsWhatPythonReferenceWrites) {
  SKIP_WITHOUT_PYTHON();
  const std::string path = Path("py.safetensors");
  const json ref = RunReference("write", path);
  ASSERT_TRUE(ref.is_object());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_EQ((*file)->metadata(), (ref["metadata"].get<std::map<std::string, std::string>>()));
  ASSERT_EQ((*file)->Names().size(), ref["tensors"].size());
  for (const auto& [name, expected] : ref["tensors"].items()) {
    SCOPED_TRACE(name);
    auto t = (*file)->Get(name);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    ExpectMatchesReference(*t, expected);
  }
  // Rounding of 0.1 checked by hand too: f16 0x2E66 = 1638/16384; bf16 0x3DCD = 0x3DCD0000.
  EXPECT_EQ(ToDoubles(*(*file)->Get("half"))[2], 0.0999755859375);
  EXPECT_EQ(ToDoubles(*(*file)->Get("brain"))[2], 0.10009765625);
}

TEST_F(SafetensorsTest, CppReadsPythonReferenceShardedCheckpoint) {
  SKIP_WITHOUT_PYTHON();
  const std::string dir = Path("pyckpt");
  const json ref = RunReference("write-checkpoint", dir);
  ASSERT_TRUE(ref.is_object());
  auto ckpt = SafetensorsCheckpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  ASSERT_EQ((*ckpt)->Names().size(), ref["tensors"].size());
  for (const auto& [name, expected] : ref["tensors"].items()) {
    SCOPED_TRACE(name);
    EXPECT_EQ((*ckpt)->FileOf(name),
              (fs::path(dir) / ref["weight_map"][name].get<std::string>()).string());
    auto t = (*ckpt)->Get(name);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    ExpectMatchesReference(*t, expected);
  }
}

// The reference reads CheckpointTensors() from `dir`, sharded at 24 bytes: a and b in the first
// file, c and d in the second.
void ExpectReferenceReadsShardedCheckpointTensors(const std::string& dir) {
  const json ref = RunReference("read-checkpoint", dir);
  ASSERT_TRUE(ref.is_object());
  const json& t = ref["tensors"];
  EXPECT_EQ(t["a"]["values"].get<std::vector<double>>(), (std::vector<double>{1, 2, 3, 4}));
  EXPECT_EQ(t["b"]["values"].get<std::vector<double>>(), (std::vector<double>{5, 6}));
  EXPECT_EQ(t["c"]["values"].get<std::vector<int64_t>>(), (std::vector<int64_t>{7, 8}));
  EXPECT_EQ(t["d"]["values"].get<std::vector<int64_t>>(), (std::vector<int64_t>{9, 10, 11}));
  for (const char* name : {"a", "b"})
    EXPECT_EQ(t[name]["file"], "model-00001-of-00002.safetensors");
  for (const char* name : {"c", "d"})
    EXPECT_EQ(t[name]["file"], "model-00002-of-00002.safetensors");
  EXPECT_EQ(ref["index"]["metadata"]["total_size"], 43);
}

TEST_F(SafetensorsTest, PythonReferenceReadsCppShardedCheckpoint) {
  SKIP_WITHOUT_PYTHON();
  const std::string dir = Path("ckpt");
  ASSERT_TRUE(WriteSafetensorsCheckpoint(dir, CheckpointTensors(), 24, {{"format", "pt"}}).ok());
  ExpectReferenceReadsShardedCheckpointTensors(dir);
}

// The streaming writer (what a sharded learner's checkpoint goes through): tensors handed over
// one at a time in reverse order, into shards, read back by the independent reference with the
// values and files of the sharded checkpoint above.
TEST_F(SafetensorsTest, StreamingWriterTakesTensorsInAnyOrderIntoShards) {
  SKIP_WITHOUT_PYTHON();
  const std::string dir = Path("ckpt");
  const NamedTensors tensors = CheckpointTensors();
  std::vector<SafetensorSpec> specs;
  for (const auto& [name, t] : tensors) specs.push_back({name, t.scalar_type(), t.sizes().vec()});
  auto writer = SafetensorsWriter::CreateCheckpoint(dir, specs, 24, {{"format", "pt"}});
  ASSERT_TRUE(writer.ok()) << writer.status().ToString();
  for (auto it = tensors.rbegin(); it != tensors.rend(); ++it) {
    ASSERT_TRUE((*writer)->Write(it->first, it->second).ok()) << it->first;
  }
  // Nothing is visible before Finish: only the temporary files.
  EXPECT_FALSE(fs::exists(fs::path(dir) / "model-00001-of-00002.safetensors"));
  EXPECT_FALSE(fs::exists(fs::path(dir) / "model.safetensors.index.json"));
  ASSERT_TRUE((*writer)->Finish().ok());
  ExpectReferenceReadsShardedCheckpointTensors(dir);
  for (const auto& e : fs::directory_iterator(dir)) {
    EXPECT_NE(e.path().extension(), ".tmp") << e.path();
  }
}

// A tensor not declared, written twice or of another dtype or shape is refused; a writer that
// never got every tensor fails Finish naming one, and when destroyed leaves the directory's
// earlier checkpoint as it was, with no temporary file.
TEST_F(SafetensorsTest, StreamingWriterRefusesWhatWasNotDeclaredAndLeavesNoPartialCheckpoint) {
  const std::string dir = Path("ckpt");
  ASSERT_TRUE(WriteSafetensorsCheckpoint(dir, {{"old", FromInt64s({1}, at::kByte, {1})}}).ok());
  {
    auto writer = SafetensorsWriter::CreateCheckpoint(
        dir, {{"a", at::kFloat, {4}}, {"b", at::kFloat, {2}}}, /*max_shard_bytes=*/8);
    ASSERT_TRUE(writer.ok()) << writer.status().ToString();
    const at::Tensor a = FromDoubles({1, 2, 3, 4}, at::kFloat, {4});
    EXPECT_EQ((*writer)->Write("zz", a).code(), StatusCode::kInvalidArgument);
    EXPECT_EQ((*writer)->Write("a", FromDoubles({1, 2, 3, 4}, at::kDouble, {4})).code(),
              StatusCode::kInvalidArgument);
    EXPECT_EQ((*writer)->Write("a", FromDoubles({1, 2, 3, 4}, at::kFloat, {2, 2})).code(),
              StatusCode::kInvalidArgument);
    ASSERT_TRUE((*writer)->Write("a", a).ok());
    const Status twice = (*writer)->Write("a", a);
    EXPECT_EQ(twice.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(twice.message().find("written already"), std::string::npos) << twice.ToString();
    const Status finished = (*writer)->Finish();
    EXPECT_EQ(finished.code(), StatusCode::kFailedPrecondition);
    EXPECT_NE(finished.message().find("'b'"), std::string::npos) << finished.ToString();
  }
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(dir)) files.push_back(e.path().filename());
  EXPECT_EQ(files, (std::vector<std::string>{"model.safetensors"}));
  auto ckpt = SafetensorsCheckpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  EXPECT_EQ((*ckpt)->Names(), (std::vector<std::string>{"old"}));
  // A spec that could never be written is refused before a file is made.
  auto reserved =
      SafetensorsWriter::CreateCheckpoint(Path("other"), {{"__metadata__", at::kFloat, {1}}});
  EXPECT_EQ(reserved.status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace grpo::common
