// Memory-ordering helpers. Every cross-GPU protocol goes through these named functions: a release store publishes
// everything the thread (and, cumulatively, what it observed, including earlier kernels on its stream) wrote before
// it; an acquire load makes everything published before the matching release visible to the reader.
// Scope `sys` is used for peers reached through CUDA IPC (other GPUs or other processes on this GPU).
#pragma once
#include "common/types.cuh"

namespace deepep {

__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* ptr) {
    uint32_t v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
    return v;
}

__device__ __forceinline__ int32_t ld_acquire_sys(const int32_t* ptr) {
    int32_t v;
    asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
    return v;
}

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* ptr) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(ptr) : "memory");
    return v;
}

__device__ __forceinline__ void st_release_sys(uint32_t* ptr, uint32_t v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(ptr), "r"(v) : "memory");
}

// Release / acquire at GPU scope: for flags read by other blocks of the same launch only (ep_fused.cu).
__device__ __forceinline__ void st_release_gpu(uint32_t* ptr, uint32_t v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" :: "l"(ptr), "r"(v) : "memory");
}

__device__ __forceinline__ void st_release_gpu(uint64_t* ptr, uint64_t v) {
    asm volatile("st.release.gpu.global.u64 [%0], %1;" :: "l"(ptr), "l"(v) : "memory");
}

__device__ __forceinline__ uint32_t ld_acquire_gpu(const uint32_t* ptr) {
    uint32_t v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
    return v;
}

__device__ __forceinline__ uint64_t ld_acquire_gpu(const uint64_t* ptr) {
    uint64_t v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(ptr) : "memory");
    return v;
}

__device__ __forceinline__ void st_release_sys(int32_t* ptr, int32_t v) {
    asm volatile("st.release.sys.global.s32 [%0], %1;" :: "l"(ptr), "r"(v) : "memory");
}

__device__ __forceinline__ void st_release_sys(uint64_t* ptr, uint64_t v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" :: "l"(ptr), "l"(v) : "memory");
}

__device__ __forceinline__ void st_relaxed_sys(int32_t* ptr, int32_t v) {
    asm volatile("st.relaxed.sys.global.s32 [%0], %1;" :: "l"(ptr), "r"(v) : "memory");
}

__device__ __forceinline__ int32_t atomic_add_release_sys(int32_t* ptr, int32_t v) {
    int32_t old;
    asm volatile("atom.release.sys.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(ptr), "r"(v) : "memory");
    return old;
}

__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// Nanoseconds of the GPU's global timer (same clock on every SM).
__device__ __forceinline__ uint64_t global_timer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Epoch comparison that survives 32-bit wrap-around: whether `seen` has reached `target`.
__device__ __forceinline__ bool epoch_reached(uint32_t seen, uint32_t target) {
    return static_cast<int32_t>(seen - target) >= 0;
}

}  // namespace deepep
