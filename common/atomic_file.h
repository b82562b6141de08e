// Writing a whole file so that a reader (or a restart) sees either the old file or the whole new
// one, never a part: the bytes go to `path.tmp`, which is renamed over `path`. The model's
// config, the tokenizer files, the checkpoint's metadata and the demo's address file use it.
#pragma once

#include <string>
#include <string_view>

#include "common/status.h"

namespace grpo::common {

enum class Durability {
  kRename,  // atomic for readers and across a crash of the process
  kFsync,   // also across a power loss: the file, then its directory, fsynced
};

// Writes `contents` to `path` through `path.tmp`. On error the temporary file is removed,
// `path` is untouched, and the Status names the file and the step that failed (NotFound when
// the directory does not exist, Internal otherwise).
Status WriteFileAtomically(const std::string& path, std::string_view contents,
                           Durability durability = Durability::kRename);

}  // namespace grpo::common
