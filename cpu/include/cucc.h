// cpu/include/cucc.h: the device side of the CPU backend, force-included (g++ -include) into every
// translation unit that cpu/cucc compiles. It lets unmodified CUDA sources compile with g++:
//  - kernels are plain functions; a launch (rewritten by cucc into __cucc_launch) runs every block of
//    the grid, blocks spread over OpenMP threads, the threads of a block as fibers (cpu/runtime.cpp);
//  - threadIdx/blockIdx/blockDim/gridDim are thread_local, set by the scheduler on every fiber switch;
//  - barriers, shuffles and votes are rendezvous points where a fiber yields until its block or warp
//    has arrived; they carry the caller's file:line so a deadlock or divergent barrier is reported
//    with the place it happened;
//  - the toolkit's own headers (cuda_runtime.h, cuda_bf16.h, cuda_fp16.h, cublas*.h, nccl.h) are used
//    as they are for types and host declarations; this file adds what they only have for nvcc.
// Not meant to be included by hand: `cpu/cucc file.cu -o prog` does it.
#pragma once
#ifndef __CUCC__
#define __CUCC__ 1
#endif

// Defined before the toolkit headers so that theirs (guarded by !defined) do not apply.
// __shared__ declarations are rewritten by cucc; one that reaches the compiler was missed, and
// must not silently become a per-thread local variable.
#define __shared__ __cucc_error_shared_declaration_not_rewritten_by_cucc
#define __launch_bounds__(...)
#define __noinline__ __attribute__((noinline))

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <assert.h>
#include <algorithm>
#include <tuple>
#include <type_traits>
#include <utility>

// ----------------------------------------------------------------------------------------------
// Built-in variables. uint3/dim3 as in CUDA; the scheduler writes them, kernels only read them.
extern thread_local uint3 threadIdx;
extern thread_local uint3 blockIdx;
extern thread_local dim3 blockDim;
extern thread_local dim3 gridDim;
constexpr int warpSize = 32;

// ----------------------------------------------------------------------------------------------
// Scheduler entry points (cpu/runtime.cpp). Never called by user code directly.
enum cucc_warp_op_kind { CUCC_WARP_SYNC = 0, CUCC_WARP_SHFL = 1, CUCC_WARP_VOTE = 2, CUCC_WARP_REDUCE = 3,
                         CUCC_WARP_MATRIX = 4 };
enum cucc_reduce_kind { CUCC_REDUCE_ADD = 0, CUCC_REDUCE_MIN = 1, CUCC_REDUCE_MAX = 2, CUCC_REDUCE_AND = 3,
                        CUCC_REDUCE_OR = 4, CUCC_REDUCE_XOR = 5 };
// Block barrier; returns the number of live threads whose predicate was non-zero and stores the
// number of live threads in *live_threads.
int __cucc_block_barrier(int predicate, int* live_threads, const char* what, const char* file, int line);
// Warp rendezvous over `mask`. For SHFL, `src_lane` names the lane whose `value` this lane receives;
// for VOTE the result is the ballot of (value != 0) over the mask; for REDUCE the reduction of
// value (as uint32) over the mask with `src_lane` holding the cucc_reduce_kind.
uint64_t __cucc_warp_op(int kind, unsigned mask, uint64_t value, int src_lane, const char* what, const char* file,
                        int line);
// A warp-collective matrix operation (nvcuda::wmma, cpu/include/mma.h): all 32 lanes of a full warp must reach
// it at the same source line. When the last one arrives, complete(lane_args) runs once, while every lane is
// still suspended (so each lane's fragments, which lane_args point to, are intact); complete may be null.
// Unlike the other warp operations it does not order the lanes' memory accesses (the PTX ISA promises no
// memory ordering for wmma; a warp that reads what other lanes wrote needs __syncwarp).
void __cucc_warp_matrix_op(void* lane_arg, void (*complete)(void* const* lane_args), const char* what,
                           const char* file, int line);
// A kernel's misuse of an API that a GPU faults on or leaves undefined (a misaligned wmma pointer): a finding of
// `check` (a cucc_check.h name) in a --check build, otherwise a report with the kernel, block and thread, then abort.
[[noreturn]] void __cucc_kernel_fault(const char* check, const char* message, const char* file, int line);
unsigned __cucc_live_lanes(void);
unsigned __cucc_lane_id(void);
void* __cucc_dynamic_shared(void);
void* __cucc_static_shared(void** per_thread_slot, size_t bytes, size_t align);
[[noreturn]] void __cucc_trap(const char* file, int line);

