#include "dflash/reasoning_budget.h"

#include <algorithm>
#include <climits>

namespace dflash {

TagMatcher::TagMatcher(const std::vector<TokenSeq> & tags) {
    for (const TokenSeq & t : tags) {
        if (!t.empty() && std::find(tags_.begin(), tags_.end(), t) == tags_.end()) tags_.push_back(t);
    }
    for (const TokenSeq & t : tags_) longest_ = std::max(longest_, t.size());
}

int32_t TagMatcher::advance(int32_t token) {
    recent_.push_back(token);
    if (recent_.size() > longest_) recent_.erase(recent_.begin());
    int32_t found = -1;
    for (size_t i = 0; i < tags_.size(); ++i) {
        const TokenSeq & t = tags_[i];
        const bool ends_here = t.size() <= recent_.size() && std::equal(t.rbegin(), t.rend(), recent_.rbegin());
        if (ends_here && (found < 0 || t.size() > tags_[(size_t)found].size())) found = (int32_t)i;
    }
    // as llama-server's matcher: a tag found starts the search afresh (tags do not overlap)
    if (found >= 0) recent_.clear();
    return found;
}

ReasoningBudget::ReasoningBudget(const ReasoningBudgetParams & params, std::function<bool(int32_t)> ends_character) :
    starts_({params.start}),
    ends_(params.ends),
    forced_(params.forced),
    budget_(params.tokens < 0 ? INT_MAX : params.tokens),
    ends_character_(std::move(ends_character)) {}

void ReasoningBudget::open() {
    state_ = State::Counting;
    remaining_ = budget_;
    if (remaining_ <= 0) force();
}

void ReasoningBudget::force() {
    state_ = State::Forcing;
    forced_at_ = 0;
}

void ReasoningBudget::accept(int32_t token) {
    switch (state_) {
        case State::Idle:
            if (starts_.advance(token) >= 0) open();
            break;
        case State::Done:  // another thinking block gets a budget of its own
            if (starts_.advance(token) >= 0) {
                ends_.reset();
                closed_by_ = -1;
                open();
            }
            break;
        case State::Counting:
        case State::WaitingUtf8: {
            const int32_t closed = ends_.advance(token);
            if (closed >= 0) {
                state_ = State::Done;
                closed_by_ = closed;
                break;
            }
            const bool whole = ends_character_(token);
            if (state_ == State::Counting) {
                if (--remaining_ > 0) break;
                ends_.reset();
                if (whole) {
                    force();
                } else {
                    state_ = State::WaitingUtf8;
                }
            } else if (whole) {
                ends_.reset();
                force();
            }
            break;
        }
        case State::Forcing: {
            // the closing tag among the forced tokens is the one that ended the thinking
            const int32_t closed = ends_.advance(token);
            if (++forced_at_ >= forced_.size()) {
                state_ = State::Done;
                closed_by_ = closed;
            }
            break;
        }
    }
}

bool ReasoningBudget::end_now() {
    if (state_ != State::Counting) return false;
    ends_.reset();
    force();
    return true;
}

int32_t ReasoningBudget::forced_token() const {
    return state_ == State::Forcing && forced_at_ < forced_.size() ? forced_[forced_at_] : -1;
}

}  // namespace dflash
