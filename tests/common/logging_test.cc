// EscapeForLog (common/logging.h) against escapes written out by hand.
#include "common/logging.h"

#include <gtest/gtest.h>

#include <string>

namespace grpo::common {
namespace {

TEST(EscapeForLog, PrintableAsciiIsLeftAsItIs) {
  EXPECT_EQ(EscapeForLog("train-set v2 (1,000 rows): 'ok' ~ \"#$%&*+/<>?@[]^_`{|}\""),
            "train-set v2 (1,000 rows): 'ok' ~ \"#$%&*+/<>?@[]^_`{|}\"");
  EXPECT_EQ(EscapeForLog(""), "");
}

TEST(EscapeForLog, ANewlineCannotStartAForgedLine) {
  EXPECT_EQ(EscapeForLog("a\nFAKE line"), R"(a\nFAKE line)");
  EXPECT_EQ(EscapeForLog("x\r\n2026-01-01T00:00:00.000 I [grpo] y"),
            R"(x\r\n2026-01-01T00:00:00.000 I [grpo] y)");
  EXPECT_EQ(EscapeForLog("\t"), R"(\t)");
}

TEST(EscapeForLog, OtherControlBytesAreHexAndABackslashIsDoubled) {
  EXPECT_EQ(EscapeForLog("\x1b[31mred\x1b[0m"), R"(\x1b[31mred\x1b[0m)");
  EXPECT_EQ(EscapeForLog(std::string("a\0b", 3)), R"(a\x00b)");
  EXPECT_EQ(EscapeForLog("\x7f\x01\x1f"), R"(\x7f\x01\x1f)");
  // A literal backslash-n in the input reads differently from an escaped newline.
  EXPECT_EQ(EscapeForLog(R"(a\nb)"), R"(a\\nb)");
}

TEST(EscapeForLog, NonAsciiBytesAreHex) {
  EXPECT_EQ(EscapeForLog("caf\xc3\xa9"), R"(caf\xc3\xa9)");
  EXPECT_EQ(EscapeForLog("\xc2\x85"), R"(\xc2\x85)");          // U+0085, NEL
  EXPECT_EQ(EscapeForLog("\xe2\x80\xa8"), R"(\xe2\x80\xa8)");  // U+2028, LINE SEPARATOR
}

}  // namespace
}  // namespace grpo::common
