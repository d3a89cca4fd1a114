#include "dflash/openmp_threads.h"

#if defined(_WIN32)
namespace dflash {
bool release_openmp_threads() { return false; }  // ggml's Windows builds use its own thread pool
}  // namespace dflash
#else
#include <dlfcn.h>

namespace dflash {

bool release_openmp_threads() {
    using PauseAll = int (*)(int);
    constexpr int kPauseSoft = 1;  // omp_pause_soft: threads go, settings stay
    static const auto pause_all = (PauseAll) dlsym(RTLD_DEFAULT, "omp_pause_resource_all");
    return pause_all && pause_all(kPauseSoft) == 0;
}

}  // namespace dflash
#endif
