#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

namespace dflash {

// Picks the CPU thread count of a draft graph by timing its real steps: a small drafter's step is a few
// hundred tiny ops, and ggml's CPU backend synchronises its threads after every op, so one thread can
// beat several (the bundled drafter on 2 cores: 0.59 vs 0.71 ms at n = 3). The first steps alternate
// between `many` and 1 thread; after kSamples of each, the faster median is kept for good.
class ThreadPick {
  public:
    static constexpr uint32_t kSamples = 8;

    explicit ThreadPick(int many) : many_(many), chosen_(many > 1 ? 0 : many) {}

    int next() const {
        if (chosen_ != 0) return chosen_;
        return ms_[0].size() <= ms_[1].size() ? many_ : 1;
    }
    void observe(int threads, double ms) {
        if (chosen_ != 0) return;
        ms_[threads == 1 ? 1 : 0].push_back(ms);
        if (ms_[0].size() >= kSamples && ms_[1].size() >= kSamples) chosen_ = median(ms_[1]) < median(ms_[0]) ? 1 : many_;
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
