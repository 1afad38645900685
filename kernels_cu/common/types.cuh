// Basic types for NVRTC: the kernels include no CUDA toolkit headers (NVRTC ships none of them, and leaving them
// out keeps cold compiles fast), so fixed-width integers are defined here.
#pragma once

namespace deepep {

typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;

// Error record in host-mapped memory, written by the first thread that gives up waiting (see timeout.cuh).
// Layout (int32 words): [0] state (0 = ok, -1 = being written, 1 = timed out), [1] phase, [2] rank, [3] peer,
// [4] expected value, [5] observed value, [6] auxiliary (e.g. slot or block index), [7] reserved.
constexpr int kErrorRecordWords = 8;

// Phase ids reported in error records (mirrored in deepep_cupy/runtime/errors.py).
enum Phase : int {
    kPhaseBarrier = 1,
    kPhaseTestRing = 2,
    kPhaseNotify = 3,
    kPhaseDispatch = 4,
    kPhaseCombine = 5,
    kPhasePeerCopy = 6,
    kPhasePP = 7,
    kPhaseAGRS = 8,
    kPhaseEngram = 9,
    kPhaseLB = 10,
    kPhaseBucket = 11,
};

template <typename T>
__device__ __forceinline__ T ceil_div(T a, T b) { return (a + b - 1) / b; }

}  // namespace deepep
