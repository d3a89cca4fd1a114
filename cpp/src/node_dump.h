#pragma once
// DFLASH_DUMP_NODES=FILE: every computed f32 node of the draft graphs, appended to FILE as
// name, op, shape and values, for comparing one backend's graph against another's node by node
// (scripts/compare_devices.py). Read when the Drafter is made.
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "ggml-backend.h"
#include "ggml.h"

namespace dflash {

class NodeDump {
public:
    explicit NodeDump(const char * path) : f_(path ? std::fopen(path, "wb") : nullptr) {}
    ~NodeDump() {
        if (f_) std::fclose(f_);
    }
    bool on() const { return f_ != nullptr; }

    static bool callback(ggml_tensor * t, bool ask, void * user_data) {
        const bool data_op = t->op != GGML_OP_VIEW && t->op != GGML_OP_RESHAPE && t->op != GGML_OP_PERMUTE &&
                             t->op != GGML_OP_TRANSPOSE && t->op != GGML_OP_NONE;
        if (ask) return data_op && t->type == GGML_TYPE_F32 && ggml_is_contiguous(t);
        auto * d = static_cast<NodeDump *>(user_data);
        std::vector<float> v(ggml_nelements(t));
        ggml_backend_tensor_get(t, v.data(), 0, ggml_nbytes(t));
        const std::string name = std::string(t->name) + "|" + ggml_op_desc(t);
        const uint32_t n = (uint32_t)name.size();
        const int64_t ne[4] = {t->ne[0], t->ne[1], t->ne[2], t->ne[3]};
        std::fwrite(&n, 4, 1, d->f_);
        std::fwrite(name.data(), 1, n, d->f_);
        std::fwrite(ne, 8, 4, d->f_);
        std::fwrite(v.data(), 4, v.size(), d->f_);
        return true;
    }

private:
    std::FILE * f_;
};

}  // namespace dflash
