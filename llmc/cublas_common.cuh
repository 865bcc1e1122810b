// llmc/cublas_common.cuh: the process-wide cuBLAS and cuBLASLt state every GEMM of switch.cu goes through:
// the two handles, one workspace, the grouped GEMMs' pointer arrays, the compute type and the matching data type
// of floatX. Included by
// llmc/matmul.cuh, llmc/expert_matmul.cuh, llmc/router_matmul.cuh and llmc/attention.cuh; a program calls cublas_setup() once before its first GEMM and
// cublas_teardown() at exit. Builds with nvcc (-lcublas -lcublasLt) or through the CPU backend
// (cpu/cucc ... -lcublas -lcublasLt), which implements the same API over OpenBLAS.
#pragma once
#include <cublasLt.h>
#include <cublas_v2.h>
#include "common.cuh"

// ----------------------------------------------------------------------------------------------------
// Error check: one line naming the call's place and the status, then exit.
inline void cublas_check(cublasStatus_t status, const char* file, int line) {
    if (status != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "[cuBLAS ERROR] at %s:%d: %d (%s)\n", file, line, (int)status, cublasGetStatusString(status));
        exit(EXIT_FAILURE);
    }
}
#define cublasCheck(status) (cublas_check((status), __FILE__, __LINE__))

// floatX as cuBLAS names it
#if defined(ENABLE_FP32)
#define CUBLAS_LOWP CUDA_R_32F
#elif defined(ENABLE_FP16)
#define CUBLAS_LOWP CUDA_R_16F
#else
#define CUBLAS_LOWP CUDA_R_16BF
#endif

// 32 MiB: what cuBLASLt's fastest Hopper kernels ask for; smaller workspaces make the heuristic pick
// slower split-k-free algorithms.
inline constexpr size_t CUBLASLT_WORKSPACE_BYTES = 32ull << 20;

// cublasGemmGroupedBatchedEx (the dropless experts, llmc/expert_matmul.cuh) reads every GEMM's A, B and C addresses from
// device memory. cublas_grouped_pointers holds them for the two grouped GEMMs of one matmul_backward_grouped call (2
// products x 3 arrays of up to CUBLAS_GROUPED_MAX_GROUPS pointers, 12 KiB), copied there with one cudaMemcpyAsync on
// the GEMMs' stream. One device buffer serves every call because each copy and the GEMMs that read it are ordered on
// one stream; grouped GEMMs on two streams at once would each need their own.
// The host writes the arrays into a pinned staging slot first: a copy from pageable memory goes through a driver
// buffer (an extra host copy, and CUDA allows it to be synchronous with respect to the host), while a pinned one is
// a DMA the host does not wait for. A slot may be rewritten only once its copy has read it, which its event tells;
// the ring of CUBLAS_GROUPED_STAGING_SLOTS slots (192 KiB of pinned memory) lets the host queue that many grouped
// calls, eight MoE layers' backward passes, ahead of the GPU before it waits: far more than keeps the GPU busy.
// Everything is allocated here, once, beside the workspace, rather than lazily on the first grouped call: no GEMM
// then allocates (cudaMalloc synchronises the device and cannot be captured in a CUDA graph), and cublas_teardown
// frees it with the rest.
inline constexpr int CUBLAS_GROUPED_MAX_GROUPS = 256;
inline constexpr size_t CUBLAS_GROUPED_POINTERS = 2 * 3 * CUBLAS_GROUPED_MAX_GROUPS;
inline constexpr int CUBLAS_GROUPED_STAGING_SLOTS = 16;

inline cublasHandle_t cublas_handle = nullptr;
inline cublasLtHandle_t cublaslt_handle = nullptr;
inline void* cublaslt_workspace = nullptr;
inline size_t cublaslt_workspace_size = 0;
inline void** cublas_grouped_pointers = nullptr;
inline void** cublas_grouped_staging = nullptr;  // (SLOTS, CUBLAS_GROUPED_POINTERS), pinned host memory
inline cudaEvent_t cublas_grouped_staged[CUBLAS_GROUPED_STAGING_SLOTS];  // recorded after each slot's last copy
inline int cublas_grouped_slot = 0;  // the slot the next grouped call fills

// Always fp32 accumulation. Plain COMPUTE_32F never uses TF32, so FP32 builds stay as exact as the fp32
// references they are tested against; bf16/fp16 inputs still run on the tensor cores with it.
inline cublasComputeType_t cublas_compute = CUBLAS_COMPUTE_32F;

inline void cublas_setup(void) {
    cublasCheck(cublasCreate(&cublas_handle));
    cublasCheck(cublasLtCreate(&cublaslt_handle));
    cublasCheck(cublasSetMathMode(cublas_handle, CUBLAS_DEFAULT_MATH));
    cublaslt_workspace_size = CUBLASLT_WORKSPACE_BYTES;
    cudaCheck(cudaMalloc(&cublaslt_workspace, cublaslt_workspace_size));
    cudaCheck(cudaMalloc(&cublas_grouped_pointers, CUBLAS_GROUPED_POINTERS * sizeof(void*)));
    cudaCheck(cudaMallocHost(&cublas_grouped_staging,
                             CUBLAS_GROUPED_STAGING_SLOTS * CUBLAS_GROUPED_POINTERS * sizeof(void*)));
    for (int i = 0; i < CUBLAS_GROUPED_STAGING_SLOTS; i++)
        cudaCheck(cudaEventCreateWithFlags(&cublas_grouped_staged[i], cudaEventDisableTiming));
    cublas_grouped_slot = 0;
    cublas_compute = CUBLAS_COMPUTE_32F;
}

inline void cublas_teardown(void) {
    cudaCheck(cudaFree(cublaslt_workspace));
    cudaCheck(cudaFree(cublas_grouped_pointers));
    for (int i = 0; i < CUBLAS_GROUPED_STAGING_SLOTS; i++) {
        cudaCheck(cudaEventSynchronize(cublas_grouped_staged[i]));  // no copy may still read the slot when it is freed
        cudaCheck(cudaEventDestroy(cublas_grouped_staged[i]));
    }
    cudaCheck(cudaFreeHost(cublas_grouped_staging));
    cublasCheck(cublasLtDestroy(cublaslt_handle));
    cublasCheck(cublasDestroy(cublas_handle));
    cublaslt_workspace = nullptr;
    cublaslt_workspace_size = 0;
    cublas_grouped_pointers = nullptr;
    cublas_grouped_staging = nullptr;
    cublaslt_handle = nullptr;
    cublas_handle = nullptr;
}
