#include "common/atomic_file.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace grpo::common {
namespace {

namespace fs = std::filesystem;

std::string Read(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

class AtomicFile : public ::testing::TestWithParam<Durability> {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("atomic_file_test_" + std::to_string(::getpid()) + "_" +
                                        std::to_string(static_cast<int>(GetParam())));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_P(AtomicFile, WritesThenReplacesTheWholeFileAndLeavesNoTemporary) {
  const fs::path file = dir_ / "f.json";
  const std::string first(100000, 'a');  // larger than one write of a pipe-sized buffer
  ASSERT_TRUE(WriteFileAtomically(file.string(), first, GetParam()).ok());
  EXPECT_EQ(Read(file), first);
  std::string second = "line\n";
  second.push_back('\0');  // bytes, not a C string
  second += "after the nul";
  ASSERT_TRUE(WriteFileAtomically(file.string(), second, GetParam()).ok());
  EXPECT_EQ(Read(file), second);
  EXPECT_FALSE(fs::exists(dir_ / "f.json.tmp"));
  ASSERT_TRUE(WriteFileAtomically(file.string(), "", GetParam()).ok());
  EXPECT_EQ(fs::file_size(file), 0u);
}

TEST_P(AtomicFile, AMissingDirectoryIsNotFoundAndCreatesNothing) {
  const fs::path file = dir_ / "no_such_dir" / "f";
  const Status s = WriteFileAtomically(file.string(), "x", GetParam());
  EXPECT_EQ(s.code(), StatusCode::kNotFound) << s.ToString();
  EXPECT_NE(s.message().find((dir_ / "no_such_dir" / "f.tmp").string()), std::string::npos)
      << s.ToString();
  EXPECT_FALSE(fs::exists(dir_ / "no_such_dir"));
}

// The rename fails (a directory holds the name): the old contents stay and the temporary goes.
TEST_P(AtomicFile, AFailedRenameLeavesThePathAsItWasAndNoTemporary) {
  const fs::path file = dir_ / "taken";
  fs::create_directories(file / "inside");
  const Status s = WriteFileAtomically(file.string(), "new", GetParam());
  EXPECT_EQ(s.code(), StatusCode::kInternal) << s.ToString();
  EXPECT_NE(s.message().find("cannot rename"), std::string::npos) << s.ToString();
  EXPECT_TRUE(fs::is_directory(file / "inside"));
  EXPECT_FALSE(fs::exists(dir_ / "taken.tmp"));
}

INSTANTIATE_TEST_SUITE_P(Durabilities, AtomicFile,
                         ::testing::Values(Durability::kRename, Durability::kFsync));

}  // namespace
}  // namespace grpo::common
