// llmc/mfu.h: the project's one table of GPU peaks: the dense tensor-core throughput of the GPU the trainer
// runs on, for its MFU (model flops utilisation) column, and its DRAM bandwidth, for the kernel lab's "% of
// floor" column (dev/cuda/common.h). Numbers are NVIDIA's datasheet/whitepaper figures in TFLOP/s, without
// structured sparsity (datasheets often print the sparse figure, twice these), fp32 accumulation:
// PRECISION_FP32 trains with TF32 tensor cores, so it gets the TF32 figure.
// A device not in the table, such as the CPU backend's, gets -1 and the trainer prints no MFU.
// Header-only: #include it from a .cu (built by nvcc or cpu/cucc). Tested by dev/test/test_host_utils.cu.
#pragma once
#include <string.h>
#include "common.cuh"

typedef struct {
    const char* const words[4];  // all must appear as whole words of the device name (NULL-terminated)
    const char* excluded;        // a word that must not appear (a different card with a longer name), or NULL
    float tf32;
    float fp16;
    float bf16;
    float dram_gbs;              // peak DRAM bandwidth, GB/s
} GpuPeakFlops;

// Device names as cudaGetDeviceProperties reports them, e.g. "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB
// PCIe", "NVIDIA H100 80GB HBM3" (SXM5), "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA GeForce RTX 4090".
// More specific entries come first.
static const GpuPeakFlops gpu_peak_flops_table[] = {
    {{"A100", "80GB", "PCIe", NULL}, NULL, 156.0f, 312.0f, 312.0f, 1935.0f},
    {{"A100", "80GB", NULL}, NULL, 156.0f, 312.0f, 312.0f, 2039.0f},     // SXM4 80 GB
    {{"A100", NULL}, NULL, 156.0f, 312.0f, 312.0f, 1555.0f},             // 40 GB, SXM4 and PCIe
    {{"H100", "NVL", NULL}, NULL, 417.5f, 835.5f, 835.5f, 3900.0f},
    {{"H100", "PCIe", NULL}, NULL, 378.0f, 756.0f, 756.0f, 2000.0f},
    {{"H100", NULL}, NULL, 494.7f, 989.4f, 989.4f, 3350.0f},             // SXM5 (named "H100 80GB HBM3")
    {{"H200", "NVL", NULL}, NULL, 417.5f, 835.5f, 835.5f, 4800.0f},
    {{"H200", NULL}, NULL, 494.7f, 989.4f, 989.4f, 4800.0f},             // SXM
    {{"L4", NULL}, NULL, 60.0f, 121.0f, 121.0f, 300.0f},
    // A10G (AWS) has no datasheet: 80 SMs at 1.71 GHz, tensor cores at GeForce rate with fp32 accumulation
    {{"A10G", NULL}, NULL, 35.0f, 70.0f, 70.0f, 600.0f},
    {{"RTX", "4090", NULL}, "D", 82.6f, 165.2f, 165.2f, 1008.0f},
    {{"RTX", "3090", "Ti", NULL}, NULL, 40.0f, 80.0f, 80.0f, 1008.0f},
    {{"RTX", "3090", NULL}, "Ti", 35.6f, 71.0f, 71.0f, 936.0f},
};

// whether `word` appears in `name` delimited by start/end, space or '-'
static inline int device_name_has_word(const char* name, const char* word) {
    size_t len = strlen(word);
    for (const char* p = strstr(name, word); p != NULL; p = strstr(p + 1, word)) {
        int starts = p == name || p[-1] == ' ' || p[-1] == '-';
        int ends = p[len] == '\0' || p[len] == ' ' || p[len] == '-';
        if (starts && ends) return 1;
    }
    return 0;
}

// the table's entry for a device name, or NULL
static inline const GpuPeakFlops* gpu_peaks_find(const char* device_name) {
    int entries = (int)(sizeof(gpu_peak_flops_table) / sizeof(gpu_peak_flops_table[0]));
    for (int i = 0; i < entries; i++) {
        const GpuPeakFlops* g = &gpu_peak_flops_table[i];
        int match = 1;
        for (int w = 0; g->words[w] != NULL; w++) match = match && device_name_has_word(device_name, g->words[w]);
        if (g->excluded != NULL && device_name_has_word(device_name, g->excluded)) match = 0;
        if (match) return g;
    }
    return NULL;
}

static inline float get_flops_promised(const char* device_name, int precision_mode) {
    const GpuPeakFlops* g = gpu_peaks_find(device_name);
    if (g != NULL) {
        if (precision_mode == PRECISION_FP32) return g->tf32;
        if (precision_mode == PRECISION_FP16) return g->fp16;
        if (precision_mode == PRECISION_BF16) return g->bf16;
        return -1.0f;
    }
    return -1.0f;
}
