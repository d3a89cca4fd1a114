#pragma once
// Two uses of ggml's one global logger, each swapping it for a while. open_gguf: ggml's parser says why
// it rejects a file only through the logger, so its words go into our exception instead of stderr.
// QuietDebugLog: drops debug-level lines while our weights are uploaded.
#include <memory>
#include <string>

#include "ggml-cpp.h"
#include "gguf.h"

namespace dflash {

struct GgufFree {
    void operator()(gguf_context * c) const { gguf_free(c); }
};
using gguf_ptr = std::unique_ptr<gguf_context, GgufFree>;

// While alive, ggml's debug-level messages are dropped and the rest go where they went before: ggml's CPU
// backend logs every weight it repacks at debug level, and its default logger prints all levels to stderr.
class QuietDebugLog {
public:
    QuietDebugLog();
    ~QuietDebugLog();
    QuietDebugLog(const QuietDebugLog &) = delete;
    QuietDebugLog & operator=(const QuietDebugLog &) = delete;

private:
    static void forward(ggml_log_level level, const char * text, void * ud);
    ggml_log_callback prev_cb_ = nullptr;
    void * prev_ud_ = nullptr;
    bool dropping_ = false;
};

// Throws dflash::Error "<path>: <what> (<parser's reason>)" when the parse fails.
gguf_ptr open_gguf(const std::string & path, ggml_context_ptr & meta, const std::string & what);

}  // namespace dflash
