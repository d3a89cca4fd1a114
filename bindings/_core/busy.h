#pragma once
// One call at a time per native object: a second concurrent call raises
// instead of racing (the GIL is released while C++ works).
#include <mutex>

#include "dflash/error.h"

class Busy {
public:
    Busy(std::mutex & mu, const char * what) : lock_(mu, std::try_to_lock) {
        if (!lock_.owns_lock()) {
            throw dflash::Error(std::string(what) +
                                " is already in use by another call (one generation at a time per object)");
        }
    }

private:
    std::unique_lock<std::mutex> lock_;
};
