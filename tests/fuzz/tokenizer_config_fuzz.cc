// libFuzzer target: tokenizer_config.json (common/tokenizer/tokenizer.h LoadTokenizer), read from
// every model directory beside its tokenizer.json, which here is the fixed byte-level tokenizer
// of the tokenizer_json corpus. Any input must give a tokenizer or a Status, never a crash or
// undefined behaviour; an accepted tokenizer's eos and pad ids must be tokens of it, and it must
// encode and decode a fixed text.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>

#include "common/tokenizer/tokenizer.h"

namespace {

namespace fs = std::filesystem;

// A model directory of its own, holding the fixed tokenizer.json; removed at exit.
const fs::path& ModelDir() {
  static const fs::path dir = [] {
    fs::path d = fs::temp_directory_path() / ("grpo-fuzz-tokcfg-" + std::to_string(::getpid()));
    fs::create_directories(d);
    const fs::path source =
        fs::path(__FILE__).parent_path() / "corpus" / "tokenizer_json" / "tiny_bytelevel.json";
    fs::copy_file(source, d / "tokenizer.json", fs::copy_options::overwrite_existing);
    std::atexit([] { fs::remove_all(ModelDir()); });
    return d;
  }();
  return dir;
}

bool IsToken(const grpo::common::Tokenizer& t, std::optional<int32_t> id) {
  return !id || t.IdToToken(*id).has_value();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const fs::path& dir = ModelDir();
  {
    std::ofstream out(dir / "tokenizer_config.json", std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  auto tokenizer = grpo::common::LoadTokenizer(dir.string());
  if (!tokenizer.ok()) return 0;
  const grpo::common::Tokenizer& t = **tokenizer;
  if (!IsToken(t, t.eos_token_id()) || !IsToken(t, t.pad_token_id())) std::abort();
  auto ids = t.Encode("hi <|im_end|>\n");
  if (!ids.ok()) std::abort();
  if (!t.Decode(*ids, /*skip_special_tokens=*/true).ok()) std::abort();
  return 0;
}
