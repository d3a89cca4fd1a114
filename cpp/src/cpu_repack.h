#pragma once
// ggml's extra CPU weight buffer types: the repacked layouts of its faster matmul kernels, and which
// weights each one takes. Used for the drafter's weights and, where libllama's own choice would reach
// AMX, for the target's (libllama 0.3.36's AMX kernels can crash: ggml-org/llama.cpp#20824).
#include <string>
#include <utility>
#include <vector>

#include "ggml-backend.h"

namespace dflash {

// The CPU device's extra buffer types in libllama's order of preference, without AMX: besides the crashes,
// its F16 kernel drafts no faster than the plain one (0.545 vs 0.550 ms, tinycode k = 3).
std::vector<ggml_backend_buffer_type_t> repacking_bufts(ggml_backend_dev_t cpu);

// Whether the CPU runs a matmul from w held in a buffer of `buft` (ggml_mul_mat for a matrix,
// ggml_mul_mat_id for a stack of experts): the extra buffer types answer for the layouts they take.
bool mul_mat_runs_from(ggml_backend_buffer_type_t buft, const ggml_tensor * w);

// ggml's repacked kernels multiply 4 rows of x at a time and the others one by one, each of those a pass
// over all of w: n rows cost n / 4 four-row passes and n % 4 one-row passes. Whether padding x to a
// multiple of 4 rows pays depends on the CPU (a q4_0 151,936 x 2048 head on 2 cores: on an EPYC Zen 2
// three rows 27.8 ms and four 23.9; on a Xeon with AMX one row 12.6 ms and four 14.5), so it is timed on
// `backend` on the weights of ws together (a head; a layer's matmuls): the fewest left-over rows from which
// padding pays, or 4 where it never does. Costs 4 one-row and 4 four-row passes over ws.
uint32_t timed_pad_rows_from(ggml_backend_t backend, const std::vector<ggml_tensor *> & ws);

// For a target file: regexes for libllama's tensor overrides putting each layer weight (blk.N.*) and the
// output head into the first of `bufts` that runs a matmul from it, the rest where libllama puts them. One
// pattern per weight kind (^blk\.(0|2|...)\.ffn_down\.weight$): libllama compiles each pattern for each
// tensor it loads. token_embd stays out: libllama reads its rows (get_rows), which a repacked layout breaks.
std::vector<std::pair<std::string, ggml_backend_buffer_type_t>> repacked_placement(
    const std::string & path, const std::vector<ggml_backend_buffer_type_t> & bufts);

}  // namespace dflash
