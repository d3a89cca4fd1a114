#include "cpu_repack.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <regex>

#include "ggml-cpp.h"
#include "gguf_open.h"

namespace dflash {

std::vector<ggml_backend_buffer_type_t> repacking_bufts(ggml_backend_dev_t cpu) {
    using ExtraBufts = ggml_backend_buffer_type_t * (*)(ggml_backend_dev_t);
    auto get = (ExtraBufts)ggml_backend_reg_get_proc_address(ggml_backend_dev_backend_reg(cpu),
                                                             "ggml_backend_dev_get_extra_bufts");
    std::vector<ggml_backend_buffer_type_t> out;
    for (ggml_backend_buffer_type_t * b = get ? get(cpu) : nullptr; b && *b; ++b) {
        if (std::string(ggml_backend_buft_name(*b)) != "AMX") out.push_back(*b);
    }
    return out;
}

bool mul_mat_runs_from(ggml_backend_buffer_type_t buft, const ggml_tensor * w) {
    ggml_init_params ip = {8 * ggml_tensor_overhead(), nullptr, true};
    ggml_context_ptr ctx(ggml_init(ip));
    ggml_tensor * wt = ggml_new_tensor(ctx.get(), w->type, GGML_MAX_DIMS, w->ne);
    ggml_tensor * y = nullptr;
    if (ggml_n_dims(w) == 3) {  // experts [n_embd, n_ff, n_expert]: 4 tokens routed to one each
        ggml_tensor * x = ggml_new_tensor_3d(ctx.get(), GGML_TYPE_F32, w->ne[0], 1, 4);
        ggml_tensor * ids = ggml_new_tensor_2d(ctx.get(), GGML_TYPE_I32, 1, 4);
        y = ggml_mul_mat_id(ctx.get(), wt, x, ids);
    } else {
        y = ggml_mul_mat(ctx.get(), wt, ggml_new_tensor_2d(ctx.get(), GGML_TYPE_F32, w->ne[0], 4));
    }
    ggml_backend_buffer_ptr probe(ggml_backend_buft_alloc_buffer(buft, 0));
    if (!probe) return false;
    wt->buffer = probe.get();
    return ggml_backend_dev_supports_op(ggml_backend_buft_get_device(buft), y);
}

uint32_t timed_pad_rows_from(ggml_backend_t backend, const std::vector<ggml_tensor *> & ws) {
    if (ws.empty()) return 4;
    ggml_init_params ip = {4 * ws.size() * ggml_tensor_overhead() + 2 * ggml_graph_overhead(), nullptr, true};
    ggml_context_ptr ctx(ggml_init(ip));
    ggml_cgraph * g[2] = {ggml_new_graph(ctx.get()), ggml_new_graph(ctx.get())};
    std::vector<ggml_tensor *> xs;
    for (ggml_tensor * w : ws) {
        ggml_tensor * x = ggml_new_tensor_2d(ctx.get(), GGML_TYPE_F32, w->ne[0], 4);
        ggml_build_forward_expand(g[0],
                                  ggml_mul_mat(ctx.get(), w, ggml_view_2d(ctx.get(), x, w->ne[0], 1, x->nb[1], 0)));
        ggml_build_forward_expand(g[1], ggml_mul_mat(ctx.get(), w, x));
        xs.push_back(x);
    }
    ggml_backend_buffer_ptr buf(ggml_backend_alloc_ctx_tensors(ctx.get(), backend));
    if (!buf) return 4;
    for (ggml_tensor * x : xs) {
        const std::vector<float> x_values(4 * x->ne[0], 0.01f);
        ggml_backend_tensor_set(x, x_values.data(), 0, ggml_nbytes(x));
    }
    double best[2] = {1e30, 1e30};  // the fastest of 3 (after one untimed), alternating
    for (int rep = 0; rep < 4; ++rep) {
        for (int i = 0; i < 2; ++i) {
            const auto t0 = std::chrono::steady_clock::now();
            ggml_backend_graph_compute(backend, g[i]);
            const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            if (rep > 0) best[i] = std::min(best[i], t);
        }
    }
    // a margin of 10%, so that noise does not pad where the two are about even
    for (uint32_t r = 1; r < 4; ++r) {
        if (r * best[0] > 1.1 * best[1]) return r;
    }
    return 4;
}

std::vector<std::pair<std::string, ggml_backend_buffer_type_t>> repacked_placement(
    const std::string & path, const std::vector<ggml_backend_buffer_type_t> & bufts) {
    ggml_context_ptr meta;
    gguf_ptr g = open_gguf(path, meta, "cannot read the target's tensors");
    // 3D layer weights are multiplied as experts only where named so (an MLA's per-head k_b is a batched
    // matmul, which no repacked layout runs)
    static const std::regex layer_weight(R"(blk\.(\d+)\.(.+))");
    std::map<std::pair<ggml_backend_buffer_type_t, std::string>, std::string> layers_by_kind;
    std::vector<std::pair<std::string, ggml_backend_buffer_type_t>> out;
    for (int64_t i = 0; i < gguf_get_n_tensors(g.get()); ++i) {
        const std::string name = gguf_get_tensor_name(g.get(), i);
        const ggml_tensor * t = ggml_get_tensor(meta.get(), name.c_str());
        std::smatch m;
        const bool is_layer = std::regex_match(name, m, layer_weight);
        if (!is_layer && name != "output.weight") continue;
        if (ggml_n_dims(t) == 3 && name.find("_exps.") == std::string::npos) continue;
        if (ggml_n_dims(t) > 3) continue;
        for (ggml_backend_buffer_type_t buft : bufts) {
            if (!mul_mat_runs_from(buft, t)) continue;
            if (!is_layer) {
                out.emplace_back(R"(^output\.weight$)", buft);
            } else {
                std::string & layers = layers_by_kind[{buft, m[2].str()}];
                layers += (layers.empty() ? "" : "|") + m[1].str();
            }
            break;
        }
    }
    for (const auto & [key, layers] : layers_by_kind) {
        const std::string kind = std::regex_replace(key.second, std::regex(R"([\\^$.|?*+()\[\]{}])"), R"(\$&)");
        out.emplace_back(R"(^blk\.()" + layers + R"()\.)" + kind + "$", key.first);
    }
    return out;
}

}  // namespace dflash
