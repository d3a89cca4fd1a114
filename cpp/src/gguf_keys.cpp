#include "gguf_keys.h"

#include <cmath>

#include "dflash/error.h"

namespace dflash {

const char * gguf_type_label(gguf_type t) {
    switch (t) {
        case GGUF_TYPE_UINT8:
            return "u8";
        case GGUF_TYPE_INT8:
            return "i8";
        case GGUF_TYPE_UINT16:
            return "u16";
        case GGUF_TYPE_INT16:
            return "i16";
        case GGUF_TYPE_UINT32:
            return "u32";
        case GGUF_TYPE_INT32:
            return "i32";
        case GGUF_TYPE_FLOAT32:
            return "f32";
        case GGUF_TYPE_BOOL:
            return "bool";
        case GGUF_TYPE_STRING:
            return "string";
        case GGUF_TYPE_ARRAY:
            return "array";
        case GGUF_TYPE_UINT64:
            return "u64";
        case GGUF_TYPE_INT64:
            return "i64";
        case GGUF_TYPE_FLOAT64:
            return "f64";
        default:
            return "unknown";
    }
}

static bool is_int_type(gguf_type t) {
    switch (t) {
        case GGUF_TYPE_UINT8:
        case GGUF_TYPE_INT8:
        case GGUF_TYPE_UINT16:
        case GGUF_TYPE_INT16:
        case GGUF_TYPE_UINT32:
        case GGUF_TYPE_INT32:
        case GGUF_TYPE_UINT64:
        case GGUF_TYPE_INT64:
            return true;
        default:
            return false;
    }
}

static int64_t int_at(const void * data, gguf_type t, size_t i, bool & overflow) {
    overflow = false;
    switch (t) {
        case GGUF_TYPE_UINT8:
            return ((const uint8_t *)data)[i];
        case GGUF_TYPE_INT8:
            return ((const int8_t *)data)[i];
        case GGUF_TYPE_UINT16:
            return ((const uint16_t *)data)[i];
        case GGUF_TYPE_INT16:
            return ((const int16_t *)data)[i];
        case GGUF_TYPE_UINT32:
            return ((const uint32_t *)data)[i];
        case GGUF_TYPE_INT32:
            return ((const int32_t *)data)[i];
        case GGUF_TYPE_INT64:
            return ((const int64_t *)data)[i];
        case GGUF_TYPE_UINT64: {
            const uint64_t v = ((const uint64_t *)data)[i];
            overflow = v > (uint64_t)INT64_MAX;
            return (int64_t)v;
        }
        default:
            return 0;
    }
}

std::string GgufKeys::where(const std::string & key) const { return path_ + ": key '" + key + "'"; }

int64_t GgufKeys::require(const std::string & key) const {
    const int64_t id = gguf_find_key(ctx_, key.c_str());
    if (id < 0) {
        throw Error(where(key) + " is missing (required)");
    }
    return id;
}

int64_t GgufKeys::read_int(int64_t id, const std::string & key, int64_t lo, int64_t hi) const {
    const gguf_type t = gguf_get_kv_type(ctx_, id);
    if (!is_int_type(t)) {
        throw Error(where(key) + ": expected an integer, found " + gguf_type_label(t));
    }
    bool overflow = false;
    const int64_t v = int_at(gguf_get_val_data(ctx_, id), t, 0, overflow);
    if (overflow || v < lo || v > hi) {
        throw Error(where(key) + ": value " + (overflow ? std::string("> 2^63") : std::to_string(v)) +
                    " is out of range, expected " + std::to_string(lo) + ".." + std::to_string(hi));
    }
    return v;
}

std::string GgufKeys::get_string(const std::string & key) const {
    const int64_t id = require(key);
    const gguf_type t = gguf_get_kv_type(ctx_, id);
    if (t != GGUF_TYPE_STRING) {
        throw Error(where(key) + ": expected a string, found " + gguf_type_label(t));
    }
    return gguf_get_val_str(ctx_, id);
}

std::optional<std::string> GgufKeys::find_string(const std::string & key) const {
    if (!has(key)) return std::nullopt;
    return get_string(key);
}

int64_t GgufKeys::get_int(const std::string & key, int64_t lo, int64_t hi) const {
    return read_int(require(key), key, lo, hi);
}

std::optional<int64_t> GgufKeys::find_int(const std::string & key, int64_t lo, int64_t hi) const {
    const int64_t id = gguf_find_key(ctx_, key.c_str());
    if (id < 0) return std::nullopt;
    return read_int(id, key, lo, hi);
}

std::optional<float> GgufKeys::find_float(const std::string & key) const {
    const int64_t id = gguf_find_key(ctx_, key.c_str());
    if (id < 0) return std::nullopt;
    const gguf_type t = gguf_get_kv_type(ctx_, id);
    double v;
    if (t == GGUF_TYPE_FLOAT32) {
        v = gguf_get_val_f32(ctx_, id);
    } else if (t == GGUF_TYPE_FLOAT64) {
        v = gguf_get_val_f64(ctx_, id);
    } else {
        throw Error(where(key) + ": expected a float (f32), found " + gguf_type_label(t));
    }
    if (!std::isfinite(v)) {
        throw Error(where(key) + ": value is not finite");
    }
    return (float)v;
}

float GgufKeys::get_float(const std::string & key) const {
    require(key);
    return *find_float(key);
}

std::optional<bool> GgufKeys::find_bool(const std::string & key) const {
    const int64_t id = gguf_find_key(ctx_, key.c_str());
    if (id < 0) return std::nullopt;
    const gguf_type t = gguf_get_kv_type(ctx_, id);
    if (t != GGUF_TYPE_BOOL) {
        throw Error(where(key) + ": expected a bool, found " + gguf_type_label(t));
    }
    return gguf_get_val_bool(ctx_, id);
}

std::vector<int64_t> GgufKeys::get_int_array(const std::string & key, int64_t lo, int64_t hi) const {
    const int64_t id = require(key);
    const gguf_type t = gguf_get_kv_type(ctx_, id);
    if (t != GGUF_TYPE_ARRAY) {
        throw Error(where(key) + ": expected an array of integers, found " + gguf_type_label(t));
    }
    const gguf_type et = gguf_get_arr_type(ctx_, id);
    if (!is_int_type(et)) {
        throw Error(where(key) + ": expected an array of integers, found an array of " + gguf_type_label(et));
    }
    const size_t n = gguf_get_arr_n(ctx_, id);
    const void * data = gguf_get_arr_data(ctx_, id);
    std::vector<int64_t> out(n);
    for (size_t i = 0; i < n; ++i) {
        bool overflow = false;
        out[i] = int_at(data, et, i, overflow);
        if (overflow || out[i] < lo || out[i] > hi) {
            throw Error(where(key) + ": element " + std::to_string(i) + " = " + std::to_string(out[i]) +
                        " is out of range, expected " + std::to_string(lo) + ".." + std::to_string(hi));
        }
    }
    return out;
}

std::vector<bool> GgufKeys::get_flag_array(const std::string & key) const {
    const int64_t id = require(key);
    const gguf_type t = gguf_get_kv_type(ctx_, id);
    const gguf_type et = t == GGUF_TYPE_ARRAY ? gguf_get_arr_type(ctx_, id) : t;
    if (t == GGUF_TYPE_ARRAY && et == GGUF_TYPE_BOOL) {
        const auto * data = static_cast<const int8_t *>(gguf_get_arr_data(ctx_, id));
        return std::vector<bool>(data, data + gguf_get_arr_n(ctx_, id));
    }
    if (t != GGUF_TYPE_ARRAY || !is_int_type(et)) {
        throw Error(where(key) + ": expected an array of bools (or of integers 0 / 1), found " +
                    (t == GGUF_TYPE_ARRAY ? "an array of " : "") + gguf_type_label(et));
    }
    const std::vector<int64_t> v = get_int_array(key, 0, 1);
    return std::vector<bool>(v.begin(), v.end());
}

std::optional<size_t> GgufKeys::find_array_size(const std::string & key) const {
    const int64_t id = gguf_find_key(ctx_, key.c_str());
    if (id < 0) return std::nullopt;
    if (gguf_get_kv_type(ctx_, id) != GGUF_TYPE_ARRAY) {
        throw Error(where(key) + ": expected an array, found " + gguf_type_label(gguf_get_kv_type(ctx_, id)));
    }
    return gguf_get_arr_n(ctx_, id);
}

}  // namespace dflash
