// cpu/include/cucc_check.h: the checking mode's interface between the CPU backend's parts (cpu/check.cpp
// implements it; cpu/runtime.cpp, cpu/cublas.cpp and cpu/nccl.cpp call it). A program built with
// `cpu/cucc --check` links the "check" variant of the backend libraries, compiled with -DCUCC_CHECK; in every
// other variant these functions do not exist and the callers' #ifdef CUCC_CHECK blocks vanish.
//
// A finding prints one line,
//   cucc: <check>: <what>, <where: kernel, file:line, block/thread, stream or rank>
// and the process exits with status 86 (CUCC_CHECK_EXIT). Every check is on in a --check build;
// CUCC_CHECK_OFF=name,name,... turns single checks off (names below).
//
// Operations. Every piece of device work (a launch, memcpy, memset, cuBLAS call, NCCL call) is an operation
// on a stream. Streams are ordered by vector clocks (carried by events, merged by cudaStreamWaitEvent and by
// the legacy default stream's implicit synchronisation); the host has a clock of its own, merged at every
// synchronisation. Device memory accesses remember the operation that made them, so an access that is not
// ordered after a conflicting one of another operation is reported with both operations named.
#pragma once
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#define CUCC_CHECK_EXIT 86

// the checks, by the name reports and CUCC_CHECK_OFF use
#define CUCC_CHECK_RACE "racecheck"      // shared and global memory races inside a launch
#define CUCC_CHECK_SYNC "synccheck"      // barriers skipped or reached a different number of times
#define CUCC_CHECK_INIT "initcheck"      // reads of device or shared memory nothing wrote
#define CUCC_CHECK_MEM "memcheck"        // out of bounds, use after free, misaligned accesses and atomics
#define CUCC_CHECK_HOST "hostcheck"      // host code touching device memory, copies of the wrong kind
#define CUCC_CHECK_STREAM "streamcheck"  // operations on different streams (or the host) not ordered by events
#define CUCC_CHECK_LIMIT "limitcheck"    // shared memory limits of a launch
#define CUCC_CHECK_LDG "ldgcheck"        // __ldg of memory the same kernel writes
#define CUCC_CHECK_HANG "hangcheck"      // a kernel that spins without progress (one block waiting on another)
#define CUCC_CHECK_NCCL "ncclcheck"      // mismatched, unmatched or concurrent NCCL operations
#define CUCC_CHECK_CUBLAS "cublascheck"  // cuBLAS(Lt) operands outside their allocations, unsupported combinations

#ifdef __cplusplus
extern "C" {
#endif

// 1 if the named check is on (always 0 outside a --check build's libraries).
int cucc_check_on(const char* check);
// Prints "cucc: <check>: <message>" (with ", rank N" under MPI) and exits with CUCC_CHECK_EXIT.
__attribute__((noreturn, format(printf, 2, 3))) void cucc_check_report(const char* check, const char* fmt, ...);

// ---- operations -------------------------------------------------------------------------------------------
// Starts operation `name` (e.g. "cublasLtMatmul") on `stream`: the accesses declared until cucc_check_op_end
// belong to it, and it is ordered after everything its stream has seen. Returns its serial number (never 0).
uint32_t cucc_check_op_begin(cudaStream_t stream, const char* name);
void cucc_check_op_end(void);
// Whether operation `earlier` happens before operation `later` (same stream in order, or ordered by events and
// synchronisations). Serials come from cucc_check_op_begin.
int cucc_check_ordered(uint32_t earlier, uint32_t later);
// "cublasLtMatmul on stream 0x1234 (#57)": for reports naming another operation.
const char* cucc_check_op_describe(uint32_t op, char* buf, size_t n);

// ---- memory that an operation reads or writes -------------------------------------------------------------
// A contiguous range. Inside an operation (between op_begin and op_end): checks that [p, p + bytes) lies in one
// live device (or managed) allocation (memcheck; `what` names the operand, e.g. "bias"), that a read reads
// written bytes (initcheck) and that conflicting earlier accesses are ordered before this operation
// (streamcheck); a write marks the bytes written by this operation.
void cucc_check_read(const void* p, size_t bytes, const char* what);
void cucc_check_write(void* p, size_t bytes, const char* what);
// A column-major matrix: `cols` columns of `rows` elements of `elem` bytes, column j at p + j * ld * elem;
// `batch` such matrices, matrix b at p + b * stride * elem.
void cucc_check_read_matrix(const void* p, size_t rows, size_t cols, size_t ld, size_t elem, size_t batch,
                            long long stride, const char* what);
void cucc_check_write_matrix(void* p, size_t rows, size_t cols, size_t ld, size_t elem, size_t batch,
                             long long stride, const char* what);
// The live device allocation containing p: its base and size (0 when p is in none).
size_t cucc_check_allocation(const void* p, void** base);

#ifdef __cplusplus
}
#endif
