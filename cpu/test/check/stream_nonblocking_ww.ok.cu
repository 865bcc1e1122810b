// stream_nonblocking_ww (ok): the scatter on the second non-blocking stream waits on an event recorded after
// the fill on the first. Correct twin of stream_nonblocking_ww.bug.cu; no check may report it.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void fill(float* buf, int n, float v) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) buf[i] = v;
}
__global__ void scatter(const int* idx, const float* val, int m, float* buf) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < m) buf[idx[i]] = val[i];
}

int main() {
    const int n = 256, m = 50;
    int hi[m];
    float hv[m], r[n], want[n];
    for (int i = 0; i < n; i++) want[i] = -1.0f;
    for (int i = 0; i < m; i++) { hi[i] = (i * 97) % n; hv[i] = (float)(i * 3 % 11); want[hi[i]] = hv[i]; }
    int* idx;
    float *val, *buf;
    CK(cudaMalloc(&idx, sizeof hi));
    CK(cudaMalloc(&val, sizeof hv));
    CK(cudaMalloc(&buf, sizeof r));
    CK(cudaMemcpy(idx, hi, sizeof hi, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(val, hv, sizeof hv, cudaMemcpyHostToDevice));
    CK(cudaDeviceSynchronize());  // non-blocking streams do not wait for the legacy default stream
    cudaStream_t s1, s2;
    cudaEvent_t filled;
    CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    CK(cudaEventCreateWithFlags(&filled, cudaEventDisableTiming));
    fill<<<n / 128, 128, 0, s1>>>(buf, n, -1.0f);
    CK(cudaGetLastError());
    CK(cudaEventRecord(filled, s1));  // the fix
    CK(cudaStreamWaitEvent(s2, filled, 0));
    scatter<<<1, 64, 0, s2>>>(idx, val, m, buf);
    CK(cudaGetLastError());
    CK(cudaStreamSynchronize(s1));
    CK(cudaStreamSynchronize(s2));
    CK(cudaMemcpy(r, buf, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++)
        if (r[i] != want[i]) { fprintf(stderr, "buf[%d] = %g, want %g\n", i, r[i], want[i]); return 1; }
    CK(cudaEventDestroy(filled));
    CK(cudaStreamDestroy(s1));
    CK(cudaStreamDestroy(s2));
    CK(cudaFree(idx));
    CK(cudaFree(val));
    CK(cudaFree(buf));
    printf("ok\n");
    return 0;
}
