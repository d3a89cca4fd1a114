#pragma once
// Opens a GGUF's metadata with ggml's parser. The parser reports why it
// rejects a file only through ggml's logger, so the logger is swapped for the
// duration of the parse and its words go into our exception instead of stderr.
#include <memory>
#include <string>

#include "ggml-cpp.h"
#include "gguf.h"

namespace dflash {

struct GgufFree {
    void operator()(gguf_context * c) const { gguf_free(c); }
};
using gguf_ptr = std::unique_ptr<gguf_context, GgufFree>;

// Throws dflash::Error "<path>: <what> (<parser's reason>)" when the parse fails.
gguf_ptr open_gguf(const std::string & path, ggml_context_ptr & meta, const std::string & what);

}  // namespace dflash
