// cpu/check.h: what cpu/runtime.cpp and cpu/check.cpp share in the checking mode (-DCUCC_CHECK, the "check"
// variant that cpu/cucc --check links). The public side, for cublas.cpp and nccl.cpp, is include/cucc_check.h.
//
// Execution under the checks: a launch's blocks run one after another on the calling thread (the shadow state
// needs no locks and reports are reproducible); each CUDA thread carries a cucc_check_thread, each block in
// flight a cucc_check_block. A block's "sync clock" counts its completed barriers and warp rendezvous: an access
// remembers the clock at which it was made, and a later access by another thread of the block is ordered after
// it only if that thread has since passed a barrier (or, in the same warp, a warp rendezvous) whose clock is
// larger.
#pragma once
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "cucc_check.h"

struct cucc_check_thread {
    uint32_t tid;         // block's first tid + linear thread index: unique within the launch
    uint32_t bar_stamp;   // sync clock of the last barrier this thread passed
    uint32_t warp_stamp;  // sync clock of the last rendezvous of its whole warp (every live lane) it passed
    uint32_t part_stamp;  // sync clock of the last rendezvous of part of its warp (a tile, a partial mask) it passed,
    unsigned part_lanes;  // and the live lanes that took part in it
    uint32_t barriers;    // barriers passed
    int warp;
    int exited;           // returned: its stamps are those of the last rendezvous it took part in
    int fenced;           // has executed __threadfence(): its atomic writes from now on publish its block's writes
    uintptr_t spin_addr;  // the address of this thread's last volatile or atomic load, its value, and how often in
    uint64_t spin_value;  // a row it read that value there
    uint64_t spin_count;
};

struct cucc_check_block {
    uint32_t serial;     // unique per block run in the process: the "op" of shared memory's shadow cells
    uint32_t clock;      // sync clock
    uint32_t barriers;   // barriers completed
    uint32_t first_tid;  // tid of thread 0
    int nthreads;
    char* threads;       // the thread records, `stride` bytes apart
    size_t stride;
    uint3 index;
};

// the thread whose code runs now (null outside kernels) and its block
extern cucc_check_thread* cucc_check_current;
extern cucc_check_block cucc_check_block_state;

// launches
void cucc_check_launch_begin(const char* kernel, dim3 grid, dim3 block, size_t dynamic_shared, int max_dynamic_shared,
                             cudaStream_t stream, void** dynamic_smem_out);
void cucc_check_launch_end(void);
// `threads` is the block's first thread record; the others follow every `stride` bytes
void cucc_check_block_begin(uint3 block_index, long block_linear, int nthreads, cucc_check_thread* threads,
                            size_t stride);
// a thread's record at its start; the runtime then keeps cucc_check_current pointing at the running thread
void cucc_check_thread_begin(cucc_check_thread* t, int linear_index);
// a thread returned: synccheck remembers how many barriers it passed
void cucc_check_thread_end(cucc_check_thread* t);
void cucc_check_block_end(void);
// a rendezvous completed: a barrier of the block (at file:line) or a warp operation. Each returns the new sync
// clock, which the runtime stores in the released threads (bar_stamp and warp_stamp, or warp_stamp).
uint32_t cucc_check_barrier_done(const char* file, int line);
uint32_t cucc_check_warp_done(void);
// static shared memory of one declaration: placed in the shared window, its size counted for the launch limits
void* cucc_check_static_shared(void** slot, size_t bytes, size_t align);
// "kernel 'k' block (1,0,0) thread (3,0,0) at file:line" for reports from the runtime
const char* cucc_check_where(char* buf, size_t n);

// memory
cudaError_t cucc_check_malloc(void** p, size_t bytes, int kind);  // kind: CUCC_MEM_DEVICE, _MANAGED, _PINNED
cudaError_t cucc_check_free(void* p, int kind);
enum { CUCC_MEM_DEVICE = 1, CUCC_MEM_MANAGED = 2, CUCC_MEM_PINNED = 3 };
// copies and memset as operations; kind is the cudaMemcpyKind the caller named (checked against where dst and src
// are); async: the cudaMemcpyAsync/cudaMemsetAsync forms (a D2H copy into pinned memory lands at the next
// synchronisation the host makes with it, and the destination holds 0xff until then)
cudaError_t cucc_check_memcpy(void* dst, const void* src, size_t count, cudaMemcpyKind kind, cudaStream_t stream,
                              int async, const char* name);
cudaError_t cucc_check_memset(void* dst, int value, size_t count, cudaStream_t stream, const char* name);

// streams, events, synchronisation
void cucc_check_stream_create(cudaStream_t s, unsigned flags);
void cucc_check_stream_destroy(cudaStream_t s);
void cucc_check_event_record(cudaEvent_t e, cudaStream_t s);
void cucc_check_event_destroy(cudaEvent_t e);
void cucc_check_stream_wait_event(cudaStream_t s, cudaEvent_t e);
void cucc_check_host_sync_stream(cudaStream_t s);
void cucc_check_host_sync_event(cudaEvent_t e);
void cucc_check_host_sync_device(void);
// 1: done (the host is now ordered after it); 0: answer cudaErrorNotReady
int cucc_check_query_stream(cudaStream_t s);
int cucc_check_query_event(cudaEvent_t e);
