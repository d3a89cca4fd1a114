#pragma once
// Typed, checked access to GGUF metadata. ggml's gguf getters abort on a
// type mismatch, so every accessor checks presence and type first and throws
// dflash::Error naming the file, the key, the expected and the found type.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "gguf.h"

namespace dflash {

class GgufKeys {
public:
    GgufKeys(const gguf_context * ctx, std::string path) : ctx_(ctx), path_(std::move(path)) {}

    bool has(const std::string & key) const { return gguf_find_key(ctx_, key.c_str()) >= 0; }

    std::string get_string(const std::string & key) const;
    std::optional<std::string> find_string(const std::string & key) const;
    // integers: any GGUF integer type whose value fits in [lo, hi]
    int64_t get_int(const std::string & key, int64_t lo, int64_t hi) const;
    std::optional<int64_t> find_int(const std::string & key, int64_t lo, int64_t hi) const;
    // floats: f32 or f64, finite
    std::optional<float> find_float(const std::string & key) const;
    float get_float(const std::string & key) const;
    std::optional<bool> find_bool(const std::string & key) const;
    std::vector<int64_t> get_int_array(const std::string & key, int64_t lo, int64_t hi) const;
    // flags: an array of bools, or of integers 0 / 1 (writers differ, llama.cpp reads both)
    std::vector<bool> get_flag_array(const std::string & key) const;
    // number of elements of an array key of any element type, if present
    std::optional<size_t> find_array_size(const std::string & key) const;

    // "key 'x' in FILE"
    std::string where(const std::string & key) const;
    const std::string & path() const { return path_; }

private:
    int64_t require(const std::string & key) const;
    int64_t read_int(int64_t id, const std::string & key, int64_t lo, int64_t hi) const;

    const gguf_context * ctx_;
    std::string path_;
};

const char * gguf_type_label(gguf_type t);

}  // namespace dflash
