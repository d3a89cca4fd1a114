#pragma once
// CPU threads for libggml-cpu: how many by default, and what OpenMP keeps after a generation.

namespace dflash {

// The default thread count (n_threads = 0): the physical cores this process may run on. Logical CPUs
// overcount on SMT machines (two threads per core share its FMA units, and every graph node ends in a
// barrier that waits for the slowest), and the CPUs of the machine overcount in a container or under
// taskset, where threads beyond the affinity mask only take turns. Linux reads the affinity mask and the
// cores' sibling lists; macOS asks for its physical cores; elsewhere the logical CPUs.
int default_cpu_threads();

// libggml-cpu built with OpenMP (llama-cpp-python's Linux wheels and source builds) syncs its threads
// with `omp barrier` at every graph node, and libgomp gives each thread that starts a parallel region
// its own pool of workers, kept after the region. Once a process holds more such workers than it has
// CPUs (one thread decoded earlier, another decodes now: a warm-up on the main thread, then a worker
// thread or an HTTP handler), libgomp stops spinning at barriers and sleeps in the kernel instead, and a
// tinycode verify step runs several times slower. Handing the calling thread's pool back at the end of each
// generation keeps a process from ever holding pools it does not use.
//
// Releases the calling thread's OpenMP worker pool (omp_pause_resource_all, looked up at run time, so
// a ggml without OpenMP costs nothing); false when there is no OpenMP runtime or it refused (inside a
// parallel region). The next parallel region on this thread starts a new pool (~0.1 ms).
bool release_openmp_threads();

}  // namespace dflash
