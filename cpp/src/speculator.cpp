#include "dflash/speculator.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>
#include <string_view>

#include "dflash/error.h"
#include "dflash/draft_length.h"

namespace dflash {

namespace {

double ms_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// calibration (auto mode): placeholder context rows; per shape one run that builds its graph, then up
// to kCalibrationTimed timed runs (fewer once they took kCalibrationShapeMs: a large model's step times
// well enough alone), each believed at once (DraftLengthController::calibrate_cost); draft lengths in
// order while their time stays within kCalibrationBudgetMs or kCalibrationPlainSteps plain steps,
// whichever is longer (a 1.7B target on 2 CPU cores: lengths 0-5 in ~2.6 s); the controller estimates
// the lengths left from the timed ones
constexpr uint32_t kCalibrationContext = 64;
constexpr uint32_t kCalibrationTimed = 3;
constexpr double kCalibrationShapeMs = 150.0;
constexpr double kCalibrationBudgetMs = 300.0;
constexpr double kCalibrationPlainSteps = 24.0;

// libllama takes trigger patterns as std::regex (ECMAScript); the words are literal text
std::string regex_escaped(const std::string & word) {
    std::string out;
    for (char c : word) {
        if (std::string_view("\\^$.|?*+()[]{}").find(c) != std::string_view::npos) out += '\\';
        out += c;
    }
    return out;
}

}  // namespace

Speculator::Speculator(std::unique_ptr<Target> target, std::unique_ptr<Drafter> drafter,
                       const SpeculatorOptions & opts) :
    target_(std::move(target)), drafter_(std::move(drafter)), opts_(opts) {
    const DraftHparams & h = drafter_->hparams();
    if (target_->n_vocab() != drafter_->n_vocab()) {
        throw Error("vocabulary mismatch: the target has " + std::to_string(target_->n_vocab()) +
                    " tokens, the drafter " + std::to_string(drafter_->n_vocab()));
    }
    if (target_->n_embd() != h.target_hidden) {
        throw Error("hidden size mismatch: the target's hidden size is " + std::to_string(target_->n_embd()) +
                    ", the drafter expects features of width " + std::to_string(h.target_hidden));
    }
    if (drafter_->n_ctx() < target_->n_ctx() + h.block_size) {
        throw Error("the draft cache (" + std::to_string(drafter_->n_ctx()) + " rows) must hold the target context (" +
                    std::to_string(target_->n_ctx()) + ") plus one block");
    }
    target_->set_feature_layers(h.target_layers);
    length_ = std::make_unique<DraftLengthController>(h.block_size - 1);
    all_ids_.resize(drafter_->n_vocab());
    std::iota(all_ids_.begin(), all_ids_.end(), 0);
    set_n_max(opts.n_max, opts.adaptive);
}

Speculator::~Speculator() = default;

void Speculator::set_n_max(uint32_t n, bool adaptive) {
    const uint32_t cap = drafter_->hparams().block_size - 1;
    n_max_ = (n == 0 || n > cap) ? cap : n;
    opts_.adaptive = adaptive;
    using Mode = DraftLengthController::Mode;
    length_->configure(adaptive ? Mode::Auto : (opts_.fallback ? Mode::Fixed : Mode::FixedNoFallback), n_max_);
}

std::vector<double> Speculator::acceptance_estimate() const { return length_->acceptance(); }
double Speculator::expected_step_ms(uint32_t k) const { return length_->expected_cost_ms(k); }

void Speculator::flush_features() {
    if (pending_rows_ == 0) return;
    const auto t0 = std::chrono::steady_clock::now();
    const uint32_t first = drafter_->n_cached();
    std::vector<int32_t> pos(pending_rows_);
    for (uint32_t i = 0; i < pending_rows_; ++i) pos[i] = (int32_t)(first + i);
    drafter_->inject(pending_.data(), pos.data(), pending_rows_);
    pending_.clear();
    pending_rows_ = 0;
    stats_.inject_ms += ms_since(t0);
}

SpecStats Speculator::stats() const {
    SpecStats s = stats_;
    s.target_decodes = target_->decode_calls() - decodes_before_start_;
    return s;
}

int32_t Speculator::start(const std::vector<int32_t> & prompt, const SamplingParams & params, uint64_t seed) {
    anchor_ = -1;  // step() refuses to run until this start() has succeeded
    if (prompt.empty()) throw Error("the prompt is empty");
    if (prompt.size() + 1 > target_->n_ctx()) {
        throw Error("the prompt has " + std::to_string(prompt.size()) + " tokens but the context holds " +
                    std::to_string(target_->n_ctx()) + " (n_ctx); nothing would be generated");
    }
    for (int32_t t : prompt) {
        if (t < 0 || (uint32_t)t >= target_->n_vocab()) {
            throw Error("prompt token " + std::to_string(t) + " is outside the vocabulary (" +
                        std::to_string(target_->n_vocab()) + ")");
        }
    }
    for (const auto & [id, bias] : params.logit_bias) {
        if (id < 0 || (uint32_t)id >= target_->n_vocab()) {
            throw Error("logit_bias token " + std::to_string(id) + " is outside the vocabulary (" +
                        std::to_string(target_->n_vocab()) + ")");
        }
    }
    if (params.penalty_last_n < 0)
        throw Error("penalty_last_n must be >= 0, got " + std::to_string(params.penalty_last_n));
    if (params.n_logprobs < -1)
        throw Error("logprobs must be >= 0 (or -1: none), got " + std::to_string(params.n_logprobs));
    if (params.prompt_logprobs && params.n_logprobs < 0) throw Error("prompt logprobs need logprobs >= 0");
    if (params.mirostat < 0 || params.mirostat > 2) {
        throw Error("mirostat must be 0 (off), 1 or 2, got " + std::to_string(params.mirostat));
    }
    grammar_.reset();
    if (!params.grammar.empty()) {
        check_grammar_text(params.grammar);
        if (params.grammar_triggers.empty()) {
            grammar_.reset(
                llama_sampler_init_grammar(target_->vocab(), params.grammar.c_str(), params.grammar_root.c_str()));
        } else {
            std::vector<std::string> patterns;
            for (const std::string & word : params.grammar_triggers) {
                if (word.empty()) throw Error("grammar_triggers: a trigger word is empty");
                patterns.push_back(regex_escaped(word));
            }
            std::vector<const char *> c_patterns;
            for (const std::string & p : patterns) c_patterns.push_back(p.c_str());
            grammar_.reset(llama_sampler_init_grammar_lazy_patterns(target_->vocab(), params.grammar.c_str(),
                                                                    params.grammar_root.c_str(), c_patterns.data(),
                                                                    c_patterns.size(), nullptr, 0));
        }
        if (!grammar_) {
            throw Error("the grammar does not parse or has no rule '" + params.grammar_root +
                        "' (libllama logs where: verbose=True, or dflash generate --verbose)");
        }
    }
    budget_.reset();
    if (params.reasoning.enabled()) {
        const ReasoningBudgetParams & r = params.reasoning;
        std::vector<std::pair<const char *, const TokenSeq *>> seqs = {
            {"opening tag", &r.start}, {"forced end", &r.forced}, {"generation prompt", &r.prompt}};
        for (const TokenSeq & end : r.ends) seqs.push_back({"closing tag", &end});
        for (const auto & [what, seq] : seqs) {
            for (int32_t t : *seq) {
                if (t < 0 || (uint32_t)t >= target_->n_vocab()) {
                    throw Error("reasoning budget: token " + std::to_string(t) + " of its " + what +
                                " is outside the vocabulary (" + std::to_string(target_->n_vocab()) + ")");
                }
            }
        }
        budget_.emplace(r, [this](int32_t t) { return ends_character(t); });
        for (int32_t t : r.prompt) budget_->accept(t);
    }
    params_ = params;
    // a fresh window per generation, as llama-cpp-python makes a fresh sampler per call
    generated_ = TokenWindow(params.penalizes() ? params.penalty_last_n : 0);
    mu_ = 2.0f * params.mirostat_tau;
    rng_.seed(seed);
    seed_ = seed;
    stats_ = SpecStats{};
    decodes_before_start_ = target_->decode_calls();
    if (opts_.adaptive && !calibrated_) calibrate();
    stats_.pos_reached.assign(drafter_->hparams().block_size - 1, 0);
    stats_.pos_accepted.assign(drafter_->hparams().block_size - 1, 0);
    stats_.steps_by_length.assign(drafter_->hparams().block_size, 0);
    length_->reset_acceptance();

    // reuse the longest common prefix; the last prompt token is always decoded for its logits
    size_t reuse = 0;
    while (reuse < committed_.size() && reuse < prompt.size() && committed_[reuse] == prompt[reuse]) ++reuse;
    reuse = params.prompt_logprobs ? 0 : std::min(reuse, prompt.size() - 1);
    const auto t0 = std::chrono::steady_clock::now();
    reuse = prefix_to_keep(reuse);
    // what is not decoded again: a target that goes back through a checkpoint re-decodes the tokens after it
    // (llama-server's cache_n counts the same)
    const uint32_t kept = (uint32_t)target_->replay_from((int32_t)reuse);
    keep_prefix(reuse);

    const uint32_t last_row = prefill(prompt, (uint32_t)reuse);
    committed_ = prompt;
    history_ = prompt;
    const int32_t first = choose_token(target_->logits(last_row), generated_, (int32_t)prompt.size());
    commit_token(first);
    start_output_ = StepOutput{};
    start_output_.tokens = {first};
    describe(start_output_, last_row);
    anchor_ = first;
    stats_.prefill_ms = ms_since(t0);
    stats_.prompt_tokens = (uint32_t)prompt.size();
    stats_.reused_tokens = kept;
    return anchor_;
}

uint32_t Speculator::prefill(const std::vector<int32_t> & prompt, uint32_t from) {
    prompt_logprobs_.clear();
    const uint32_t n = (uint32_t)prompt.size();
    const bool all_rows = params_.prompt_logprobs;
    // with prompt logprobs chunk by chunk, as a decode keeps only its last chunk's logits; else in one call
    // (the target chunks it) with the last row's logits alone
    uint32_t chunk = 0;
    for (uint32_t done = from; done < n; done += chunk) {
        chunk = all_rows ? std::min(target_->n_batch(), n - done) : n - done;
        // a checkpoint where the same prompt again (or one that differs only in its last token) starts: a
        // recurrent state's before the prompt's last token (it cannot go back one), sliding-window layers' at
        // the prompt's end (they can)
        const bool at_end = done + chunk == n;
        const bool split_last = at_end && chunk > 1 && target_->keeps_checkpoints() && target_->recurrent();
        if (split_last) chunk--;
        target_->decode(prompt.data() + done, chunk, (int32_t)done, all_rows);
        const auto & f = target_->features();
        pending_.insert(pending_.end(), f.begin(), f.end());
        pending_rows_ += chunk;
        for (uint32_t i = 0; all_rows && i < chunk && done + i + 1 < n; ++i) {
            prompt_logprobs_.push_back(token_logprob(target_->logits(i), target_->n_vocab(), prompt[done + i + 1],
                                                     (uint32_t)params_.n_logprobs, id_scratch_));
        }
        if (split_last || (at_end && target_->keeps_checkpoints() && !target_->recurrent())) target_->checkpoint();
    }
    drafter_->keep_rings_at(n);       // the drafter's sliding layers, once the prompt's rows reach them
    return all_rows ? chunk - 1 : 0;  // Target::logits(0) is the last row when only it has logits
}

size_t Speculator::prefix_to_keep(size_t n) {
    // where the drafter's sliding layers lost rows of the window before n (a new conversation sharing a
    // system prompt, an edit further back than the rings' copies) and the target re-decodes part of the
    // prefix anyway (a recurrent state or sliding-window layers from a checkpoint or from the start): that
    // part goes through prefill instead, so that its rows reach the drafter too
    if (n >= drafter_->n_cached()) return n;
    drafter_->truncate((uint32_t)n);  // puts a copy of the rings back where one holds the window
    return drafter_->holds_window() ? n : (size_t)target_->replay_from((int32_t)n);
}

void Speculator::keep_prefix(size_t n) {
    target_->truncate((int32_t)n);
    committed_.resize(n);
    const uint32_t cached = drafter_->n_cached();
    if (n < cached) {
        drafter_->truncate((uint32_t)n);
        pending_.clear();
        pending_rows_ = 0;
    } else {
        pending_rows_ = (uint32_t)n - cached;
        pending_.resize((size_t)pending_rows_ * drafter_->hparams().n_target_features());
    }
}

SpeculatorState Speculator::save_state() {
    anchor_ = -1;
    keep_prefix(committed_.size());  // keep_cached_prefix may have shortened committed_ alone
    flush_features();
    return SpeculatorState{committed_, target_->save_seq(), drafter_->save_cache()};
}

void Speculator::load_state(const SpeculatorState & state) {
    anchor_ = -1;
    if (opts_.adaptive && !calibrated_) calibrate();  // it clears the context: before, not after the load
    for (int32_t t : state.tokens) {
        if (t < 0 || (uint32_t)t >= target_->n_vocab()) {
            throw Error("saved state: token " + std::to_string(t) + " is outside the vocabulary (" +
                        std::to_string(target_->n_vocab()) + ")");
        }
    }
    committed_.clear();
    pending_.clear();
    pending_rows_ = 0;
    drafter_->reset();
    target_->load_seq(state.target, state.tokens);
    try {
        if (target_->seq_len() != state.tokens.size()) {
            throw Error("saved state: the target state holds " + std::to_string(target_->seq_len()) +
                        " positions, its token list " + std::to_string(state.tokens.size()));
        }
        drafter_->load_cache(state.draft, (uint32_t)state.tokens.size());
    } catch (...) {
        target_->clear();
        throw;
    }
    committed_ = state.tokens;
}

void Speculator::keep_cached_prefix(const std::vector<int32_t> & held) {
    size_t n = 0;
    while (n < committed_.size() && n < held.size() && committed_[n] == held[n]) ++n;
    if (n < committed_.size() || held.size() != committed_.size()) target_->forget_after((uint32_t)n);
    committed_.resize(n);  // start() truncates the target, the draft cache and the pending features to it
    anchor_ = -1;
}

void Speculator::set_lora_scales(const std::vector<float> & scales) {
    std::vector<float> now;
    for (const auto & lora : target_->loras()) now.push_back(lora.second);
    if (scales == now) return;
    target_->set_lora_scales(scales);
    target_->clear();
    drafter_->reset();
    committed_.clear();
    pending_.clear();
    pending_rows_ = 0;
    anchor_ = -1;
}

void Speculator::calibrate() {
    const auto t_start = std::chrono::steady_clock::now();
    const uint32_t cap = drafter_->hparams().block_size - 1;
    calibrated_ = true;
    if (target_->n_ctx() < cap + 2) return;  // no room: the controller explores the costs in the loop instead
    // a context like a short prompt's, so that attention has rows to read
    const uint32_t n_ctx_rows = std::min<uint32_t>(kCalibrationContext, target_->n_ctx() - cap - 1);
    std::vector<int32_t> tokens(n_ctx_rows + cap + 1);
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = (int32_t)(i % target_->n_vocab());
    target_->clear();
    drafter_->reset();
    committed_.clear();
    pending_.clear();
    pending_rows_ = 0;
    target_->decode(tokens.data(), n_ctx_rows, 0, false);
    const auto & f = target_->features();
    std::vector<int32_t> pos(n_ctx_rows);
    std::iota(pos.begin(), pos.end(), 0);
    drafter_->inject(f.data(), pos.data(), n_ctx_rows);
    const int32_t p = (int32_t)n_ctx_rows;
    target_->checkpoint();  // every verify below goes back to p: a recurrent target restores this state
    // one step of k drafted tokens at p, as the loop's steady steps are: (draft ms, verify ms)
    auto run = [&](uint32_t k) {
        double draft_ms = 0.0;
        if (k > 0) {
            const auto t0 = std::chrono::steady_clock::now();
            drafter_->draft(tokens[p], p, k, false, /*all_rows=*/false, /*short_block=*/true);
            draft_ms = std::max(0.0, ms_since(t0) - drafter_->counters().setup_ms_last);
        }
        // a verify is timed with its rollback as a step that keeps the anchor alone pays it (a snapshot
        // rollback, or a checkpoint written before and restored after with the anchor re-decoded)
        const auto t0 = std::chrono::steady_clock::now();
        if (k > 0) target_->prepare_rollback(k);
        target_->decode(&tokens[p], k + 1, p, k > 0);
        if (k == 0) (void)argmax(target_->logits(0), target_->n_vocab());  // a plain step picks its token
        if (k > 0) target_->truncate(p + 1);
        const double verify_ms = ms_since(t0);
        target_->truncate(p);
        return std::pair{draft_ms, verify_ms};
    };
    // the budget is the lengths' own: a large model's prefill of the context rows above takes a while
    const auto t_lengths = std::chrono::steady_clock::now();
    double budget_ms = kCalibrationBudgetMs;
    for (uint32_t k = 0; k <= cap && ms_since(t_lengths) < budget_ms; ++k) {
        (void)run(k);  // builds the shape's graph
        const auto t_shape = std::chrono::steady_clock::now();
        for (uint32_t rep = 0; rep < kCalibrationTimed && (rep == 0 || ms_since(t_shape) < kCalibrationShapeMs);
             ++rep) {
            const auto [draft_ms, verify_ms] = run(k);
            length_->calibrate_cost(k, draft_ms, verify_ms);
        }
        if (k == 0) budget_ms = std::max(budget_ms, kCalibrationPlainSteps * length_->expected_cost_ms(0));
    }
    target_->clear();
    drafter_->reset();
    stats_.calibration_ms = ms_since(t_start);
}

const float * Speculator::processed(const float * logits) {
    if (!params_.logits_processor) return logits;
    processed_.assign(logits, logits + target_->n_vocab());
    params_.logits_processor(history_, processed_.data(), target_->n_vocab());
    return processed_.data();
}

const float * Speculator::shaped(const float * logits, const TokenWindow & window) {
    const uint32_t V = target_->n_vocab();
    const float * lg = shape_logits(processed(logits), V, params_, window, shaped_);
    if (!grammar_applies()) return lg;
    // with top-k, the distribution is that of the k most likely tokens the grammar allows (Mirostat cuts
    // instead of top-k)
    const uint32_t k = params_.mirostat == 0 ? (uint32_t)std::max(params_.top_k, 0) : 0;
    if (k > 0 && k < V && !params_.grammar_full_pass) {
        const std::vector<int32_t> top = top_allowed(lg, k);
        if (top.size() == k) {
            grammar_rows_.clear();  // (id, logit) of the kept tokens: lg may be shaped_ itself
            for (int32_t id : top) grammar_rows_.push_back({id, lg[id], 0.0f});
            shaped_.assign(V, -INFINITY);
            for (const llama_token_data & t : grammar_rows_) shaped_[(size_t)t.id] = t.logit;
            return shaped_.data();
        }
    }
    return grammar_masked(lg);
}

std::vector<int32_t> Speculator::top_allowed(const float * lg, uint32_t want) {
    const uint32_t V = target_->n_vocab();
    const uint32_t m = std::min<uint64_t>(V, 4ull * want);
    auto before = [lg](int32_t a, int32_t b) { return lg[a] != lg[b] ? lg[a] > lg[b] : a < b; };
    std::vector<int32_t> & ids = id_scratch_;
    ids.resize(V);
    std::iota(ids.begin(), ids.end(), 0);
    std::partial_sort(ids.begin(), ids.begin() + m, ids.end(), before);
    std::vector<int32_t> out;
    for (uint32_t i = 0; i < m && out.size() < want; ++i) {
        llama_token_data one{ids[i], lg[ids[i]], 0.0f};
        llama_token_data_array just_one{&one, 1, -1, false};
        llama_sampler_apply(grammar_.get(), &just_one);
        if (one.logit != -INFINITY) out.push_back(ids[i]);
    }
    return out;
}

const float * Speculator::grammar_masked(const float * lg) {
    const uint32_t V = target_->n_vocab();
    grammar_rows_.resize(V);
    for (uint32_t i = 0; i < V; ++i) grammar_rows_[i] = llama_token_data{(llama_token)i, lg[i], 0.0f};
    llama_token_data_array rows{grammar_rows_.data(), V, -1, false};
    llama_sampler_apply(grammar_.get(), &rows);
    shaped_.resize(V);  // lg may be shaped_ itself: it was copied above
    bool any = false;
    for (size_t i = 0; i < rows.size; ++i) {
        shaped_[(size_t)rows.data[i].id] = rows.data[i].logit;
        any = any || rows.data[i].logit != -INFINITY;
    }
    // accepting a token the grammar rejects aborts libllama: better an error
    if (!any)
        throw Error("the grammar allows no token here (it is complete and the model has no end-of-generation token?)");
    return shaped_.data();
}

int32_t Speculator::greedy_token(const float * logits, const TokenWindow & window, int32_t guess) {
    const uint32_t V = target_->n_vocab();
    const float * lg = shape_logits(processed(logits), V, params_, window, shaped_);
    if (const int32_t forced = forced_token(); forced >= 0) return forced;
    const int32_t best = is_argmax(lg, V, guess) ? guess : argmax(lg, V);  // (false for guess -1)
    if (!grammar_applies()) return best;
    llama_token_data one{best, lg[best], 0.0f};
    llama_token_data_array just_best{&one, 1, -1, false};
    llama_sampler_apply(grammar_.get(), &just_best);
    if (one.logit != -INFINITY) return best;
    if (!params_.grammar_full_pass) {
        const std::vector<int32_t> top = top_allowed(lg, 1);
        if (!top.empty()) return top[0];
    }
    return argmax(grammar_masked(lg), V);
}

void Speculator::commit_token(int32_t token) {
    generated_.push(token);
    history_.push_back(token);
    const bool to_grammar = grammar_applies();  // as the budget stood before this token
    if (budget_) {
        budget_->accept(token);
        // a lazy grammar held back while the model thought reads the tag that ended it (llama-server's)
        const TokenSeq * tag = budget_->closed_by();
        if (grammar_ && !to_grammar && tag != nullptr) {
            for (int32_t t : *tag) llama_sampler_accept(grammar_.get(), t);
        }
    }
    if (to_grammar) llama_sampler_accept(grammar_.get(), token);
}

bool Speculator::grammar_applies() const {
    return grammar_ && !(budget_ && budget_->thinking() && !params_.grammar_triggers.empty());
}

int32_t Speculator::forced_token() {
    const int32_t forced = budget_ ? budget_->forced_token() : -1;
    if (forced >= 0 && grammar_applies()) {
        llama_token_data one{forced, 0.0f, 0.0f};
        llama_token_data_array just_one{&one, 1, -1, false};
        llama_sampler_apply(grammar_.get(), &just_one);
        // accepting a token the grammar rejects aborts libllama: better an error
        if (one.logit == -INFINITY) {
            throw Error("the reasoning budget forces the thinking's end (token " + std::to_string(forced) +
                        ") where the grammar allows no such token");
        }
    }
    return forced;
}

bool Speculator::ends_character(int32_t token) const {
    // called per thinking token: the piece goes to the stack (a longer one, rare, to the heap)
    char buf[128];
    std::string longer;
    const char * piece = buf;
    int32_t n = llama_token_to_piece(target_->vocab(), token, buf, (int32_t)sizeof buf, 0, false);
    if (n < 0) {
        longer.resize((size_t)-n);
        n = llama_token_to_piece(target_->vocab(), token, longer.data(), (int32_t)longer.size(), 0, false);
        piece = longer.data();
    }
    const size_t len = (size_t)std::max(n, 0);
    // whole where the last lead byte has all its continuation bytes after it
    for (size_t i = 1; i <= std::min<size_t>(4, len); ++i) {
        const unsigned char c = (unsigned char)piece[len - i];
        if ((c & 0xC0) != 0x80) return i >= (c >= 0xF0 ? 4u : c >= 0xE0 ? 3u : c >= 0xC0 ? 2u : 1u);
    }
    return len == 0;
}

void Speculator::describe(StepOutput & out, uint32_t first_row) {
    const uint32_t V = target_->n_vocab();
    for (size_t i = 0; i < out.tokens.size(); ++i) {
        const float * row = target_->logits(first_row + (uint32_t)i);
        if (params_.n_logprobs >= 0) {
            out.logprobs.push_back(token_logprob(row, V, out.tokens[i], (uint32_t)params_.n_logprobs, id_scratch_));
        }
        if (params_.keep_logits) out.logits.insert(out.logits.end(), row, row + V);
    }
}

int32_t Speculator::draw(const SparseDist & d, int32_t pos) {
    return opts_.gumbel ? gumbel_pick(d, seed_, pos) : sample(d, rng_);
}

int32_t Speculator::choose_token(const float * logits, const TokenWindow & window, int32_t pos) {
    if (params_.greedy()) return greedy_token(logits, window);
    const SparseDist p = next_distribution(logits, window);
    const int32_t token = draw(p, pos);
    sampled(p, token);
    return token;
}

SparseDist Speculator::sampling_distribution(const float * lg) const {
    const uint32_t V = target_->n_vocab();
    return params_.mirostat != 0 ? mirostat_distribution(lg, V, params_, mu_) : target_distribution(lg, V, params_);
}

void Speculator::sampled(const SparseDist & p, int32_t token) {
    if (params_.mirostat != 0) mu_ = mirostat_update(p, token, params_, mu_);
}

SparseDist Speculator::next_distribution(const float * logits, const TokenWindow & window) {
    const float * lg = shaped(logits, window);  // (the logits processor sees every emitted token's row)
    if (const int32_t forced = forced_token(); forced >= 0) return SparseDist{{forced}, {1.0f}};
    return sampling_distribution(lg);
}

SparseDist Speculator::draft_distribution(const DraftResult & r, uint32_t row, int32_t pred_index) const {
    const float T = params_.mirostat != 0 ? 1.0f : params_.temperature;  // Mirostat samples at temperature 1
    if (r.top_k > 0 && opts_.draft_q == DraftQ::Selector) {
        const uint32_t k = r.top_k;
        return softmax_on(&r.candidates[(size_t)row * k], &r.scores[((size_t)row * k + (uint32_t)pred_index) * k], k,
                          T);
    }
    const uint32_t V = drafter_->n_vocab();
    return softmax_on(all_ids_.data(), r.row_logits(row + 1, V), V, T);
}

StepOutput Speculator::step(uint32_t max_tokens) {
    StepOutput out;
    if (anchor_ < 0) throw Error("step() before start()");
    const uint32_t n = (uint32_t)committed_.size();
    if (n + 1 > target_->n_ctx()) {
        out.context_full = true;
        return out;
    }
    // the controller is told what whole steps cost, bookkeeping included (draft + verify alone would leave
    // a drafted step's accept-and-commit out, and auto mode would draft where plain decoding is ahead)
    const auto t_step = std::chrono::steady_clock::now();
    if (max_tokens == 0) throw Error("step(max_tokens = 0): a step emits at least one token");
    const uint32_t m = std::min({length_->choose(), target_->n_ctx() - n - 1, max_tokens - 1});
    if (m == 0) {
        stats_.steps_by_length[0]++;
        StepOutput plain = step_plain();
        length_->observe_plain(ms_since(t_step), target_->repeated_shape());
        return plain;
    }

    // draft (bringing the draft cache up to date first)
    auto t0 = std::chrono::steady_clock::now();
    const double inject_before = stats_.inject_ms;
    flush_features();
    const bool greedy = params_.greedy();
    const bool need_logits = !greedy && (drafter_->hparams().version == 1 || opts_.draft_q == DraftQ::Logits);
    // a short block, [anchor, MASK x m], as llama.cpp drafts: on the bundled pair the acceptance equals the
    // full block's (2.92 at n_max 3 both) at a fraction of the cost
    DraftResult r = drafter_->draft(anchor_, (int32_t)n, m, need_logits, /*all_rows=*/false, /*short_block=*/true);
    std::vector<int32_t> seq(m + 1);
    seq[0] = anchor_;
    std::vector<SparseDist> q;
    if (greedy) {
        std::copy(r.tokens.begin(), r.tokens.end(), seq.begin() + 1);
    } else {
        int32_t pred_index = 0;  // row 1: every predecessor row is the anchor
        for (uint32_t t = 0; t < m; ++t) {
            q.push_back(draft_distribution(r, t, pred_index));
            seq[t + 1] = draw(q.back(), (int32_t)(n + 1 + t));
            if (r.top_k > 0) {
                const int32_t * c = &r.candidates[(size_t)t * r.top_k];
                pred_index = (int32_t)(std::find(c, c + r.top_k, seq[t + 1]) - c);
                if ((uint32_t)pred_index >= r.top_k) pred_index = 0;  // logits mode: drafted outside the lattice
            }
        }
    }
    // the rows the reasoning budget forces once the drafts before them are accepted: drafted as forced (the
    // budget is copied and run over the drafts only where forcing may begin within them)
    if (budget_ && budget_->may_force_within(m)) {
        ReasoningBudget ahead = *budget_;
        for (uint32_t t = 0; t < m; ++t) {
            if (const int32_t forced = ahead.forced_token(); forced >= 0) {
                seq[t + 1] = forced;
                if (!greedy) q[t] = SparseDist{{forced}, {1.0f}};
            }
            ahead.accept(seq[t + 1]);
        }
    }
    const double draft_ms = ms_since(t0) - (stats_.inject_ms - inject_before);
    stats_.draft_ms += draft_ms;
    // the controller models a step's own cost: not the rows plain steps left to inject, nor a graph
    // built for a new attention window or draft length
    const double draft_step_ms = std::max(0.0, draft_ms - drafter_->counters().setup_ms_last);

    // verify
    t0 = std::chrono::steady_clock::now();
    target_->prepare_rollback(m);
    const double checkpoint_ms = ms_since(t0);
    t0 = std::chrono::steady_clock::now();
    target_->decode(seq.data(), m + 1, (int32_t)n, true);
    const double verify_ms = ms_since(t0);
    stats_.verify_ms += verify_ms;

    // accept
    t0 = std::chrono::steady_clock::now();
    // row j's penalties see the drafted tokens before it: each is pushed once accepted, which also
    // leaves the window right for the next step
    uint32_t j = 0;
    int32_t next = -1;
    for (; j < m; ++j) {
        if (greedy) {
            const int32_t best = greedy_token(target_->logits(j), generated_, seq[j + 1]);
            if (best != seq[j + 1]) {
                next = best;
                break;
            }
        } else {
            const SparseDist p = next_distribution(target_->logits(j), generated_);
            RejectionOutcome o;
            if (opts_.gumbel) {  // the target's own draw at this position, accepted when the draft is it
                o.token = draw(p, (int32_t)(n + 1 + j));
                o.accepted = o.token == seq[j + 1];
            } else {
                o = verify_draft_token(p, q[j], seq[j + 1], rng_);
            }
            sampled(p, o.token);
            if (!o.accepted) {
                next = o.token;
                break;
            }
        }
        commit_token(seq[j + 1]);
    }
    if (j == m) next = choose_token(target_->logits(m), generated_, (int32_t)(n + 1 + m));
    commit_token(next);
    stats_.sample_ms += ms_since(t0);
    out.tokens.assign(seq.begin() + 1, seq.begin() + 1 + j);
    out.tokens.push_back(next);
    describe(out);

    // commit a, d_1..d_j; roll the target back past the rejected rows (a recurrent target may re-decode
    // the kept rows: their features are the verify's)
    const size_t width = drafter_->hparams().n_target_features();
    const auto & f = target_->features();
    pending_.insert(pending_.end(), f.begin(), f.begin() + (size_t)(j + 1) * width);
    t0 = std::chrono::steady_clock::now();
    target_->truncate((int32_t)(n + j + 1));
    stats_.rollback_ms += checkpoint_ms + ms_since(t0);
    pending_rows_ += j + 1;
    committed_.insert(committed_.end(), seq.begin(), seq.begin() + j + 1);
    anchor_ = next;

    out.drafted = m;
    out.accepted = j;
    stats_.steps++;
    stats_.drafted += m;
    stats_.accepted += j;
    stats_.steps_by_length[m]++;
    stats_.emitted += out.tokens.size();
    for (uint32_t i = 0; i < m && i <= j; ++i) {
        stats_.pos_reached[i]++;
        if (i < j) stats_.pos_accepted[i]++;
    }
    const double step_ms = ms_since(t_step) - (stats_.inject_ms - inject_before) - drafter_->counters().setup_ms_last;
    length_->observe_draft(m, j, draft_step_ms, std::max(0.0, step_ms - draft_step_ms), target_->repeated_shape());
    return out;
}

StepOutput Speculator::step_plain() {
    StepOutput out;
    const uint32_t n = (uint32_t)committed_.size();
    if (n + 1 > target_->n_ctx()) {
        out.context_full = true;
        return out;
    }
    const auto t0 = std::chrono::steady_clock::now();
    target_->decode(&anchor_, 1, (int32_t)n, false);
    const float * lg = target_->logits(0);
    const int32_t next = choose_token(lg, generated_, (int32_t)n + 1);
    commit_token(next);
    stats_.verify_ms += ms_since(t0);
    const auto & f = target_->features();
    pending_.insert(pending_.end(), f.begin(), f.end());
    pending_rows_ += 1;
    committed_.push_back(anchor_);
    anchor_ = next;
    out.tokens.push_back(next);
    describe(out);
    stats_.steps++;
    stats_.emitted++;
    return out;
}

}  // namespace dflash
