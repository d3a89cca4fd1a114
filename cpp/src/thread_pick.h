#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

namespace dflash {

// Picks the CPU thread count of a draft graph by timing its real steps: a small drafter's step is a few
// hundred tiny ops, and ggml's CPU backend synchronises its threads after every op, so one thread can
// beat several (the bundled drafter on 2 cores: 0.59 vs 0.71 ms at n = 3), while a large drafter wants
// them all. The first steps alternate between `many` and 1 thread; the faster median is kept for good
// once it is clear (kMin samples each and kClear apart) or after kMax samples each. A first step with
// `many` threads longer than kComputeMs keeps them at once: ggml's syncs cost microseconds per op, so
// such a step is compute that one thread would take about `many` times as long over (a 0.6B-shaped
// drafter: 17 ms per step with 2 threads), and timing one-thread steps would slow the first steps of
// every draft length.
class ThreadPick {
public:
    static constexpr uint32_t kMin = 3, kMax = 8;
    static constexpr double kClear = 1.25;
    static constexpr double kComputeMs = 4.0;

    explicit ThreadPick(int many) : many_(many), chosen_(many > 1 ? 0 : many) {}

    int next() const {
        if (chosen_ != 0) return chosen_;
        return ms_[0].size() <= ms_[1].size() ? many_ : 1;
    }
    void observe(int threads, double ms) {
        if (chosen_ != 0) return;
        if (threads != 1 && ms_[0].empty() && ms > kComputeMs) {
            chosen_ = many_;
            return;
        }
        ms_[threads == 1 ? 1 : 0].push_back(ms);
        const size_t n = std::min(ms_[0].size(), ms_[1].size());
        if (n < kMin) return;
        const double t_many = median(ms_[0]), t_one = median(ms_[1]);
        if (n >= kMax || std::max(t_many, t_one) > kClear * std::min(t_many, t_one))
            chosen_ = t_one < t_many ? 1 : many_;
    }
    int chosen() const { return chosen_; }  // 0 while still timing

private:
    static double median(std::vector<double> v) {
        std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
        return v[v.size() / 2];
    }
    int many_;
    int chosen_;
    std::vector<double> ms_[2];
};

}  // namespace dflash
