#include "cpu_conv.h"

#include <algorithm>
#include <cstdint>

namespace dflash {

void cpu_dynamic_conv(ggml_tensor * dst, const ggml_tensor * y, const ggml_tensor * c, const ggml_tensor * base,
                      int ith, int nth, void * side_ptr) {
    const int64_t side = *(const int *)side_ptr;
    const int64_t E = y->ne[0], B = y->ne[1], K = base->ne[1];
    const int64_t G = c->ne[0] / (2 * K), group = E / G;
    const int64_t g0 = G * ith / nth, g1 = G * (ith + 1) / nth;
    auto row = [](const ggml_tensor * t, int64_t i) { return (const float *)((const char *)t->data + i * t->nb[1]); };
    for (int64_t t = 0; t < B; ++t) {
        float * out = (float *)((char *)dst->data + t * dst->nb[1]);
        for (int64_t tap = 0; tap < std::min(K, t + 1); ++tap) {
            const int64_t ts = tap + K * side;  // the (tap, side) slot
            const float * yr = row(y, t - tap);
            const float * b = (const float *)base->data + E * ts;
            const float * cg = row(c, t) + G * ts;
            for (int64_t g = g0; g < g1; ++g) {
                const int64_t ch0 = g * group, ch1 = ch0 + group;
                // products, then sums, as the portable graph's mul and acc: the same floats
                if (tap == 0) {
                    for (int64_t ch = ch0; ch < ch1; ++ch) out[ch] = yr[ch] * (b[ch] + cg[g]);
                } else {
                    for (int64_t ch = ch0; ch < ch1; ++ch) out[ch] = out[ch] + yr[ch] * (b[ch] + cg[g]);
                }
            }
        }
    }
}

}  // namespace dflash
