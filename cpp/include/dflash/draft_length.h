#pragma once
// Chooses how many drafted tokens each step verifies, from what was measured
// in this process: the per-position conditional acceptance of the drafts and
// the cost of a plain decode, of a draft step and of verifying k tokens.
// Expected tokens per second of verifying k drafts:
//     E(k) / T(k),  E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j,
//     T(k) = t_draft(k) + t_verify(k)  (T(0) = t_plain, no drafting)
// Auto mode compares every k in 0..cap by that rate (timings make it
// nondeterministic). A cost is the lower quartile of its recent measurements (a
// shared machine's timings are skewed up: preempted steps, slow phases) once it
// has a few (a plain step's of more of them, as plain steps are plentiful); the
// Speculator calibrates them before its first prefill (calibrate_cost); a drafted
// length still unmeasured costs what the measured lengths around it say
// (interpolated; above the longest, extrapolated from the shortest; below the
// shortest, taken optimistically as a plain step), so no length is ruled out
// untried and none looks as cheap as a short one; in the loop a length's
// timings, too few to believe, still overrule a lower guess. It
// enters a drafting run when some k pays with each a_j at an upper confidence
// bound that shrinks as drafts are observed and widens again while plain steps
// observe none (so that little or old evidence does not rule drafting out),
// drafts that k for two steps, then the k the estimates favour, and leaves on
// the estimates; both for a margin (a switch costs a graph rebuild and a cold
// drafter); after a run that the estimates never favoured it waits a few plain
// steps (more after each such run) before the bound may begin another. Within a
// run it tries k + 1 for two steps whenever position k + 1 at its bound would
// pay (an estimate no longer reached goes stale), and re-times k + 1 or k - 1
// when it was last timed long ago (a cost timed in a slow phase goes stale too). Fixed mode
// drafts n_max unless the expected gain per step falls below a floor, judged on
// acceptance alone so that seeded runs repeat. While either decodes plainly it
// still probes a drafted step now and then (less often while it keeps deciding
// against drafting; auto mode spaces probes by their cost), so a change of
// content is noticed (auto mode's first probe comes at once). A long drafting
// run re-times plain decoding now and then (a few plain steps, more rarely after
// each check that agreed with the estimate, whose timings replace the earlier
// ones), so a plain cost measured in a bad moment does not keep it drafting.
#include <algorithm>
#include <cstdint>
#include <vector>

namespace dflash {

class DraftLengthController {
public:
    explicit DraftLengthController(uint32_t cap);

    enum class Mode { Fixed, FixedNoFallback, Auto };
    void configure(Mode mode, uint32_t n_max);

    uint32_t choose();  // 0 = a plain step
    // a new sequence: fixed modes forget acceptance, auto mode keeps deep positions' only as a weak prior;
    // costs are always kept
    void reset_acceptance();
    // Costs are of a regime kept up: a step is timed only when steady (the target decoded a batch of
    // its shape the step before) and, if drafted, not a probe. libllama rebuilds its graph when the
    // shape changes (a plain step after a drafted one costs more than one after a plain step), and a
    // drafter idle for a while drafts slower for a few steps (`scripts/trace_auto.py --steps` shows
    // both); timing those would keep auto mode in whichever regime it starts in. Acceptance counts
    // every drafted step.
    void observe_draft(uint32_t k, uint32_t accepted, double draft_ms, double verify_ms, bool steady = true);
    void observe_plain(double ms, bool steady = true);
    // a cost measured outside the loop: k = 0 is a plain decode (verify_ms); observe_cost counts as a loop
    // timing, calibrate_cost is believed at once (timed after a run that built the shape's graph) and
    // joins the loop's timings of the shape
    void observe_cost(uint32_t k, double draft_ms, double verify_ms);
    void calibrate_cost(uint32_t k, double draft_ms, double verify_ms);

