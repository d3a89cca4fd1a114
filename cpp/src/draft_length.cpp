#include "dflash/draft_length.h"

#include <algorithm>
#include <cmath>

namespace dflash {

namespace {
constexpr double kDecay = 0.99;  // acceptance memory: about the last 100 drafted steps
// the prior: half a draft per position, accepted at 1/2, so one drafted step moves it far
constexpr double kPriorDrafts = 0.5;
constexpr double kPriorAccept = 0.5;
// auto mode's optimism: a_j + kOptimism * sqrt(1/4 / drafts seen at j), the bound of a coin of
// unknown bias, so an estimate from a handful of drafts is not trusted to rule drafting out
constexpr double kOptimism = 0.5;
// per plain step the acceptance evidence fades by kIdleDecay, down to kMinEvidence drafts per position
// (the bound then sits kOptimism * sqrt(1/16) = 0.125 above the estimate: an untrained drafter still
// cannot pay, one whose recent drafts merely dipped gets another drafting run)
constexpr double kIdleDecay = 0.98;
constexpr double kMinEvidence = 4.0;
// auto mode carries the acceptance of positions 1..kCarriedPositions over to a new sequence as it is; deeper
// positions' only at the weight of kMinEvidence drafts, so the new prompt's own drafts soon outweigh it.
// How far drafts run is the prompt's: across the bundled pair's 20 bench prompts the conditional acceptance
// of drafting 7 spreads with depth (standard deviation 0.10, 0.14, 0.16 at positions 1-3; 0.22, 0.27, 0.34
// at 5-7); at full weight a predictable prompt's deep acceptance keeps auto mode drafting 4 and more through
// the next prompts where 3 pays best (a 1.7B-shaped F16 target on 2 Zen 5 cores, 20 x 128 tokens replayed in
// tests/test_draft_length.py: 0.96 of the best fixed length at full weight, 0.99 weakened). Weakening
// positions 1-3 too lets a new reply's first few drafts end runs that pay (the bundled pair's bench profile:
// 0.97 against 0.99).
constexpr uint32_t kCarriedPositions = 3;
// plain steps between drafted probes: doubles after each probe (so a pair that never pays costs a
// probe per kProbeMax tokens), halves with every step that drafts on its merits; auto mode scales it by
// what a probe step costs in plain steps
constexpr uint32_t kProbeFirst = 16;
constexpr uint32_t kProbeMax = 256;
// a probe drafts this many steps in a row: two steps tell twice as much about acceptance for one
// switch of the target's batch shape
constexpr uint32_t kProbeSteps = 2;
// a drafting run tries one position further for this many steps in a row: a step after a change of
// length is not timed (libllama rebuilt its graph), so a single step would never measure its cost
constexpr uint32_t kExploreSteps = 2;
// A length's cost is timed only while it is drafted, so one timed in a slow phase would keep auto mode
// drafting one token fewer for good (a 2.8B-hybrid Q8_0 target on 2 Xeon cores: its steps of 3 drafted
// tokens took 450-570 ms through one prompt, 360-390 in the prompts around it, and auto mode drafted 2
// from then on at ~5% less speed; `scripts/trace_auto.py --steps`). So a drafting run re-times the length
// one position further once it was last timed kRetimeFirst drafted steps ago and would pay at the lowest
// cost it was ever estimated at (where it never would, a re-timing cannot change the choice), the interval
// doubling up to kRetimeMax after each re-timing that did not find it cheaper (by kPlainCheckAgree). A
// re-timing drafts that length kRetimeSteps steps: one untimed (the shape changed), then enough timings to
// move the lower quartile of its window of 9.
// The length one position shorter is re-timed likewise when it is estimated to cost over kShorterCostlier
// more than the current one (one draft row and one verified row fewer: suspect) and would pay on the line
// from a plain step's cost to the current length's: with a 4B-shaped Q4_K_M target, 3 drafted tokens
// were timed at 573 ms in a slow moment, where the loop's steps of 3 take 360-440, and auto mode drafted
// 4 (500-600 ms) from then on, never timing 3 again. A length the loop never timed (its cost
// the calibration's single timing of a large model, or a guess) is first re-timed after kRetimeUntimed
// drafted steps, as a 32-token reply is about 11 of them.
constexpr uint32_t kRetimeFirst = 32;
constexpr uint32_t kRetimeMax = 256;
constexpr uint32_t kRetimeSteps = 4;
constexpr uint32_t kRetimeUntimed = 8;
constexpr double kShorterCostlier = 0.05;
// a drafting run re-times plain decoding after this many drafted steps without a plain step (doubling
// up to kPlainCheckMax): a plain cost measured in a bad moment (the calibration next to a starting
// process) would otherwise keep a drafter drafting through a whole round slower than plain; a check is
// kPlainCheckTimed timed plain steps after the untimed warm ones (plain_warm_steps), and its timings
// replace the earlier ones. Where drafting pays 2x, a check per 256 drafted steps costs about 1% of the speed.
// The interval doubles only after a check that agreed with the estimate before it (within
// kPlainCheckAgree): a plain step is memory-bound and a shared VM's bandwidth comes in phases (a
// 1.7B-shaped F16 target's plain steps 73-76 ms in one, 105-115 ms in the next, its verify the same in
// both), so a check that lands in a slow phase would otherwise keep the slow cost for 64, then 128
// drafted steps, drafting longer than pays all along (`scripts/trace_auto.py --steps` shows it)
constexpr uint32_t kPlainCheckFirst = 32;
constexpr uint32_t kPlainCheckMax = 256;
constexpr uint32_t kPlainCheckTimed = 3;
constexpr double kPlainCheckAgree = 0.10;
// plain steps are plentiful: their cost is taken from more timings than a draft length's, so that a slow
// phase of a few steps does not move it (4.58, 3.60, 1.89, 1.34 ms among 0.43-0.64 ms steps make the
// median of 9 say 1.33 ms, which would have auto mode draft slower than plain until the next re-timing)
constexpr uint32_t kPlainWindow = 25;
// plain steps right after drafted ones are slower, so they are not timed: the first rebuilds libllama's
// graph, and the next ones are still slower than a plain run's (`scripts/trace_auto.py --steps` shows
// every step's time), so timing them would make drafting look better than it is. The slowdown is about
// a fixed time, not a share of the step: the bundled target's first plain step after drafted ones takes
// 0.72-0.74 ms against 0.59-0.61 in a plain run, and the next few are still slower; a 0.6B-shaped target's
// 35.6 ms, then 34.7-34.9 as in a plain run; a 4B-shaped one's 293.6 ms, no slower than the rest. So the
// warm steps are those within kPlainWarmMs of plain decoding (at least the first, at most kPlainWarmSteps):
// 4 for sub-ms steps, 1 for a large model's, where each untimed step of a check costs what drafting would
// have gained (at 4B on 2 CPU cores a 7-step check took about 10% off the speed of a 32-token reply)
constexpr uint32_t kPlainWarmSteps = 4;
constexpr double kPlainWarmMs = 2.5;
// auto mode enters a drafting run for a bound this much faster than plain decoding, and leaves it only
// for plain decoding this much faster (see choose): each switch costs libllama a graph rebuild and the
// drafter a cold step, so a near-tie is not worth drafting
constexpr double kEnterMargin = 0.02;
constexpr double kLeaveMargin = 0.04;
// a drafting run drafts its entry length this many steps before the estimates may end it (longer
// minimum runs cost speed at T = 1, where acceptance is lower)
constexpr uint32_t kMinRun = 2;
// after a drafting run the estimates never favoured, plain steps before the bound may begin another:
// doubling per such run up to the max, none after a run they favoured
constexpr uint32_t kEntryWaitFirst = 4;
constexpr uint32_t kEntryWaitMax = 32;
// A drafting run ends when its steps have lost kRunLossMax plain steps' time against plain decoding: each
// drafted step adds its estimated cost less (tokens + kRunLossAllowance) plain steps, the sum floored at 0.
// The acceptance memory (~100 drafted steps) spans prompts: where only near-perfect acceptance pays (a
// 2-core AMD EPYC), a perfectly predictable prompt's acceptance would keep auto mode drafting 6 tokens
// through the next, hard prompt for 15-30 steps that accept 0-2 (tests/test_draft_length.py replays this
// on the bundled pair's acceptance traces). Leaving on the loss itself reacts within a few steps where
// content changes and, with the allowance, seldom where drafting pays on average and only chance made a
// few steps lose (the same tests hold the GPU and CPU profiles close to the best fixed length). The memory
// then restarts from the drafts since the loss began (the last step at which it stood at 0: where the
// content changed), with what it held before kept at the weight of kMinEvidence drafts per position. From
// the whole run's drafts it would restart mostly from the predictable prompt's where the run began there
// (a 1.7B-shaped Q4_K_M target on 2 Zen 5 cores, `scripts/trace_auto.py --steps`: the next prompt's drafts
// of 3 accepted 3, 2, 0, 0, then the bound began runs of 6 and 7 tokens twice, 0.60x plain on that
// prompt); from those few drafts alone, a position rejected once would stay at 0, never drafted to again.
constexpr double kRunLossMax = 4.0;
constexpr double kRunLossAllowance = 1.5;
// fixed mode decides on acceptance alone (deterministic, so a seeded sampled run
// repeats token for token): draft while it yields this many extra tokens per step
constexpr double kFixedMinGain = 0.35;

// positions 1..accepted + 1 (at most k) were reached, 1..accepted accepted
void count_draft(std::vector<double> & reached, std::vector<double> & accepted, uint32_t k, uint32_t n_accepted) {
    for (uint32_t i = 0; i < k && i <= n_accepted; ++i) {
        reached[i] += 1.0;
        if (i < n_accepted) accepted[i] += 1.0;
    }
}
}  // namespace

void DraftLengthController::Cost::observe(double x) {
    // every timing counts, the first too: the loop times a step only when the step before built its shape's
    // graphs, and a length the calibration did not reach is first drafted in a run of two steps (a drafting
    // run's entry, a try one position further), so its first timing is the only one such a run gives; where
    // a CPU's verify grows faster than linearly (a 1.7B-shaped Q4_K_M target: the calibration reaches k = 2,
    // and 7 costs ~25% more than the line through 1 and 2 says) that timing is what corrects the guess
    recent[next] = x;
    next = (next + 1) % window;
    kept = std::min(kept + 1, window);
    if (kept < kMinSamples && !seeded)
        return;  // one unlucky step timed in a warm-up must not keep a draft length out for good
    double sorted[kMaxWindow];
    for (uint32_t i = 0; i < kept; ++i) sorted[i] = recent[(next + window - 1 - i) % window];
    // the lower quartile: a shared machine's noise is skewed up (preempted steps, and slow phases of several
    // steps in a row, which must not outvote the steps around them), and all costs are judged alike
    const uint32_t q = (kept - 1) / 4;
    std::nth_element(sorted, sorted + q, sorted + kept);
    ms = sorted[q];
    lowest = lowest < 0.0 ? ms : std::min(lowest, ms);
}

double DraftLengthController::Cost::fastest_kept() const {
    if (kept == 0) return -1.0;
    double best = recent[(next + window - 1) % window];
    for (uint32_t i = 1; i < kept; ++i) best = std::min(best, recent[(next + window - 1 - i) % window]);
    return best;
}

void DraftLengthController::Cost::seed(double x) {
    seeded = true;
    observe(x);
}

DraftLengthController::DraftLengthController(uint32_t cap) :
    cap_(cap),
    n_max_(cap),
    reached_(cap, kPriorDrafts),
    accepted_(cap, kPriorDrafts * kPriorAccept),
    accept_(cap, kPriorAccept),
    t_draft_(cap + 1),
    t_verify_(cap + 1),
    t_plain_(kPlainWindow),
    probe_every_(kProbeFirst),
    plain_check_(kPlainCheckFirst, kPlainCheckMax),
    timed_at_(cap + 1, 0),
    retime_(kRetimeFirst, kRetimeMax),
    loss_reached_(cap, 0.0),
    loss_accepted_(cap, 0.0) {}

void DraftLengthController::reset_acceptance() {
    // auto mode is timing-driven (never repeatable), so what it learned of this drafter (acceptance, deep
    // positions' as a weak prior only, and how often probing is worth it) carries over to the next sequence;
    // fixed mode forgets so that a seeded run repeats whatever came before
    if (mode_ == Mode::Auto) {
        for (uint32_t i = kCarriedPositions; i < cap_; ++i) weaken_to_prior(i);
        return;
    }
    plain_run_ = 0;
    hold_left_ = 0;
    drafting_ = false;
    probe_every_ = kProbeFirst;
    std::fill(reached_.begin(), reached_.end(), kPriorDrafts);
    std::fill(accepted_.begin(), accepted_.end(), kPriorDrafts * kPriorAccept);
    std::fill(accept_.begin(), accept_.end(), kPriorAccept);
}

void DraftLengthController::configure(Mode mode, uint32_t n_max) {
    mode_ = mode;
    n_max_ = std::min(std::max(n_max, 1u), cap_);
}

double DraftLengthController::tokens_at(uint32_t k, uint32_t optimistic_from) const {
    double e = 1.0, run = 1.0;
    for (uint32_t i = 0; i < k; ++i) {
        const double bound = std::min(1.0, accept_[i] + kOptimism * std::sqrt(0.25 / reached_[i]));
        const double a = i >= optimistic_from ? bound : accept_[i];
        run *= a;
        e += run;
    }
    return e;
}

double DraftLengthController::expected_tokens(uint32_t k) const { return tokens_at(k, k); }

double DraftLengthController::expected_cost_ms(uint32_t k) const {
    if (k == 0) return std::max(t_plain_.ms, 0.0);
    // an unmeasured drafted length: between measured ones interpolated; above the longest measured,
    // extrapolated along the line from the shortest (a CPU verifies about linearly more slowly with k, a
    // GPU about flat; the ends of the measured range, not its last two lengths, whose difference is mostly
    // noise); with one measured, as that one; below the shortest, optimistically a plain step's verify
    // and no draft, so it gets tried
    auto estimate = [this, k](const std::vector<Cost> & t, double below_all) {
        if (t[k].ms >= 0.0) return t[k].ms;
        // timings of k itself, too few to believe, still overrule a guess that they exceed (a CPU's verify
        // jumps where libllama's kernels change, past what the line from the timed lengths says)
        const double seen = t[k].fastest_kept();
        int64_t lo = -1, first = -1, hi = -1;
        for (size_t j = 1; j <= cap_; ++j) {
            if (t[j].ms < 0.0) continue;
            if (first < 0) first = (int64_t)j;
            if (j < k) lo = (int64_t)j;
            if (j > k && hi < 0) hi = (int64_t)j;
        }
        double guess = below_all;
        if (lo >= 0) {
            const double at_lo = t[(size_t)lo].ms;
            if (hi >= 0) {
                guess = at_lo + (t[(size_t)hi].ms - at_lo) * double((int64_t)k - lo) / double(hi - lo);
            } else {
                const double slope =
                    first == lo ? 0.0 : std::max(0.0, (at_lo - t[(size_t)first].ms) / double(lo - first));
                guess = at_lo + slope * double((int64_t)k - lo);
            }
        }
        return std::max(guess, seen);
    };
    return estimate(t_draft_, 0.0) + estimate(t_verify_, std::max(t_plain_.ms, 0.0));
}

double DraftLengthController::lowest_cost_ms(uint32_t k) const {
    const double d = t_draft_[k].lowest, v = t_verify_[k].lowest;
    return d >= 0.0 && v >= 0.0 ? d + v : -1.0;
}

uint32_t DraftLengthController::stale_neighbour(uint32_t best, double best_rate) const {
    if (best < cap_ && drafted_steps_ - timed_at_[best + 1] >= retime_.every) {
        const double lowest = lowest_cost_ms(best + 1);
        if (lowest > 0.0 && tokens_at(best + 1, best) / lowest > best_rate) return best + 1;
    }
    if (best > 1 && expected_cost_ms(best - 1) > expected_cost_ms(best) * (1.0 + kShorterCostlier) &&
        (timed_at_[best - 1] == 0 ? drafted_steps_ >= kRetimeUntimed
                                  : drafted_steps_ - timed_at_[best - 1] >= retime_.every)) {
        const double plain = expected_cost_ms(0);
        const double line = plain + (expected_cost_ms(best) - plain) * double(best - 1) / double(best);
        if (line > 0.0 && tokens_at(best - 1, best - 1) / line > best_rate) return best - 1;
    }
    return 0;
}

void DraftLengthController::weaken_to_prior(uint32_t i) {
    const double keep = std::min(1.0, kMinEvidence / reached_[i]);
    reached_[i] *= keep;
    accepted_[i] *= keep;
}

void DraftLengthController::clear_loss_counts() {
    std::fill(loss_reached_.begin(), loss_reached_.end(), 0.0);
    std::fill(loss_accepted_.begin(), loss_accepted_.end(), 0.0);
}

uint32_t DraftLengthController::hold(uint32_t k, uint32_t steps, bool probe) {
    hold_k_ = k;
    hold_left_ = steps - 1;
    probing_ = probe;
    return k;
}

uint32_t DraftLengthController::choose() {
    if (mode_ == Mode::FixedNoFallback) return n_max_;
    if (hold_left_ > 0) {
        --hold_left_;
        return hold_k_;  // probing_ stays as the hold began
    }
    if (retime_k_ != 0) {  // a re-timing's steps are over
        // only a cost found lower matters: the estimate was stale; one found higher is what drafting less said
        retime_.end(expected_cost_ms(retime_k_) < retime_.before_ms * (1.0 - kPlainCheckAgree));
        retime_k_ = 0;
    }
    probing_ = false;
    uint32_t best = 0;
    uint32_t probe_with = n_max_;  // auto mode: the length whose bound pays best
    uint32_t probe_wait = probe_every_;
    if (mode_ == Mode::Fixed) {
        best = expected_tokens(n_max_) - 1.0 >= kFixedMinGain ? n_max_ : 0;
    } else {
        // every k by its rate on the estimates (best) and at the upper confidence bound (probe_with)
        double plain_rate = 0.0, best_rate = -1.0, bound_rate = -1.0;
        for (uint32_t k = 0; k <= cap_; ++k) {
            const double cost = expected_cost_ms(k);
            auto rate = [cost](double tokens) { return cost > 0.0 ? tokens / cost : 1e30 * tokens; };
            const double r = rate(tokens_at(k, k)), rb = rate(tokens_at(k, 0));
            if (k == 0) {
                plain_rate = r;
                continue;
            }
            if (r > best_rate) {
                best_rate = r;
                best = k;
            }
            if (rb > bound_rate) {
                bound_rate = rb;
                probe_with = k;
            }
        }
        // A drafting run is entered when the bound pays (it shrinks as drafts are observed and widens
        // again while plain steps draw none, see observe_plain, so a dip is not remembered for good) and
        // drafts that length for kMinRun steps, so the positions that made the bound pay are observed;
        // then it drafts what the estimates favour, and is left on the estimates, for a clear margin (the
        // way back costs two graph rebuilds in libllama and a cold drafter). A run left after one step
        // would alternate plain and drafted steps for as long as plain decoding lies between bound and
        // estimate (each switch a graph rebuild); leaving on the bound would keep drafting where plain is ahead.
        if (drafting_ && ++drafted_untimed_ >= plain_check_.every) {
            plain_check_.begin(t_plain_.ms);  // observe_plain ends it once the check is timed
            t_plain_.restart();               // joining a slow phase's timings, a check would be outvoted by them
            // still a drafting run: judged again after the check
            return hold(0, plain_warm_steps() + kPlainCheckTimed, false);
        }
        // a run whose steps lost kRunLossMax plain steps' time: the content changed under it
        const bool lost = drafting_ && run_loss_ > kRunLossMax * expected_cost_ms(0);
        if (!drafting_) {
            // plain_streak_: plain steps since the run (or a probe since) ended
            const bool enter = bound_rate > plain_rate * (1.0 + kEnterMargin) && plain_streak_ >= entry_wait_;
            best = enter ? hold(probe_with, kMinRun, false) : 0;
            if (enter) {
                run_favoured_ = false;
                run_loss_ = 0.0;
                clear_loss_counts();
            }
        } else if (lost || plain_rate > best_rate * (1.0 + kLeaveMargin)) {
            best = 0;
            if (lost) {  // the memory restarts from the losing drafts, the earlier memory a weak prior to them
                for (uint32_t i = 0; i < cap_; ++i) {
                    weaken_to_prior(i);
                    reached_[i] += loss_reached_[i];
                    accepted_[i] += loss_accepted_[i];
                    accept_[i] = accepted_[i] / reached_[i];
                }
            }
            // a run begun on the bound alone, and never favoured by the estimates, leaves the bound about where
            // it was: where only near-perfect acceptance pays (the bundled pair's f16 drafter on a 2-core AMD
            // EPYC), such runs would begin again one plain step after ending (2 drafted steps in 3, well below
            // plain speed); each one doubles the wait, as does a run that lost
            entry_wait_ = run_favoured_ && !lost ? 0 : std::clamp(2 * entry_wait_, kEntryWaitFirst, kEntryWaitMax);
        } else {
            // the estimates, not only the bound, favoured drafting (a run that merely ended early by chance)
            run_favoured_ = run_favoured_ || best_rate >= plain_rate;
            // one position further, as it might be: the estimate of a position no longer reached is stale (a
            // run of 2 drafts after a hard prompt could otherwise keep 3 out for good where 3 pays best)
            const double cost = best < cap_ ? expected_cost_ms(best + 1) : 0.0;
            if (cost > 0.0 && tokens_at(best + 1, best) / cost > best_rate) {
                best = hold(best + 1, kExploreSteps, false);
            } else if (const uint32_t k = stale_neighbour(best, best_rate); k != 0) {
                retime_k_ = k;
                retime_.begin(expected_cost_ms(k));
                best = hold(k, kRetimeSteps, false);
            }
        }
        drafting_ = best != 0;
        // a probe costs the time of several plain steps (a 7-token probe ~7 on a 2-core CPU, ~3 on a GPU):
        // spacing probes by time, not by steps, keeps their share of the time bounded (probing every 16
        // steps with 7 tokens would cost a 2-core CPU a large share of its plain speed)
        const double c0 = expected_cost_ms(0), ck = expected_cost_ms(probe_with);
        if (c0 > 0.0 && ck > c0) probe_wait = (uint32_t)std::lround(probe_every_ * ck / c0);
    }
    if (best != 0) {
        // drafting on its merits: probe sooner again once it stops paying, but not at once after one
        // lucky probe (each probe that loses costs several plain steps)
        plain_run_ = 0;
        probe_every_ = std::max(kProbeFirst, probe_every_ / 2);
        return best;
    }
    // auto mode probes at once while it has seen no draft: at the acceptance prior (1/2 per position) no
    // bound pays where drafting gains less than ~30% at perfect acceptance, so waiting for one would decode
    // ~100 plain steps before the first probe (tests/test_draft_length.py: the demo's perfectly predictable
    // prompt at a 2-core AMD EPYC's costs, plain 0.33 ms, 8 drafted tokens verified in 2.1 ms)
    if (++plain_run_ >= probe_wait || (mode_ == Mode::Auto && !seen_draft_)) {
        plain_run_ = 0;
        probe_every_ = std::min(2 * probe_every_, kProbeMax);
        // probe (has the content become draftable?) with the draft length most likely to pay
        return hold(probe_with, kProbeSteps, true);
    }
    return 0;
}

void DraftLengthController::observe_draft(uint32_t k, uint32_t accepted, double draft_ms, double verify_ms,
                                          bool steady) {
    plain_streak_ = 0;
    seen_draft_ = true;
    ++drafted_steps_;
    for (uint32_t i = 0; i < cap_; ++i) {
        reached_[i] *= kDecay;
        accepted_[i] *= kDecay;
    }
    count_draft(reached_, accepted_, k, accepted);
    for (uint32_t i = 0; i < cap_; ++i) accept_[i] = accepted_[i] / reached_[i];
    if (mode_ == Mode::Auto && drafting_ && !probing_) {
        const double plain = expected_cost_ms(0);
        run_loss_ = std::max(0.0, run_loss_ + expected_cost_ms(k) - (accepted + 1 + kRunLossAllowance) * plain);
        if (run_loss_ == 0.0) {  // a loss, if one comes, begins after this step
            clear_loss_counts();
        } else {
            count_draft(loss_reached_, loss_accepted_, k, accepted);
        }
    }
    if (!steady || probing_) return;
    observe_cost(k, draft_ms, verify_ms);
    if (k <= cap_) timed_at_[k] = drafted_steps_;
}

void DraftLengthController::record_cost(uint32_t k, double draft_ms, double verify_ms, void (Cost::*add)(double)) {
    if (k == 0) {
        (t_plain_.*add)(verify_ms);
    } else if (k <= cap_) {
        (t_draft_[k].*add)(draft_ms);
        (t_verify_[k].*add)(verify_ms);
    }
}

void DraftLengthController::observe_cost(uint32_t k, double draft_ms, double verify_ms) {
    record_cost(k, draft_ms, verify_ms, &Cost::observe);
}

void DraftLengthController::calibrate_cost(uint32_t k, double draft_ms, double verify_ms) {
    record_cost(k, draft_ms, verify_ms, &Cost::seed);
}

uint32_t DraftLengthController::plain_warm_steps() const {
    if (t_plain_.ms <= 0.0) return kPlainWarmSteps;
    return std::clamp((uint32_t)std::ceil(kPlainWarmMs / t_plain_.ms), 1u, kPlainWarmSteps);
}

void DraftLengthController::observe_plain(double ms, bool steady) {
    // evidence fades while nothing is drafted (the estimate itself stays): plain decoding began where the
    // drafts went badly and adds nothing but probes, so a tight bound would keep it plain through content
    // that drafting wins (the bundled pair: estimates 0.65-0.71 per position after a dip, 0.77-0.94 drafted)
    for (uint32_t i = 0; i < cap_; ++i) {
        const double faded = std::max(kMinEvidence, reached_[i] * kIdleDecay);
        if (faded < reached_[i]) {
            accepted_[i] *= faded / reached_[i];
            reached_[i] = faded;
        }
    }
    if (++plain_streak_ > plain_warm_steps() && steady) {
        t_plain_.observe(ms);
        drafted_untimed_ = 0;
        if (plain_check_.before_ms != 0.0 && t_plain_.kept >= kPlainCheckTimed)
            plain_check_.end(std::abs(t_plain_.ms / plain_check_.before_ms - 1.0) > kPlainCheckAgree);
    }
}

}  // namespace dflash
