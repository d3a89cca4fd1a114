#pragma once
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "dflash/error.h"
#include "ggml-backend.h"
#include "ggml-cpp.h"

namespace dflash {

// Tensors placed back to back in one buffer of the device, with a host mirror, so that all of them move
// in one transfer (on a GPU every transfer is a synchronisation). Inputs are written straight into the
// mirror (host<T>), then upload(); outputs are read after download() with get(), which goes tensor by
// tensor when nothing was placed (a device that cannot compute every output).
class Packed {
public:
    // places ts, tensors of ctx, once per object (a rebuilt graph gets a fresh Packed)
    void place(ggml_context * ctx, ggml_backend_buffer_type_t buft, const std::vector<ggml_tensor *> & ts) {
        const size_t align = ggml_backend_buft_get_alignment(buft);
        size_t size = 0;
        for (ggml_tensor * t : ts) {
            size = (size + align - 1) / align * align;
            offsets_.push_back(size);
            size += ggml_backend_buft_get_alloc_size(buft, t);
        }
        buf_.reset(ggml_backend_buft_alloc_buffer(buft, size));
        if (!buf_)
            throw Error("cannot allocate " + std::to_string(size) + " bytes for the draft graph's inputs/outputs");
        char * base = (char *)ggml_backend_buffer_get_base(buf_.get());
        blob_ = ggml_new_tensor_1d(ctx, GGML_TYPE_I8, (int64_t)size);
        check(ggml_backend_tensor_alloc(buf_.get(), blob_, base));
        for (size_t i = 0; i < ts.size(); ++i) check(ggml_backend_tensor_alloc(buf_.get(), ts[i], base + offsets_[i]));
        tensors_ = ts;
        host_.assign(size, 0);
    }

    // host memory standing for placed tensor t's data until upload()
    template <class T>
    T * host(ggml_tensor * t) {
        return reinterpret_cast<T *>(mirror(t));
    }
    void upload() {
        if (blob_) ggml_backend_tensor_set(blob_, host_.data(), 0, host_.size());
    }
    void download() {
        if (blob_) ggml_backend_tensor_get(blob_, host_.data(), 0, host_.size());
    }
    void get(ggml_tensor * t, void * data, size_t bytes) {
        if (!blob_) return ggml_backend_tensor_get(t, data, 0, bytes);
        std::memcpy(data, mirror(t), bytes);
    }

private:
    static void check(ggml_status st) {
        if (st != GGML_STATUS_SUCCESS) throw Error("cannot place a draft graph tensor in its buffer");
    }
    uint8_t * mirror(ggml_tensor * t) {
        for (size_t i = 0; i < tensors_.size(); ++i) {
            if (tensors_[i] == t) return host_.data() + offsets_[i];
        }
        throw Error(std::string("internal: tensor ") + ggml_get_name(t) + " is not packed");
    }
    std::vector<ggml_tensor *> tensors_;
    std::vector<size_t> offsets_;
    ggml_backend_buffer_ptr buf_;
    ggml_tensor * blob_ = nullptr;
    std::vector<uint8_t> host_;
};

}  // namespace dflash
