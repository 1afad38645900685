// Test tooling: a kernel that keeps the GPU busy for a given number of clock cycles (launched by
// deepep_cupy/utils/testing.py::sleep_gpu, e.g. to line up ranks before a profiled call).

extern "C" __global__ void sleep_cycles(long long cycles) {
    // Bounded by `cycles`: the only thing this spin waits for is the clock itself
    const long long start = clock64();
    while (clock64() - start < cycles) {
    }
}
