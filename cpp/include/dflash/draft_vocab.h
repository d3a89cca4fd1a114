#pragma once
// A drafting vocabulary (FR-Spec's idea): the drafter's LM head and the selector's codebooks cut to the
// rows of a subset of the target's tokens, most frequent first. At a real vocabulary the head is about
// half of a CPU draft step; drafts then propose only tokens of the subset, while the target still
// verifies over its whole vocabulary, so the output is unchanged and only acceptance can drop.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ggml-backend.h"
#include "ggml-cpp.h"

namespace dflash {

// Where the full tensor's rows lie: a GGUF file, its data at `offset`, row i at offset + i * nb1.
struct RowSource {
    std::string path;
    size_t offset = 0;
    const ggml_tensor * tensor = nullptr;  // type and shape (ne0, n_rows)
};

struct DraftVocab {
    std::vector<int32_t> ids;  // row of the subset -> token id
    ggml_context_ptr ctx;
    std::vector<ggml_backend_buffer_ptr> buffers;
    ggml_tensor * output = nullptr;    // the LM head's rows           ne {n_embd, K}
    ggml_tensor * sel_prev = nullptr;  // selector_predecessor's rows  ne {R, K} (DFlash2)
    ggml_tensor * sel_next = nullptr;  // selector_successor's rows    ne {R, K} (DFlash2)
};

// Checks ids (distinct, inside the vocabulary of n_vocab, at least min_size of them) and copies those rows
// of each source. The head goes to the first of matmul_bufts that runs a matmul from it (ggml's repacked
// CPU layouts), else to buft, as the full head would; the codebooks to buft.
std::shared_ptr<const DraftVocab> make_draft_vocab(const std::vector<int32_t> & ids, uint32_t n_vocab,
                                                   uint32_t min_size, const RowSource & head,
                                                   const RowSource * sel_prev, const RowSource * sel_next,
                                                   ggml_backend_buffer_type_t buft,
                                                   const std::vector<ggml_backend_buffer_type_t> & matmul_bufts);

}  // namespace dflash
