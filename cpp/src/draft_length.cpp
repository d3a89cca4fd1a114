#include "draft_length.h"

#include <algorithm>

namespace dflash {

namespace {
constexpr double kDecay = 0.98;       // acceptance memory: about the last 50 steps
constexpr double kAlpha = 0.05;       // timing EMA
constexpr double kPrior = 1.0;        // pseudo-counts: acceptance starts at 1/2
// plain steps between drafted probes: doubles after each probe that does not make drafting pay
// (so a pair that never pays costs a probe per kProbeMax tokens), back to the first when it does
constexpr uint32_t kProbeFirst = 16;
constexpr uint32_t kProbeMax = 256;
// fixed mode decides on acceptance alone (deterministic, so a seeded sampled run
// repeats token for token): draft while it yields this many extra tokens per step
constexpr double kFixedMinGain = 0.35;

double ema(double old, double x) { return old < 0.0 ? x : (1.0 - kAlpha) * old + kAlpha * x; }
}  // namespace

DraftLengthController::DraftLengthController(uint32_t cap)
    : cap_(cap), n_max_(cap), reached_(cap, 2 * kPrior), accepted_(cap, kPrior), accept_(cap, 0.5),
      t_verify_(cap + 1, -1.0) {}

void DraftLengthController::reset_acceptance() {
    // auto mode is timing-driven (never repeatable), so what it learned of this drafter (acceptance,
    // how often probing is worth it) carries over to the next sequence; fixed mode forgets so that a
    // seeded run repeats whatever came before
    if (mode_ == Mode::Auto) return;
    plain_run_ = 0;
    probe_every_ = kProbeFirst;
    std::fill(reached_.begin(), reached_.end(), 2 * kPrior);
    std::fill(accepted_.begin(), accepted_.end(), kPrior);
    std::fill(accept_.begin(), accept_.end(), 0.5);
}

void DraftLengthController::configure(Mode mode, uint32_t n_max) {
    mode_ = mode;
    n_max_ = std::min(std::max(n_max, 1u), cap_);
}

double DraftLengthController::expected_tokens(uint32_t k) const {
    double e = 1.0, run = 1.0;
    for (uint32_t i = 0; i < k; ++i) {
        run *= accept_[i];
        e += run;
    }
    return e;
}

double DraftLengthController::expected_cost_ms(uint32_t k) const {
    // unmeasured costs are taken optimistically (as the nearest cheaper measured one), so each k gets tried
    auto verify = [&](uint32_t kk) {
        for (int64_t j = kk; j >= 1; --j) {
            if (t_verify_[(size_t) j] >= 0.0) return t_verify_[(size_t) j];
        }
        return t_plain_ >= 0.0 ? t_plain_ : 0.0;
    };
    if (k == 0) return t_plain_ >= 0.0 ? t_plain_ : verify(1);
    return std::max(t_draft_, 0.0) + verify(k);
}

uint32_t DraftLengthController::choose() {
    if (mode_ == Mode::FixedNoFallback) return n_max_;
    uint32_t best = 0;
    if (mode_ == Mode::Fixed) {
        best = expected_tokens(n_max_) - 1.0 >= kFixedMinGain ? n_max_ : 0;
    } else {
        double best_rate = -1.0;
        for (uint32_t k = 0; k <= cap_; ++k) {
            const double cost = expected_cost_ms(k);
            const double rate = cost > 0.0 ? expected_tokens(k) / cost : 1e30 * expected_tokens(k);
            if (rate > best_rate) {
                best_rate = rate;
                best = k;
            }
        }
    }
    if (best != 0) {
        plain_run_ = 0;
        probe_every_ = kProbeFirst;
        return best;
    }
    if (++plain_run_ >= probe_every_) {
        plain_run_ = 0;
        probe_every_ = std::min(2 * probe_every_, kProbeMax);
        return mode_ == Mode::Fixed ? n_max_ : cap_;  // probe: has the content become draftable?
    }
    return 0;
}

void DraftLengthController::observe_draft(uint32_t k, uint32_t accepted, double draft_ms, double verify_ms) {
    for (uint32_t i = 0; i < cap_; ++i) {
        reached_[i] *= kDecay;
        accepted_[i] *= kDecay;
    }
    for (uint32_t i = 0; i < k && i <= accepted; ++i) {
        reached_[i] += 1.0;
        if (i < accepted) accepted_[i] += 1.0;
    }
    for (uint32_t i = 0; i < cap_; ++i) accept_[i] = accepted_[i] / reached_[i];
    t_draft_ = ema(t_draft_, draft_ms);
    t_verify_[k] = ema(t_verify_[k], verify_ms);
}

void DraftLengthController::observe_plain(double ms) { t_plain_ = ema(t_plain_, ms); }

}  // namespace dflash
