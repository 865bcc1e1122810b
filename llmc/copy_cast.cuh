// llmc/copy_cast.cuh: element-wise copy with a change of precision (fp32 master weights to floatX, model files
// in one precision loaded into another, ...), rounding to nearest. Included by the trainers; builds with nvcc
// or cpu/cucc, nothing to link.
// Tests (dev/test/run_tests.sh NAME, patterns work): lab-copy_cast_{bf16,fp32} and their lab-check- twins; gpt-* and
// moe-* (the master weights' casts).
#pragma once
#include "common.cuh"

// One thread per run of 16-byte packs: as many elements as the wider of one Td pack and one Ts pack (8 for
// fp32 <-> bf16: two f128 on the fp32 side, one x128 on the other). A last partial run goes element by element.
// Floor: n * (sizeof(Td) + sizeof(Ts)) bytes, no flops.
template <class Td, class Ts>
__global__ void copy_and_cast_kernel(Td* dst, const Ts* src, size_t n) {
    constexpr int dst_pack = Packed128<Td>::size;
    constexpr int src_pack = Packed128<Ts>::size;
    constexpr int run = dst_pack > src_pack ? dst_pack : src_pack;
    const size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * run;
    if (i >= n) return;
    if (i + run <= n) {
        float values[run];
        for (int k = 0; k < run; k += src_pack) {
            Packed128<Ts> packed = load128cs(src + i + k);
            for (int j = 0; j < src_pack; j++) values[k + j] = (float)packed[j];
        }
        for (int k = 0; k < run; k += dst_pack) {
            Packed128<Td> packed;
            for (int j = 0; j < dst_pack; j++) packed[j] = (Td)values[k + j];
            store128(dst + i + k, packed);
        }
    } else {
        for (size_t e = i; e < n; e++) dst[e] = (Td)(float)src[e];
    }
}

template <class Td, class Ts>
void copy_and_cast(Td* dst, const Ts* src, size_t n, cudaStream_t stream) {
    if ((uintptr_t)dst % 16 != 0 || (uintptr_t)src % 16 != 0) {
        fprintf(stderr, "copy_and_cast: dst and src must be 16-byte aligned\n");
        exit(EXIT_FAILURE);
    }
    if (n == 0) return;
    constexpr int run = Packed128<Td>::size > Packed128<Ts>::size ? Packed128<Td>::size : Packed128<Ts>::size;
    const int block_size = 512;
    const size_t runs = CEIL_DIV(n, (size_t)run);
    copy_and_cast_kernel<<<(unsigned int)CEIL_DIV(runs, (size_t)block_size), block_size, 0, stream>>>(dst, src, n);
    cudaCheck(cudaGetLastError());
}
