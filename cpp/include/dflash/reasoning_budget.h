#pragma once
// llama-server's reasoning budget (--reasoning-budget N, a request's reasoning_budget_tokens): a thinking
// block may run N tokens, then its end is forced token by token (a message, then the closing tag). The same
// state holds a lazy grammar back while the model thinks: a call written inside the thinking is none.
#include <cstdint>
#include <functional>
#include <vector>

namespace dflash {

using TokenSeq = std::vector<int32_t>;

struct ReasoningBudgetParams {
    TokenSeq start;              // the thinking's opening tag (empty: no budget and no holding back)
    std::vector<TokenSeq> ends;  // its closing tags
    TokenSeq forced;             // written once the budget is spent: the message, then a closing tag
    int32_t tokens = -1;         // the budget; -1: none (the state then only holds a lazy grammar back)
    TokenSeq prompt;             // the template's opening of the reply (its generation prompt): read first
    bool enabled() const { return !start.empty() && !ends.empty(); }
};

// Finds the longest of some tags among the tokens read since the last tag it found.
class TagMatcher {
public:
    explicit TagMatcher(const std::vector<TokenSeq> & tags);
    int32_t advance(int32_t token);  // the index of the tag `token` completes, or -1
    void reset() { recent_.clear(); }
    const TokenSeq & tag(int32_t i) const { return tags_[(size_t)i]; }

private:
    std::vector<TokenSeq> tags_;  // distinct and non-empty
    size_t longest_ = 0;
    TokenSeq recent_;  // the last tokens read, at most longest_
};

// The budget's state after the generation prompt and the output so far, token by token (accept()).
// Idle until the opening tag; Counting down the budget; WaitingUtf8 when it ran out inside a character
// (the next token that ends one is still the model's); Forcing the end; Done until another opening tag.
class ReasoningBudget {
public:
    enum class State { Idle, Counting, WaitingUtf8, Forcing, Done };
    // ends_character(token): the token's text does not stop inside a UTF-8 character
    ReasoningBudget(const ReasoningBudgetParams & params, std::function<bool(int32_t)> ends_character);
    void accept(int32_t token);
    // A thinking being counted ends now: its forced end comes next (llama-server's reasoning_end control).
    // False where there is none (not thinking, or already ending).
    bool end_now();
    int32_t forced_token() const;  // the token that must come next, or -1
    bool thinking() const { return state_ != State::Idle && state_ != State::Done; }
    // forcing is under way, or may begin within the next n tokens of this thinking
    bool may_force_within(uint32_t n) const {
        return state_ == State::Forcing || state_ == State::WaitingUtf8 ||
               (state_ == State::Counting && remaining_ <= (int64_t)n);
    }
    State state() const { return state_; }
    // the closing tag that ended the thinking, while Done (nullptr: none, or not Done)
    const TokenSeq * closed_by() const {
        return state_ == State::Done && closed_by_ >= 0 ? &ends_.tag(closed_by_) : nullptr;
    }

private:
    void open();
    void force();

    TagMatcher starts_, ends_;
    TokenSeq forced_;
    int32_t budget_;
    std::function<bool(int32_t)> ends_character_;
    State state_ = State::Idle;
    int32_t remaining_ = 0;
    size_t forced_at_ = 0;
    int32_t closed_by_ = -1;
};

}  // namespace dflash
