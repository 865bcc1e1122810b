// mem_atomic_misaligned (bug): atomicAdd on an int at byte offset 2 of a record (after a 2-byte tag), so the
// atomic's address is not 4-byte aligned. expect memcheck.
// expect: memcheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

const int COUNTER_OFFSET = 2;  // bug: the counter must sit at a multiple of 4 bytes (4)

__global__ void count_set(const int* flags, int n, char* record) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n && flags[i] != 0) atomicAdd(reinterpret_cast<int*>(record + COUNTER_OFFSET), 1);
}

int main() {
    const int n = 300;
    static int h[n];
    int want = 0, got = -1;
    for (int i = 0; i < n; i++) { h[i] = (i * i) % 7 < 3; want += h[i]; }
    int* flags;
    char* record;
    CK(cudaMalloc(&flags, sizeof h));
    CK(cudaMalloc(&record, 8));
    CK(cudaMemcpy(flags, h, sizeof h, cudaMemcpyHostToDevice));
    CK(cudaMemset(record, 0, 8));
    count_set<<<(n + 127) / 128, 128>>>(flags, n, record);
    CK(cudaGetLastError());
    CK(cudaMemcpy(&got, record + COUNTER_OFFSET, sizeof(int), cudaMemcpyDeviceToHost));
    if (got != want) { fprintf(stderr, "count = %d, want %d\n", got, want); return 1; }
    CK(cudaFree(flags));
    CK(cudaFree(record));
    printf("ok\n");
    return 0;
}