    double expected_tokens(uint32_t k) const;  // from the acceptance estimate itself
    double expected_cost_ms(uint32_t k) const;
    const std::vector<double> & acceptance() const { return accept_; }

private:
    // a cost: the lower quartile of the last `window` timings once there are kMinSamples of them, or at
    // once after a calibration's timing (seed)
    struct Cost {
        static constexpr uint32_t kMaxWindow = 25;
        static constexpr uint32_t kMinSamples = 3;
        explicit Cost(uint32_t window = 9) : window(std::min(window, kMaxWindow)) {}
        uint32_t window;
        double ms = -1.0;             // < 0: not measured often enough to believe
        double lowest = -1.0;         // the lowest ms ever had (< 0: none yet)
        uint32_t kept = 0, next = 0;  // measurements in recent (counted since a restart), where the next goes
        bool seeded = false;          // recent holds a calibration's timing: believed without kMinSamples
        double recent[kMaxWindow] = {};
        void observe(double x);
        // the fastest of the timings kept, -1 without any: what a few timings, too few to believe, say
        double fastest_kept() const;
        // a timing made after a run that built the shape's graph: believed at once
        void seed(double x);
        // later measurements replace the earlier ones (ms stays until there are kMinSamples of them)
        void restart() { kept = 0, seeded = false; }
    };
    // a cost timed again now and then, every `every` drafted steps: the interval doubles up to `max` after a
    // re-check that left the estimate where it was, and goes back to `first` after one that moved it
    struct Recheck {
        Recheck(uint32_t first, uint32_t max) : first(first), max(max), every(first) {}
        uint32_t first, max, every;
        double before_ms = 0.0;  // the estimate when the re-check under way began (0: none under way)
        void begin(double estimate_ms) { before_ms = estimate_ms; }
        void end(bool moved) {
            every = moved ? first : std::min(2 * every, max);
            before_ms = 0.0;
        }
    };
    uint32_t hold(uint32_t k, uint32_t steps, bool probe);  // draft k this step and steps - 1 more
    // a drafting run's length next to best to re-time (0: none): one whose cost is stale (timed long ago, or
    // best - 1 never by the loop) and that would beat best at a cost it might have: best + 1 at the lowest
    // it was ever estimated at, best - 1 (only where estimated costlier than best) on the line from a plain
    // step's cost to best's
    uint32_t stale_neighbour(uint32_t best, double best_rate) const;
    // the lowest draft + verify cost k was ever estimated at (-1: not yet estimated)
    double lowest_cost_ms(uint32_t k) const;
    // k's draft and verify costs (k = 0: the plain step's, verify_ms) given to Cost::observe or Cost::seed
    void record_cost(uint32_t k, double draft_ms, double verify_ms, void (Cost::*add)(double));
    // plain steps after a drafted one that are not timed (slower: graph rebuild, cold caches)
    uint32_t plain_warm_steps() const;
    // position i's acceptance counts scaled down to kMinEvidence drafts (the estimate stays): a weak prior
    void weaken_to_prior(uint32_t i);
    void clear_loss_counts();  // loss_reached_, loss_accepted_: a loss, if one comes, begins after now
    // E(k), the acceptance of positions from optimistic_from on at its upper confidence bound
    double tokens_at(uint32_t k, uint32_t optimistic_from) const;

    uint32_t cap_;
    Mode mode_ = Mode::Fixed;
    uint32_t n_max_;
    std::vector<double> reached_, accepted_, accept_;  // decayed counts and their ratio, positions 1..cap
    std::vector<Cost> t_draft_, t_verify_;             // [k]
    Cost t_plain_;
    uint32_t plain_run_ = 0;
    // a draft length kept for a few steps (a probe, a run's first steps, a try of one position further)
    uint32_t hold_k_ = 0, hold_left_ = 0;
    bool probing_ = false;   // the step last chosen is a probe's
    bool drafting_ = false;  // auto mode's last choice on the merits was to draft
    uint32_t probe_every_;
    uint32_t drafted_untimed_ = 0;  // steps of a drafting run since plain decoding was last timed
    uint32_t plain_streak_ = 0;     // plain steps since the last drafted one
    // plain decoding re-timed within a drafting run (before_ms -1: plain never timed, so any result moves it)
    Recheck plain_check_;
    uint32_t drafted_steps_ = 0;      // drafted steps observed
    std::vector<uint32_t> timed_at_;  // [k]: drafted_steps_ when the loop last timed k
    Recheck retime_;                  // a drafting run's re-timing of the length one further
    uint32_t retime_k_ = 0;           // the length being re-timed (0: none)
    bool run_favoured_ = false;       // the estimates favoured drafting at some step of the current run
    bool seen_draft_ = false;         // a drafted step was observed (until then auto mode probes)
    uint32_t entry_wait_ = 0;         // plain steps before the bound may begin another run
    // what the current drafting run's steps lost against plain decoding (a CUSUM, ms) and the acceptance
    // counts of the drafts since it last stood at 0, which the memory restarts from when that loss ends the run
    double run_loss_ = 0.0;
    std::vector<double> loss_reached_, loss_accepted_;
};

}  // namespace dflash
