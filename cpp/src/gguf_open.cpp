#include "gguf_open.h"

#include <cstdio>
#include <mutex>

#include "dflash/error.h"

namespace dflash {

namespace {

std::mutex g_capture_mu;

struct LogCapture {
    ggml_log_callback prev_cb = nullptr;
    void * prev_ud = nullptr;
    std::string text;

    LogCapture() {
        g_capture_mu.lock();
        ggml_log_get(&prev_cb, &prev_ud);
        ggml_log_set(&LogCapture::append, this);
    }
    ~LogCapture() {
        ggml_log_set(prev_cb, prev_ud);
        g_capture_mu.unlock();
    }
    static void append(ggml_log_level, const char * t, void * ud) {
        auto * self = static_cast<LogCapture *>(ud);
        if (self->text.size() < 2000) self->text += t;
    }
};

std::string one_line(std::string s) {
    while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
    for (auto & c : s)
        if (c == '\n') c = ';';
    return s;
}

}  // namespace

QuietDebugLog::QuietDebugLog() {
    g_capture_mu.lock();
    ggml_log_get(&prev_cb_, &prev_ud_);
    ggml_log_set(&QuietDebugLog::forward, this);
}

QuietDebugLog::~QuietDebugLog() {
    ggml_log_set(prev_cb_, prev_ud_);
    g_capture_mu.unlock();
}

void QuietDebugLog::forward(ggml_log_level level, const char * text, void * ud) {
    auto * self = static_cast<QuietDebugLog *>(ud);
    if (level != GGML_LOG_LEVEL_CONT)
        self->dropping_ = level == GGML_LOG_LEVEL_DEBUG;  // CONT: as the line it continues
    if (self->dropping_) return;
    if (self->prev_cb_) {
        self->prev_cb_(level, text, self->prev_ud_);
    } else {
        std::fputs(text, stderr);
    }
}

gguf_ptr open_gguf(const std::string & path, ggml_context_ptr & meta, const std::string & what) {
    ggml_context * meta_raw = nullptr;
    gguf_init_params params{/*no_alloc =*/true, /*ctx =*/&meta_raw};
    std::string reason;
    gguf_ptr g;
    {
        LogCapture capture;
        g.reset(gguf_init_from_file(path.c_str(), params));
        reason = one_line(capture.text);
    }
    meta.reset(meta_raw);
    if (!g) {
        throw Error(path + ": " + what + (reason.empty() ? "" : " (" + reason + ")"));
    }
    return g;
}

}  // namespace dflash
