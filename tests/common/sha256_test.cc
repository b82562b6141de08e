#include "common/sha256.h"

#include <gtest/gtest.h>

#include <fstream>

namespace grpo::common {
namespace {

// Vectors from FIPS 180-4 / NIST CSRC examples.
TEST(Sha256, MatchesPublishedVectors) {
  EXPECT_EQ(Sha256Hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(Sha256Hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(Sha256Hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(Sha256Hex(std::string(1000000, 'a')),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(Sha256, IncrementalUpdatesEqualOneShot) {
  const std::string text = "The quick brown fox jumps over the lazy dog, many times over.";
  Sha256 h;
  for (size_t i = 0; i < text.size(); i += 7)
    h.Update(text.data() + i, std::min<size_t>(7, text.size() - i));
  EXPECT_EQ(h.HexDigest(), Sha256Hex(text));
}

TEST(Sha256, FileDigestAndMissingFile) {
  const std::string path = ::testing::TempDir() + "/sha256_test.txt";
  std::ofstream(path) << "abc";
  auto d = Sha256File(path);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(*d, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(Sha256File(path + ".missing").status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace grpo::common
