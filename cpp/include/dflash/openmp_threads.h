#pragma once
// libggml-cpu built with OpenMP (llama-cpp-python's Linux wheels and source builds) syncs its threads
// with `omp barrier` at every graph node, and libgomp gives each thread that starts a parallel region
// its own pool of workers, kept after the region. Once a process holds more such workers than it has
// CPUs (one thread decoded earlier, another decodes now: a warm-up on the main thread, then a worker
// thread or an HTTP handler), libgomp stops spinning at barriers and sleeps in the kernel instead: a
// tinycode verify step measured 5-8x slower. Handing the calling thread's pool back at the end of each
// generation keeps a process from ever holding pools it does not use.

namespace dflash {

// Releases the calling thread's OpenMP worker pool (omp_pause_resource_all, looked up at run time, so
// a ggml without OpenMP costs nothing); false when there is no OpenMP runtime or it refused (inside a
// parallel region). The next parallel region on this thread starts a new pool (~0.1 ms).
bool release_openmp_threads();

}  // namespace dflash
