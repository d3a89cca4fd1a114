#include "dflash/cpu_threads.h"

#include <algorithm>
#include <fstream>
#include <set>
#include <string>
#include <thread>

#if defined(__linux__)
#include <sched.h>
#endif
#if defined(__APPLE__)
#include <sys/sysctl.h>
#endif
#if !defined(_WIN32)
#include <dlfcn.h>
#endif

namespace dflash {

int default_cpu_threads() {
    const int logical = (int)std::max(1u, std::thread::hardware_concurrency());
#if defined(__linux__)
    cpu_set_t mask;
    if (sched_getaffinity(0, sizeof(mask), &mask) != 0) return logical;
    std::set<std::string> cores;  // one sibling list per physical core
    int allowed = 0;
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
        if (!CPU_ISSET(cpu, &mask)) continue;
        ++allowed;
        std::ifstream f("/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/thread_siblings_list");
        std::string siblings;
        cores.insert(std::getline(f, siblings) ? siblings : "cpu" + std::to_string(cpu));
    }
    return std::max(1, std::min(allowed, (int)cores.size()));
#elif defined(__APPLE__)
    int physical = 0;
    size_t size = sizeof(physical);
    if (sysctlbyname("hw.physicalcpu", &physical, &size, nullptr, 0) == 0 && physical > 0) return physical;
    return logical;
#else
    return logical;
#endif
}

bool release_openmp_threads() {
#if defined(_WIN32)
    return false;  // ggml's Windows builds use its own thread pool
#else
    using PauseAll = int (*)(int);
    constexpr int kPauseSoft = 1;  // omp_pause_soft: threads go, settings stay
    static const auto pause_all = (PauseAll)dlsym(RTLD_DEFAULT, "omp_pause_resource_all");
    return pause_all && pause_all(kPauseSoft) == 0;
#endif
}

}  // namespace dflash