// ----------------------------------------------------------------------------------------------
// Synchronisation
inline void __syncthreads(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    int live;
    __cucc_block_barrier(0, &live, "__syncthreads", file, line);
}
inline int __syncthreads_count(int pred, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    int live;
    return __cucc_block_barrier(pred != 0, &live, "__syncthreads_count", file, line);
}
inline int __syncthreads_and(int pred, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    int live;
    int count = __cucc_block_barrier(pred != 0, &live, "__syncthreads_and", file, line);
    return count == live;
}
inline int __syncthreads_or(int pred, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    int live;
    return __cucc_block_barrier(pred != 0, &live, "__syncthreads_or", file, line) > 0;
}
inline void __syncwarp(unsigned mask = 0xffffffffu, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    __cucc_warp_op(CUCC_WARP_SYNC, mask, 0, 0, "__syncwarp", file, line);
}
inline void __threadfence(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_system(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline unsigned __activemask(void) { return __cucc_live_lanes(); }
inline void __nanosleep(unsigned) {}
long long clock64(void);  // a monotonic nanosecond count: the host has no per-SM cycle counter
#define __trap() __cucc_trap(__FILE__, __LINE__)

// ----------------------------------------------------------------------------------------------
// Warp shuffles and votes. Values of up to 8 bytes travel as their bit pattern.
template <typename T>
inline uint64_t __cucc_bits(const T& v) {
    static_assert(sizeof(T) <= 8, "shuffle of a type wider than 8 bytes (CUDA allows up to 8)");
    uint64_t b = 0;
    memcpy(&b, &v, sizeof(T));
    return b;
}
template <typename T>
inline T __cucc_from_bits(uint64_t b) {
    T v;
    memcpy(&v, &b, sizeof(T));
    return v;
}
template <typename T>
inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize, const char* file = __builtin_FILE(),
                     int line = __builtin_LINE()) {
    int lane = (int)__cucc_lane_id();
    int src = (lane & ~(width - 1)) + (src_lane & (width - 1));
    return __cucc_from_bits<T>(__cucc_warp_op(CUCC_WARP_SHFL, mask, __cucc_bits(var), src, "__shfl_sync", file, line));
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize,
                        const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    int lane = (int)__cucc_lane_id();
    int src = ((lane & (width - 1)) >= (int)delta) ? lane - (int)delta : lane;
    return __cucc_from_bits<T>(__cucc_warp_op(CUCC_WARP_SHFL, mask, __cucc_bits(var), src, "__shfl_up_sync", file, line));
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize,
                          const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    int lane = (int)__cucc_lane_id();
    int src = ((lane & (width - 1)) + (int)delta < width) ? lane + (int)delta : lane;
    return __cucc_from_bits<T>(__cucc_warp_op(CUCC_WARP_SHFL, mask, __cucc_bits(var), src, "__shfl_down_sync", file, line));
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize,
                         const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    int lane = (int)__cucc_lane_id();
    int src = lane ^ lane_mask;
    // a source beyond the caller's width-segment keeps the caller's own value (PTX shfl.bfly)
    if ((src & ~(width - 1)) != (lane & ~(width - 1))) src = lane;
    return __cucc_from_bits<T>(__cucc_warp_op(CUCC_WARP_SHFL, mask, __cucc_bits(var), src, "__shfl_xor_sync", file, line));
}
inline unsigned __ballot_sync(unsigned mask, int pred, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return (unsigned)__cucc_warp_op(CUCC_WARP_VOTE, mask, pred != 0, 0, "__ballot_sync", file, line);
}
inline int __any_sync(unsigned mask, int pred, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return __cucc_warp_op(CUCC_WARP_VOTE, mask, pred != 0, 0, "__any_sync", file, line) != 0;
}
inline int __all_sync(unsigned mask, int pred, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    unsigned ballot = (unsigned)__cucc_warp_op(CUCC_WARP_VOTE, mask, pred != 0, 0, "__all_sync", file, line);
    return (ballot & mask & __cucc_live_lanes()) == (mask & __cucc_live_lanes());
}
inline unsigned __reduce_add_sync(unsigned mask, unsigned v, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return (unsigned)__cucc_warp_op(CUCC_WARP_REDUCE, mask, v, CUCC_REDUCE_ADD, "__reduce_add_sync", file, line);
}
inline unsigned __reduce_min_sync(unsigned mask, unsigned v, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return (unsigned)__cucc_warp_op(CUCC_WARP_REDUCE, mask, v, CUCC_REDUCE_MIN, "__reduce_min_sync", file, line);
}
inline unsigned __reduce_max_sync(unsigned mask, unsigned v, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return (unsigned)__cucc_warp_op(CUCC_WARP_REDUCE, mask, v, CUCC_REDUCE_MAX, "__reduce_max_sync", file, line);
}
inline unsigned __reduce_and_sync(unsigned mask, unsigned v, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return (unsigned)__cucc_warp_op(CUCC_WARP_REDUCE, mask, v, CUCC_REDUCE_AND, "__reduce_and_sync", file, line);
}
inline unsigned __reduce_or_sync(unsigned mask, unsigned v, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return (unsigned)__cucc_warp_op(CUCC_WARP_REDUCE, mask, v, CUCC_REDUCE_OR, "__reduce_or_sync", file, line);
}
inline unsigned __reduce_xor_sync(unsigned mask, unsigned v, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    return (unsigned)__cucc_warp_op(CUCC_WARP_REDUCE, mask, v, CUCC_REDUCE_XOR, "__reduce_xor_sync", file, line);
}

// ----------------------------------------------------------------------------------------------
// Atomics. Fibers of one block share an OS thread and switch only at barriers, so only blocks on
// other OpenMP threads race: the GCC __atomic builtins are exactly what is needed.
template <typename T, typename F>
inline T __cucc_atomic_update(T* address, F update) {
    static_assert(sizeof(T) == 2 || sizeof(T) == 4 || sizeof(T) == 8, "atomic on an unsupported width");
    using U = typename std::conditional<sizeof(T) == 2, uint16_t,
              typename std::conditional<sizeof(T) == 4, uint32_t, uint64_t>::type>::type;
    U* p = reinterpret_cast<U*>(address);
    U old_bits = __atomic_load_n(p, __ATOMIC_RELAXED);
    for (;;) {
        T old_value;
        memcpy(&old_value, &old_bits, sizeof(T));
        T new_value = update(old_value);
        U new_bits;
        memcpy(&new_bits, &new_value, sizeof(T));
        if (__atomic_compare_exchange_n(p, &old_bits, new_bits, false, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED))
            return old_value;
    }
}
inline int atomicAdd(int* a, int v) { return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicAdd(unsigned* a, unsigned v) { return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST); }
inline unsigned long long atomicAdd(unsigned long long* a, unsigned long long v) { return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST); }
inline float atomicAdd(float* a, float v) { return __cucc_atomic_update(a, [v](float o) { return o + v; }); }
inline double atomicAdd(double* a, double v) { return __cucc_atomic_update(a, [v](double o) { return o + v; }); }
inline __nv_bfloat16 atomicAdd(__nv_bfloat16* a, __nv_bfloat16 v) {
    return __cucc_atomic_update(a, [v](__nv_bfloat16 o) { return __float2bfloat16(__bfloat162float(o) + __bfloat162float(v)); });
}
inline __half atomicAdd(__half* a, __half v) {
    return __cucc_atomic_update(a, [v](__half o) { return __float2half(__half2float(o) + __half2float(v)); });
}
inline __nv_bfloat162 atomicAdd(__nv_bfloat162* a, __nv_bfloat162 v) {
    return __cucc_atomic_update(a, [v](__nv_bfloat162 o) {
        __nv_bfloat162 r;
        r.x = __float2bfloat16(__bfloat162float(o.x) + __bfloat162float(v.x));
        r.y = __float2bfloat16(__bfloat162float(o.y) + __bfloat162float(v.y));
        return r;
    });
}
inline __half2 atomicAdd(__half2* a, __half2 v) {
    return __cucc_atomic_update(a, [v](__half2 o) {
        __half2 r;
        r.x = __float2half(__half2float(o.x) + __half2float(v.x));
        r.y = __float2half(__half2float(o.y) + __half2float(v.y));
        return r;
    });
}
inline int atomicSub(int* a, int v) { return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicSub(unsigned* a, unsigned v) { return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST); }
template <typename T>
inline T __cucc_atomic_max(T* a, T v) { return __cucc_atomic_update(a, [v](T o) { return o < v ? v : o; }); }
template <typename T>
inline T __cucc_atomic_min(T* a, T v) { return __cucc_atomic_update(a, [v](T o) { return v < o ? v : o; }); }
inline int atomicMax(int* a, int v) { return __cucc_atomic_max(a, v); }
inline unsigned atomicMax(unsigned* a, unsigned v) { return __cucc_atomic_max(a, v); }
inline long long atomicMax(long long* a, long long v) { return __cucc_atomic_max(a, v); }
inline unsigned long long atomicMax(unsigned long long* a, unsigned long long v) { return __cucc_atomic_max(a, v); }
inline int atomicMin(int* a, int v) { return __cucc_atomic_min(a, v); }
inline unsigned atomicMin(unsigned* a, unsigned v) { return __cucc_atomic_min(a, v); }
inline long long atomicMin(long long* a, long long v) { return __cucc_atomic_min(a, v); }
inline unsigned long long atomicMin(unsigned long long* a, unsigned long long v) { return __cucc_atomic_min(a, v); }
template <typename T>
inline T __cucc_atomic_cas(T* a, T compare, T v) {
    __atomic_compare_exchange_n(a, &compare, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return compare;  // holds the old value whether or not the exchange happened
}
inline int atomicCAS(int* a, int c, int v) { return __cucc_atomic_cas(a, c, v); }
inline unsigned atomicCAS(unsigned* a, unsigned c, unsigned v) { return __cucc_atomic_cas(a, c, v); }
inline unsigned long long atomicCAS(unsigned long long* a, unsigned long long c, unsigned long long v) { return __cucc_atomic_cas(a, c, v); }
inline unsigned short atomicCAS(unsigned short* a, unsigned short c, unsigned short v) { return __cucc_atomic_cas(a, c, v); }
inline int atomicExch(int* a, int v) { return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicExch(unsigned* a, unsigned v) { return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST); }
inline unsigned long long atomicExch(unsigned long long* a, unsigned long long v) { return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST); }
inline float atomicExch(float* a, float v) { return __cucc_atomic_update(a, [v](float) { return v; }); }
inline int atomicAnd(int* a, int v) { return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicAnd(unsigned* a, unsigned v) { return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST); }
inline int atomicOr(int* a, int v) { return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicOr(unsigned* a, unsigned v) { return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST); }
inline int atomicXor(int* a, int v) { return __atomic_fetch_xor(a, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicXor(unsigned* a, unsigned v) { return __atomic_fetch_xor(a, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicInc(unsigned* a, unsigned v) { return __cucc_atomic_update(a, [v](unsigned o) { return o >= v ? 0u : o + 1; }); }
inline unsigned atomicDec(unsigned* a, unsigned v) { return __cucc_atomic_update(a, [v](unsigned o) { return (o == 0 || o > v) ? v : o - 1; }); }

// ----------------------------------------------------------------------------------------------
// Cache-hinted loads and stores: plain memory accesses on the host.
#ifdef CUCC_CHECK
// The checking mode sees __ldg as what it is, a read through the read-only data cache, and a reinterpret_cast to a
// pointer as the promise that the address is aligned for the new type (a float4 or bf16x2 load through a
// misaligned pointer faults on a GPU; cucc --check rewrites reinterpret_cast into __cucc_reinterpret_cast).
extern "C" void __cucc_check_ldg(const void* p, size_t n, const char* file, int line);
extern "C" void __cucc_check_cast(const void* p, size_t align, const char* file, int line);
template <typename T>
__attribute__((always_inline)) inline T __ldg(const T* p, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    __cucc_check_ldg(p, sizeof(T), file, line);
    return *p;
}
template <typename T, typename U>
__attribute__((always_inline)) inline T __cucc_reinterpret_cast(U&& u, const char* file = __builtin_FILE(),
                                                                int line = __builtin_LINE()) {
    if constexpr (std::is_pointer<T>::value && std::is_pointer<typename std::decay<U>::type>::value) {
        using E = typename std::remove_cv<typename std::remove_pointer<T>::type>::type;
        if constexpr (!std::is_void<E>::value && !std::is_function<E>::value)
            __cucc_check_cast((const void*)u, alignof(E), file, line);
    }
    return reinterpret_cast<T>(u);
}
template <typename E, typename U>
__attribute__((always_inline)) inline U __cucc_aligned_for(U u, const char* file = __builtin_FILE(),
                                                           int line = __builtin_LINE()) {
    if constexpr (std::is_pointer<U>::value) __cucc_check_cast((const void*)u, alignof(E), file, line);
    return u;
}
#else
template <typename T> inline T __ldg(const T* p) { return *p; }
#endif
template <typename T> inline T __ldcg(const T* p) { return *p; }
template <typename T> inline T __ldca(const T* p) { return *p; }
template <typename T> inline T __ldcs(const T* p) { return *p; }
template <typename T> inline T __ldlu(const T* p) { return *p; }
template <typename T> inline T __ldcv(const T* p) { return *p; }
template <typename T> inline void __stcg(T* p, T v) { *p = v; }
template <typename T> inline void __stcs(T* p, T v) { *p = v; }
template <typename T> inline void __stwb(T* p, T v) { *p = v; }
template <typename T> inline void __stwt(T* p, T v) { *p = v; }

// ----------------------------------------------------------------------------------------------
// Integer and float intrinsics. Without nvcc's numerics flags the fast-math ones (__expf, ...) use the accurate
// libm function; with any of them (CUCC_NUMERICS, below) they are emulated to the GPU's documented error.
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
    x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
    x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
    x = ((x >> 4) & 0x0F0F0F0Fu) | ((x & 0x0F0F0F0Fu) << 4);
    return __builtin_bswap32(x);
}
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    uint64_t v = ((uint64_t)y << 32) | x;
    unsigned r = 0;
    for (int i = 0; i < 4; i++) r |= (unsigned)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
    return r;
}
inline int __mul24(int a, int b) { return (int)((a << 8 >> 8) * (b << 8 >> 8)); }
inline unsigned __umul24(unsigned a, unsigned b) { return (a & 0xffffff) * (b & 0xffffff); }
inline int __mulhi(int a, int b) { return (int)(((long long)a * b) >> 32); }
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
inline unsigned __funnelshift_l(unsigned lo, unsigned hi, unsigned s) {
    return (unsigned)((((unsigned long long)hi << 32 | lo) << (s & 31)) >> 32);
}
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned s) {
    return (unsigned)(((unsigned long long)hi << 32 | lo) >> (s & 31));
}
inline int __float_as_int(float x) { int i; memcpy(&i, &x, 4); return i; }
inline float __int_as_float(int i) { float x; memcpy(&x, &i, 4); return x; }
inline unsigned __float_as_uint(float x) { unsigned i; memcpy(&i, &x, 4); return i; }
inline float __uint_as_float(unsigned i) { float x; memcpy(&x, &i, 4); return x; }
inline long long __double_as_longlong(double x) { long long i; memcpy(&i, &x, 8); return i; }
inline double __longlong_as_double(long long i) { double x; memcpy(&x, &i, 8); return x; }
#if !CUCC_NUMERICS
inline float __expf(float x) { return expf(x); }
inline float __exp10f(float x) { return exp10f(x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __log10f(float x) { return log10f(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanf(float x) { return tanf(x); }
inline void __sincosf(float x, float* s, float* c) { *s = sinf(x); *c = cosf(x); }
inline float __tanhf(float x) { return tanhf(x); }
inline float __fdividef(float x, float y) { return x / y; }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
#endif
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __frsqrt_rn(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float rcbrtf(float x) { return 1.0f / cbrtf(x); }
inline float __saturatef(float x) { return x != x ? 0.0f : (x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x)); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }
inline int __float2int_rn(float x) { return (int)nearbyintf(x); }
inline int __float2int_rz(float x) { return (int)x; }
inline int __float2int_rd(float x) { return (int)floorf(x); }
inline int __float2int_ru(float x) { return (int)ceilf(x); }
inline unsigned __float2uint_rn(float x) { return (unsigned)nearbyintf(x); }
inline unsigned __float2uint_rz(float x) { return (unsigned)x; }
inline float __int2float_rn(int x) { return (float)x; }
inline float __uint2float_rn(unsigned x) { return (float)x; }
inline long long __float2ll_rn(float x) { return (long long)nearbyintf(x); }
inline float __ll2float_rn(long long x) { return (float)x; }
inline int __double2int_rn(double x) { return (int)nearbyint(x); }
// CUDA's device-side integer and float min/max overloads.
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
inline long min(long a, long b) { return a < b ? a : b; }
inline long max(long a, long b) { return a > b ? a : b; }
inline unsigned long min(unsigned long a, unsigned long b) { return a < b ? a : b; }
inline unsigned long max(unsigned long a, unsigned long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }

// ----------------------------------------------------------------------------------------------
// bf16 / fp16 helpers the toolkit headers define for the device only. Computed in fp32 and rounded
// once, which is what the GPU's fma and special-function units return for these types.
inline __nv_bfloat16 __hfma(__nv_bfloat16 a, __nv_bfloat16 b, __nv_bfloat16 c) {
    return __float2bfloat16(fmaf(__bfloat162float(a), __bfloat162float(b), __bfloat162float(c)));
}
inline __nv_bfloat162 __hfma2(__nv_bfloat162 a, __nv_bfloat162 b, __nv_bfloat162 c) {
    __nv_bfloat162 r;
    r.x = __hfma(a.x, b.x, c.x);
    r.y = __hfma(a.y, b.y, c.y);
    return r;
}
inline __half __hfma(__half a, __half b, __half c) {
    return __float2half(fmaf(__half2float(a), __half2float(b), __half2float(c)));
}
inline __half2 __hfma2(__half2 a, __half2 b, __half2 c) {
    __half2 r;
    r.x = __hfma(a.x, b.x, c.x);
    r.y = __hfma(a.y, b.y, c.y);
    return r;
}
inline __nv_bfloat16 hexp(__nv_bfloat16 a) { return __float2bfloat16(expf(__bfloat162float(a))); }
inline __nv_bfloat16 hexp2(__nv_bfloat16 a) { return __float2bfloat16(exp2f(__bfloat162float(a))); }
inline __nv_bfloat16 hlog(__nv_bfloat16 a) { return __float2bfloat16(logf(__bfloat162float(a))); }
inline __nv_bfloat16 hlog2(__nv_bfloat16 a) { return __float2bfloat16(log2f(__bfloat162float(a))); }
inline __nv_bfloat16 hsqrt(__nv_bfloat16 a) { return __float2bfloat16(sqrtf(__bfloat162float(a))); }
inline __nv_bfloat16 hrsqrt(__nv_bfloat16 a) { return __float2bfloat16(1.0f / sqrtf(__bfloat162float(a))); }
inline __nv_bfloat16 hrcp(__nv_bfloat16 a) { return __float2bfloat16(1.0f / __bfloat162float(a)); }
inline __nv_bfloat16 htanh(__nv_bfloat16 a) { return __float2bfloat16(tanhf(__bfloat162float(a))); }
inline __nv_bfloat16 hsin(__nv_bfloat16 a) { return __float2bfloat16(sinf(__bfloat162float(a))); }
inline __nv_bfloat16 hcos(__nv_bfloat16 a) { return __float2bfloat16(cosf(__bfloat162float(a))); }
inline __half hexp(__half a) { return __float2half(expf(__half2float(a))); }
inline __half hexp2(__half a) { return __float2half(exp2f(__half2float(a))); }
inline __half hlog(__half a) { return __float2half(logf(__half2float(a))); }
inline __half hlog2(__half a) { return __float2half(log2f(__half2float(a))); }
inline __half hsqrt(__half a) { return __float2half(sqrtf(__half2float(a))); }
inline __half hrsqrt(__half a) { return __float2half(1.0f / sqrtf(__half2float(a))); }
inline __half hrcp(__half a) { return __float2half(1.0f / __half2float(a)); }
inline __half htanh(__half a) { return __float2half(tanhf(__half2float(a))); }
inline __half hsin(__half a) { return __float2half(sinf(__half2float(a))); }
inline __half hcos(__half a) { return __float2half(cosf(__half2float(a))); }
inline __nv_bfloat162 h2exp(__nv_bfloat162 a) { __nv_bfloat162 r; r.x = hexp(a.x); r.y = hexp(a.y); return r; }
inline __nv_bfloat162 h2sqrt(__nv_bfloat162 a) { __nv_bfloat162 r; r.x = hsqrt(a.x); r.y = hsqrt(a.y); return r; }
inline __nv_bfloat162 h2rsqrt(__nv_bfloat162 a) { __nv_bfloat162 r; r.x = hrsqrt(a.x); r.y = hrsqrt(a.y); return r; }
inline __nv_bfloat162 h2log(__nv_bfloat162 a) { __nv_bfloat162 r; r.x = hlog(a.x); r.y = hlog(a.y); return r; }
inline __half2 h2exp(__half2 a) { __half2 r; r.x = hexp(a.x); r.y = hexp(a.y); return r; }
inline __half2 h2sqrt(__half2 a) { __half2 r; r.x = hsqrt(a.x); r.y = hsqrt(a.y); return r; }
inline __half2 h2rsqrt(__half2 a) { __half2 r; r.x = hrsqrt(a.x); r.y = hrsqrt(a.y); return r; }
inline __half2 h2log(__half2 a) { __half2 r; r.x = hlog(a.x); r.y = hlog(a.y); return r; }
inline int __bfloat162int_rn(__nv_bfloat16 a) { return (int)nearbyintf(__bfloat162float(a)); }
inline int __half2int_rn(__half a) { return (int)nearbyintf(__half2float(a)); }

// ----------------------------------------------------------------------------------------------
// Kernel launch. cucc rewrites `k<<<grid, block, smem, stream>>>(args)` into
//   __cucc_launch(__cucc_cfg(grid, block, smem, stream), "k", [&](auto... a) { k(a...); })(args)
// so that overloads, default arguments and template arguments deduced from the call resolve as
// they would for nvcc. The arguments are copied once per launch (CUDA passes them by value) and
// each thread's call copies them again into its own parameters.
struct __cucc_launch_config {
    dim3 grid;
    dim3 block;
    size_t shared_bytes;
    cudaStream_t stream;
};
inline __cucc_launch_config __cucc_cfg(dim3 grid, dim3 block, size_t shared_bytes = 0, cudaStream_t stream = 0) {
    return __cucc_launch_config{grid, block, shared_bytes, stream};
}
// Validates the configuration (setting cudaGetLastError as a GPU would) and, if it is valid, runs
// body(closure) once per thread of every block. Defined in cpu/runtime.cpp.
void __cucc_run_grid(const __cucc_launch_config& cfg, const char* kernel_name, void (*body)(void*), void* closure);
// The same with the SSE unit's FTZ and DAZ bits set while blocks run: the launcher calls it in -ftz=true builds.
void __cucc_run_grid_ftz(const __cucc_launch_config& cfg, const char* kernel_name, void (*body)(void*), void* closure);
// cudaFuncSetAttribute, rewritten by cucc to also pass the kernel's name as written, since a
// launch site knows its kernel by name, not by address.
cudaError_t __cucc_func_set_attribute(const char* kernel_name, const void* func, cudaFuncAttribute attr, int value);
template <typename T>
inline cudaError_t __cucc_func_set_attribute(const char* kernel_name, T* func, cudaFuncAttribute attr, int value) {
    return __cucc_func_set_attribute(kernel_name, (const void*)func, attr, value);
}

template <typename F>
struct __cucc_launcher {
    __cucc_launch_config cfg;
    const char* name;
    F body;
    template <typename... A>
    void operator()(A&&... args) {
        struct closure_t {
            F* body;
            std::tuple<typename std::decay<A>::type...> args;
            static void run(void* p) {
                closure_t* c = static_cast<closure_t*>(p);
                std::apply(*c->body, c->args);
            }
        } closure{&body, std::tuple<typename std::decay<A>::type...>(std::forward<A>(args)...)};
#if CUCC_FTZ
        __cucc_run_grid_ftz(cfg, name, &closure_t::run, &closure);
#else
        __cucc_run_grid(cfg, name, &closure_t::run, &closure);
#endif
    }
};
template <typename F>
inline __cucc_launcher<F> __cucc_launch(const __cucc_launch_config& cfg, const char* name, F body) {
    return __cucc_launcher<F>{cfg, name, body};
}

// ----------------------------------------------------------------------------------------------
// The C++ overloads that cuda_runtime.h declares only for nvcc: a symbol is passed by reference and
// its address is the device address (device globals are ordinary globals here).
template <typename T>
inline cudaError_t cudaMemcpyToSymbol(const T& symbol, const void* src, size_t count = sizeof(T), size_t offset = 0,
                                      cudaMemcpyKind kind = cudaMemcpyHostToDevice) {
    return ::cudaMemcpyToSymbol((const void*)&symbol, src, count, offset, kind);
}
template <typename T>
inline cudaError_t cudaMemcpyFromSymbol(void* dst, const T& symbol, size_t count = sizeof(T), size_t offset = 0,
                                        cudaMemcpyKind kind = cudaMemcpyDeviceToHost) {
    return ::cudaMemcpyFromSymbol(dst, (const void*)&symbol, count, offset, kind);
}
template <typename T>
inline cudaError_t cudaMemcpyToSymbolAsync(const T& symbol, const void* src, size_t count = sizeof(T),
                                           size_t offset = 0, cudaMemcpyKind kind = cudaMemcpyHostToDevice,
                                           cudaStream_t stream = 0) {
    (void)stream;  // work completes when issued
    return ::cudaMemcpyToSymbol((const void*)&symbol, src, count, offset, kind);
}
template <typename T>
inline cudaError_t cudaMemcpyFromSymbolAsync(void* dst, const T& symbol, size_t count = sizeof(T),
                                             size_t offset = 0, cudaMemcpyKind kind = cudaMemcpyDeviceToHost,
                                             cudaStream_t stream = 0) {
    (void)stream;
    return ::cudaMemcpyFromSymbol(dst, (const void*)&symbol, count, offset, kind);
}
template <typename T>
inline cudaError_t cudaGetSymbolAddress(void** devPtr, const T& symbol) {
    if (!devPtr) return cudaErrorInvalidValue;
    *devPtr = (void*)&symbol;
    return cudaSuccess;
}
template <typename T>
inline cudaError_t cudaGetSymbolSize(size_t* size, const T&) {
    if (!size) return cudaErrorInvalidValue;
    *size = sizeof(T);
    return cudaSuccess;
}
template <typename T>
inline cudaError_t cudaFuncSetCacheConfig(T* func, cudaFuncCache config) {
    return ::cudaFuncSetCacheConfig((const void*)func, config);
}
template <typename T>
inline cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attr, T* entry) {
    return ::cudaFuncGetAttributes(attr, (const void*)entry);
}

// ----------------------------------------------------------------------------------------------
// GPU numerics (doc/backend.md, "Fast math"). cpu/cucc defines these from nvcc's flags:
//   CUCC_NUMERICS=1    any of --use_fast_math, -ftz, -prec-div, -prec-sqrt, -fmad was given: the intrinsics that
//                      are approximate on every GPU build (__expf, __sinf, __fdividef, rsqrtf, ...) are emulated
//   CUCC_FAST_MATH=1   --use_fast_math: the standard single-precision functions (expf, logf, sinf, tanhf, powf, ...)
//                      become those intrinsics, as nvcc's fast math makes them
//   CUCC_FTZ=1         -ftz=true (implied by --use_fast_math): kernels run with the SSE unit's FTZ and DAZ bits set
//                      (cpu/runtime.cpp), so subnormal inputs and results of every fp32 operation are flushed
//   CUCC_PREC_SQRT=0   -prec-sqrt=false (implied): sqrtf is sqrt.approx.f32
//   CUCC_PREC_DIV=0    -prec-div=false (implied): recorded only; the `/` operator cannot be intercepted
//   CUCC_FMAD=0|1      -fmad: recorded only (no contraction into fma is emulated)
// Emulation applies only while a kernel runs (__cucc_device_code, set by the runtime on the threads that run
// blocks); host code of the same translation unit keeps the exact libm results. Each emulated function computes
// the exact value in double and degrades it in a fixed way to the maximum error the PTX ISA documents for the
// instruction nvcc emits (PTX ISA 9.1, section 9.7.3, "Floating Point Instructions"), so results are
// deterministic and at least as coarse as the GPU's.
extern thread_local int __cucc_device_code;  // non-zero while this OS thread runs a kernel's blocks
#if CUCC_NUMERICS
// v rounded to nearest (ties to even) with `bits` significant bits: relative error at most 2^-bits, and
// exactly half of a `bits`-bit ulp at worst.
inline double __cucc_round_bits(double v, int bits) {
    if (v == 0.0 || !__builtin_isfinite(v)) return v;
    int e;
    frexp(v, &e);  // |v| = m * 2^e, m in [0.5, 1)
    double scale = ldexp(1.0, bits - e);
    return nearbyint(v * scale) / scale;
}
// v rounded to the nearest multiple of 2^-q: absolute error at most 2^-(q+1).
inline double __cucc_round_abs(double v, int q) {
    if (!__builtin_isfinite(v)) return v;
    double r = ldexp(nearbyint(ldexp(v, q)), -q);
    return r == 0.0 ? copysign(0.0, v) : r;
}
// ex2.approx.f32: "The maximum ulp error is 2 ulp from correctly rounded result across the full range of inputs."
// The correctly rounded result rounded again to 22 bits is off it by at most 2 ulp (exactly 2 at a tie).
inline float __cucc_ex2_approx(float x) {
    float r = (float)exp2((double)x);
    return (float)__cucc_round_bits((double)r, 22);
}
// lg2.approx.f32: "The maximum absolute error is 2^-22 when the input operand is in the range (0.5, 2). For
// positive finite inputs outside of this interval, maximum relative error is 2^-22."
inline float __cucc_lg2_approx(float x) {
    double l = log2((double)x);
    if (x > 0.5f && x < 2.0f) return (float)__cucc_round_abs(l, 21);
    return (float)__cucc_round_bits(l, 22);
}
// sin.approx.f32 / cos.approx.f32: maximum absolute error 2^-20.5 in [-2pi, 2pi] and 2^-14.7 in [-100pi, 100pi]
// ("only best effort" outside). Inside [-2pi, 2pi]: the exact value on a 2^-20 grid (error <= 2^-21). Outside:
// the argument is first reduced as x * (1/2pi) rounded to fp32, an error of |x| 2^-24 that grows with |x| as
// the GPU's does (at 100pi, 2^-15.1 plus the grid's 2^-21).
inline double __cucc_trig_arg(float x) {
    const double two_pi = 6.283185307179586476925;
    if (fabsf(x) <= 6.2831853f) return (double)x;
    float turns = x * (float)(1.0 / two_pi);
    return (double)turns * two_pi;
}
inline float __cucc_sin_approx(float x) { return (float)__cucc_round_abs(sin(__cucc_trig_arg(x)), 20); }
inline float __cucc_cos_approx(float x) { return (float)__cucc_round_abs(cos(__cucc_trig_arg(x)), 20); }
// tanh.approx.f32: "The maximum relative error over the entire floating point range is 2^-11": 11 bits.
inline float __cucc_tanh_approx(float x) { return (float)__cucc_round_bits(tanh((double)x), 11); }
// sqrt.approx.f32: "maximum relative error over the entire positive finite floating-point range is 2^-23".
inline float __cucc_sqrt_approx(float x) { return (float)__cucc_round_bits(sqrt((double)x), 23); }
// rsqrt.approx.f32: "maximum relative error ... over the entire positive finite floating-point range is 2^-22.9":
// 23 bits (2^-23).
inline float __cucc_rsqrt_approx(float x) { return (float)__cucc_round_bits(1.0 / sqrt((double)x), 23); }
// div.approx.f32 (__fdividef): "computed as d = a * (1/b). For |b| in [2^-126, 2^126], the maximum ulp error is
// 2. For 2^126 < |b| < 2^128, if a is infinity, div.approx.f32 returns NaN, otherwise it returns a
// sign-preserving zero." 2 ulp: the exact quotient rounded to 22 bits.
inline float __cucc_div_approx(float a, float b) {
    float ab = fabsf(b);
    if (ab > 0x1p126f && ab < __builtin_inff()) {
        if (__builtin_isinf(a)) return __builtin_nanf("");
        return copysignf(0.0f, a) * copysignf(1.0f, b);
    }
    double q = (double)a / (double)b;
    float r = (float)q;  // overflow and underflow as fp32
    if (!__builtin_isfinite(r) || r == 0.0f) return r;
    return (float)__cucc_round_bits(q, 22);
}
// The intrinsics as CUDA's math headers define them from those instructions: __expf(x) = ex2(x * log2(e)),
// __exp10f(x) = ex2(x * log2(10)), __logf(x) = lg2(x) * ln(2), __log10f(x) = lg2(x) * log10(2),
// __powf(x, y) = ex2(y * lg2(x)), __tanf = __sinf / __cosf; the multiplications in fp32, as on the GPU.
#define __CUCC_DEV(approx, exact) (__cucc_device_code ? (approx) : (exact))
inline float __expf(float x) { return __CUCC_DEV(__cucc_ex2_approx(x * 1.4426950408889634f), (expf)(x)); }
inline float __exp10f(float x) { return __CUCC_DEV(__cucc_ex2_approx(x * 3.3219280948873622f), (exp10f)(x)); }
inline float __logf(float x) { return __CUCC_DEV(__cucc_lg2_approx(x) * 0.6931471805599453f, (logf)(x)); }
inline float __log2f(float x) { return __CUCC_DEV(__cucc_lg2_approx(x), (log2f)(x)); }
inline float __log10f(float x) { return __CUCC_DEV(__cucc_lg2_approx(x) * 0.3010299956639812f, (log10f)(x)); }
inline float __powf(float x, float y) { return __CUCC_DEV(__cucc_ex2_approx(y * __cucc_lg2_approx(x)), (powf)(x, y)); }
inline float __sinf(float x) { return __CUCC_DEV(__cucc_sin_approx(x), (sinf)(x)); }
inline float __cosf(float x) { return __CUCC_DEV(__cucc_cos_approx(x), (cosf)(x)); }
inline float __tanf(float x) { return __CUCC_DEV(__cucc_div_approx(__cucc_sin_approx(x), __cucc_cos_approx(x)), (tanf)(x)); }
inline void __sincosf(float x, float* s, float* c) {
    *s = __sinf(x);
    *c = __cosf(x);
}
inline float __tanhf(float x) { return __CUCC_DEV(__cucc_tanh_approx(x), (tanhf)(x)); }
inline float __fdividef(float x, float y) { return __CUCC_DEV(__cucc_div_approx(x, y), x / y); }
inline float rsqrtf(float x) { return __CUCC_DEV(__cucc_rsqrt_approx(x), 1.0f / (sqrtf)(x)); }
// exp2f and log2f are ex2.approx.ftz / lg2.approx.ftz under -ftz=true, and so are they here under fast math
inline float __cucc_fm_exp2f(float x) { return __CUCC_DEV(__cucc_ex2_approx(x), (exp2f)(x)); }
inline float __cucc_fm_sqrtf(float x) { return __CUCC_DEV(__cucc_sqrt_approx(x), (sqrtf)(x)); }

#if CUCC_FAST_MATH
// nvcc --use_fast_math compiles each of these standard functions to its intrinsic (CUDA C++ Programming Guide,
// "Intrinsic Functions"); exp2f and log2f are the .approx.ftz instructions themselves. Function-like macros
// reach calls written as expf(x), ::expf(x) and std::expf(x) (the std:: names are declared below); the
// overloads std::exp(float) and exp(float) are not intercepted.
inline float __cucc_fm_expf(float x) { return __expf(x); }
inline float __cucc_fm_exp10f(float x) { return __exp10f(x); }
inline float __cucc_fm_logf(float x) { return __logf(x); }
inline float __cucc_fm_log2f(float x) { return __log2f(x); }
inline float __cucc_fm_log10f(float x) { return __log10f(x); }
inline float __cucc_fm_powf(float x, float y) { return __powf(x, y); }
inline float __cucc_fm_sinf(float x) { return __sinf(x); }
inline float __cucc_fm_cosf(float x) { return __cosf(x); }
inline float __cucc_fm_tanf(float x) { return __tanf(x); }
inline void __cucc_fm_sincosf(float x, float* s, float* c) { __sincosf(x, s, c); }
inline float __cucc_fm_tanhf(float x) { return __tanhf(x); }
namespace std {
using ::__cucc_fm_expf; using ::__cucc_fm_exp2f; using ::__cucc_fm_exp10f; using ::__cucc_fm_logf;
using ::__cucc_fm_log2f; using ::__cucc_fm_log10f; using ::__cucc_fm_powf; using ::__cucc_fm_sinf;
using ::__cucc_fm_cosf; using ::__cucc_fm_tanf; using ::__cucc_fm_sincosf; using ::__cucc_fm_tanhf;
using ::__cucc_fm_sqrtf;
}  // namespace std
#define expf(x) __cucc_fm_expf(x)
#define exp2f(x) __cucc_fm_exp2f(x)
#define exp10f(x) __cucc_fm_exp10f(x)
#define logf(x) __cucc_fm_logf(x)
#define log2f(x) __cucc_fm_log2f(x)
#define log10f(x) __cucc_fm_log10f(x)
#define powf(x, y) __cucc_fm_powf(x, y)
#define sinf(x) __cucc_fm_sinf(x)
#define cosf(x) __cucc_fm_cosf(x)
#define tanf(x) __cucc_fm_tanf(x)
#define sincosf(x, s, c) __cucc_fm_sincosf(x, s, c)
#define tanhf(x) __cucc_fm_tanhf(x)
#endif
#if defined(CUCC_PREC_SQRT) && !CUCC_PREC_SQRT
namespace std {
using ::__cucc_fm_sqrtf;
}
#define sqrtf(x) __cucc_fm_sqrtf(x)
#endif
#endif  // CUCC_NUMERICS
