#pragma once
// The target's token embedding and LM head, which a DFlash drafter shares
// with its target. Read from the target GGUF: on a device that can wrap host
// memory (CPU) the file is mapped and wrapped zero-copy, so no second copy
// lives in RAM; elsewhere the two tensors are uploaded once.
#include <cstdint>
#include <memory>
#include <string>

#include "ggml-backend.h"
#include "ggml-cpp.h"

namespace dflash {

struct MappedFile;

struct TargetHead {
    std::string path;
    uint32_t n_embd = 0;  // target hidden size
    uint32_t n_vocab = 0;
    uint32_t n_layer = 0;  // target block_count, for validating target_layers
    std::string arch;
    ggml_context_ptr ctx;
    ggml_backend_buffer_ptr buffer;
    std::shared_ptr<MappedFile> mapping;  // keeps the zero-copy mapping alive
    ggml_tensor * tok_embd = nullptr;     // token_embd.weight  ne {n_embd, n_vocab}
    ggml_tensor * output = nullptr;       // output.weight (or token_embd when tied)
    bool zero_copy = false;
    size_t output_offset = 0;  // output's data in the file (for reading rows of it)

    ~TargetHead();
};

// Opens `path` (a target model GGUF of any llama.cpp architecture) and makes
// its token_embd/output tensors available on `dev`.
std::unique_ptr<TargetHead> load_target_head(const std::string & path, ggml_backend_dev_t dev);

}  // namespace dflash
