#pragma once
// Chooses how many drafted tokens each step verifies, from what was measured
// in this process: the per-position conditional acceptance of the drafts and
// the cost of a plain decode, of a draft step and of verifying k tokens.
// Expected tokens per second of verifying k drafts:
//     E(k) / T(k),  E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j,
//     T(k) = t_draft + t_verify(k)  (T(0) = t_plain, no drafting)
// Auto mode compares every k in 0..cap by that rate (timings make it
// nondeterministic); fixed mode drafts n_max unless the expected gain per step
// falls below a floor, judged on acceptance alone so that seeded runs repeat.
// While it decodes plainly it still probes a drafted step now and then (less
// often while probes keep failing), so a change of content is noticed.
#include <cstdint>
#include <vector>

namespace dflash {

class DraftLengthController {
  public:
    explicit DraftLengthController(uint32_t cap);

    enum class Mode { Fixed, FixedNoFallback, Auto };
    void configure(Mode mode, uint32_t n_max);

    uint32_t choose();  // 0 = a plain step
    void reset_acceptance();  // a new sequence: fixed modes forget acceptance; costs are always kept
    void observe_draft(uint32_t k, uint32_t accepted, double draft_ms, double verify_ms);
    void observe_plain(double ms);

    double expected_tokens(uint32_t k) const;
    double expected_cost_ms(uint32_t k) const;
    const std::vector<double> & acceptance() const { return accept_; }

  private:
    uint32_t cap_;
    Mode mode_ = Mode::Fixed;
    uint32_t n_max_;
    std::vector<double> reached_, accepted_, accept_;  // decayed counts and their ratio, positions 1..cap
    std::vector<double> t_verify_;                      // [k] ms, < 0 = not measured yet
    double t_draft_ = -1.0, t_plain_ = -1.0;
    uint32_t plain_run_ = 0;
    uint32_t probe_every_ = 16;
};

}  // namespace dflash
