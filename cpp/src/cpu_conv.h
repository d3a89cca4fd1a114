#pragma once
// DFlash2's dynamic two-tap conv as one node of the CPU backend (a ggml custom op): the portable graph
// spreads each group's coefficient over its channels and multiplies and accumulates tap by tap, five
// small ops for a module's first conv and three for its second, whose ggml-cpu kernels are slow at
// these shapes (the broadcast add goes one element per call, acc copies its accumulator first); this
// op made the bundled drafter's drafts 11-15% faster. Same arithmetic in the same order.
#include "ggml.h"

namespace dflash {

// A ggml_custom3_op_t over the block rows t of y [E, B]:
//     dst[:, t] = sum over tap < min(K, t + 1) of (base[:, tap, side] + c[g(:), tap, side, t]) * y[:, t - tap]
// with c [2 K G, B] the conv projection's output read as (group, (tap, side)), base [E, K, 2], g(ch) =
// ch / (E / G) and side (0: before the attention / MLP, 1: after) pointed to by `side`. Threads split the
// groups.
void cpu_dynamic_conv(ggml_tensor * dst, const ggml_tensor * y, const ggml_tensor * c, const ggml_tensor * base,
                      int ith, int nth, void * side);

}  // namespace dflash
