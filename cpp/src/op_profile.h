#pragma once
// DFLASH_PROFILE=1: the draft graph's time per ggml op. The scheduler's eval callback makes it
// compute node by node; each node's time is summed per op (and per weight shape for matmuls). The
// callbacks add overhead, so compare shares, not totals. The table prints when the drafter goes.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "ggml.h"

namespace dflash {

class OpProfile {
public:
    void start() { t0_ = std::chrono::steady_clock::now(); }

    // a ggml_backend_sched_eval_callback; user data = this
    static bool callback(ggml_tensor * t, bool ask, void * user_data) {
        if (ask) return true;  // observe every node
        auto * p = static_cast<OpProfile *>(user_data);
        std::string key = ggml_op_desc(t);
        if (t->op == GGML_OP_MUL_MAT) {
            key += std::string(" ") + ggml_type_name(t->src[0]->type) + " " + std::to_string(t->src[0]->ne[0]) + "x" +
                   std::to_string(t->src[0]->ne[1]) + "x" + std::to_string(t->src[1]->ne[1]);
        }
        Entry & e = p->ops_[key];
        e.ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - p->t0_).count();
        e.n++;
        p->start();
        return true;
    }

    ~OpProfile() {
        if (ops_.empty()) return;
        std::vector<std::pair<std::string, Entry>> v(ops_.begin(), ops_.end());
        std::sort(v.begin(), v.end(), [](const auto & a, const auto & b) { return a.second.ms > b.second.ms; });
        double total = 0;
        for (const auto & e : v) total += e.second.ms;
        std::fprintf(stderr, "dflash draft graph profile (DFLASH_PROFILE): %.3f ms in nodes\n", total);
        for (const auto & e : v) {
            std::fprintf(stderr, "  %-44s %10.3f ms %5.1f%%  x%llu\n", e.first.c_str(), e.second.ms,
                         100.0 * e.second.ms / total, (unsigned long long)e.second.n);
        }
    }

private:
    struct Entry {
        double ms = 0;
        uint64_t n = 0;
    };
    std::map<std::string, Entry> ops_;
    std::chrono::steady_clock::time_point t0_;
};

}  // namespace dflash
