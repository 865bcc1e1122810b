// llmc/encoder.cuh: GPT-2 input embedding, forward and backward: out = wte[token] + wpe[position], and the
// gradients of both tables. Without wpe (NULL: a model without learned positions, -arch llama), out = wte[token].
// encoder_forward_at embeds rows of tokens each at its own position (inference: sequences at different lengths) with
// the same kernel, so each of its rows is bit for bit encoder_forward's for that token and position.
// The _vocab_range entry points serve tensor parallelism, where each process holds the wte rows [v0, v0 + Vs): ids
// outside the range contribute nothing, and their gradient is left to the process holding them.
// Included by the trainers and by the kernel labs dev/cuda/encoder_forward.cu and dev/cuda/encoder_backward.cu
// (`make build/lab/encoder_forward_bf16 && build/lab/encoder_forward_bf16 -s`; both validate the ranges too).
// Size constraint: C % 8 == 0 (every thread moves 8 channels with one 16-byte vector); the trainer checks
// it at start-up through encoder_support.
// Tests (dev/test/run_tests.sh NAME, patterns work): lab-encoder_forward_{bf16,fp32},
// lab-encoder_backward_{bf16,fp32} and their lab-check- twins; production-sizes (past 2^31 elements), gpt-* and
// moe-*.
#pragma once
#include <limits.h>
#include "common.cuh"

// ----------------------------------------------------------------------------------------------------
// Forward. Floor: the output (B*T*C) is written once and each position reads one wte row; wpe (T*C) is
// shared by the B sequences and is served from L2 after the first, so DRAM bytes ≈ 2*B*T*C*sizeof(floatX)
// + T*C*sizeof(floatX) + 4*B*T (tokens); one add per element (~0.2 flop per byte): memory-bound.
// With a vocabulary range (tensor parallelism: each process holds the wte rows [v0, v0 + Vs)), an id outside the
// range contributes 0 and reads nothing; the processes' outputs summed give the whole embedding.

// wte holds the rows [v0, v0 + Vs) of the table; the whole table is v0 = 0, Vs = INT_MAX. A row's position t is
// row % T (rows (B, T): every sequence from 0), or positions[row] when positions is given (rows (N) of tokens at
// positions of their own, for inference): one code path, so that encoder_forward_at's row is bit for bit
// encoder_forward's for the same token and t.
__global__ void encoder_forward_kernel(floatX* __restrict__ out, const int* __restrict__ inp,
                                       const int* __restrict__ positions, const floatX* __restrict__ wte,
                                       const floatX* __restrict__ wpe, int B, int T, int C, int v0, int Vs) {
    size_t idx = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * x128::size;  // first of this thread's vector
    if (idx >= (size_t)B * T * C) return;
    size_t bt = idx / C;
    int c = (int)(idx % C);
    int row = inp[bt] - v0;
    x128 token_embedding = x128::zeros();
    if (row >= 0 && row < Vs) token_embedding = load128(wte + (size_t)row * C + c);  // repeated tokens hit L2: cached
    if (wpe == nullptr) {  // a copy
        store128(out + idx, token_embedding);
        return;
    }
    const int t = positions != nullptr ? positions[bt] : (int)(bt % T);
    x128 position_embedding = load128(wpe + (size_t)t * C + c);
    x128 result;
    for (int k = 0; k < x128::size; k++) {
        result[k] = (floatX)((float)token_embedding[k] + (float)position_embedding[k]);
    }
    store128(out + idx, result);
}

// positions: NULL for rows (B, T) at t = row % T, or the (B * T) positions of the rows (encoder_forward_at: B = 1,
// T = N)
static void encoder_forward_positions_launch(floatX* out, const int* inp, const int* positions, const floatX* wte_slice,
                                             const floatX* wpe, int B, int T, int C, int v0, int Vs, int block_size,
                                             cudaStream_t stream) {
    size_t threads = (size_t)B * T * C / x128::size;
    unsigned int grid = (unsigned int)CEIL_DIV(threads, (size_t)block_size);
    encoder_forward_kernel<<<grid, block_size, 0, stream>>>(out, inp, positions, wte_slice, wpe, B, T, C, v0, Vs);
    cudaCheck(cudaGetLastError());
}

void encoder_forward_vocab_range_launch(floatX* out, const int* inp, const floatX* wte_slice, const floatX* wpe, int B,
                                        int T, int C, int v0, int Vs, int block_size, cudaStream_t stream) {
    encoder_forward_positions_launch(out, inp, nullptr, wte_slice, wpe, B, T, C, v0, Vs, block_size, stream);
}

void encoder_forward_launch(floatX* out, const int* inp, const floatX* wte, const floatX* wpe, int B, int T, int C,
                            int block_size, cudaStream_t stream) {
    encoder_forward_vocab_range_launch(out, inp, wte, wpe, B, T, C, 0, INT_MAX, block_size, stream);
}

// out (B,T,C) = wte[inp[b,t]] + wpe[t]; inp (B,T); wte (Vp,C); wpe (maxT,C) or NULL (no position term)
void encoder_forward(floatX* out, const int* inp, const floatX* wte, const floatX* wpe, int B, int T, int C,
                     cudaStream_t stream) {
    encoder_forward_launch(out, inp, wte, wpe, B, T, C, 256, stream);
}

// out (N,C) = wte[tokens[i]] + wpe[positions[i]], one row per token (inference: a batch of sequences each at its own
// position); tokens and positions (N) on the device; wpe (maxT,C) with every positions[i] < maxT, or NULL (no
// position term: -arch llama, as model_embed passes it). Bit-identical to encoder_forward's row for the same token
// and t = positions[i].
void encoder_forward_at(floatX* out, const int* tokens, const int* positions, const floatX* wte, const floatX* wpe,
                        int N, int C, cudaStream_t stream) {
    encoder_forward_positions_launch(out, tokens, positions, wte, wpe, 1, N, C, 0, INT_MAX, 256, stream);
}

// out (B,T,C) = (v0 <= id < v0 + Vs ? wte_slice[id - v0] : 0) + wpe[t], id = inp[b,t]; wte_slice (Vs,C), the rows
// [v0, v0 + Vs) of wte; wpe (maxT,C) or NULL. Tensor parallelism passes wpe on one process only and sums the
// processes' outputs.
void encoder_forward_vocab_range(floatX* out, const int* inp, const floatX* wte_slice, const floatX* wpe, int B, int T,
                                 int C, int v0, int Vs, cudaStream_t stream) {
    encoder_forward_vocab_range_launch(out, inp, wte_slice, wpe, B, T, C, v0, Vs, 256, stream);
}
// The same for tokens each at its own position (encoder_forward_at's rows): a tensor-parallel decode step's embeddings
void encoder_forward_vocab_range_at(floatX* out, const int* tokens, const int* positions, const floatX* wte_slice,
                                    const floatX* wpe, int N, int C, int v0, int Vs, cudaStream_t stream) {
    encoder_forward_positions_launch(out, tokens, positions, wte_slice, wpe, 1, N, C, v0, Vs, 256, stream);
}

// ----------------------------------------------------------------------------------------------------
// Backward. dwte[v] += sum of dout over the positions holding token v; dwpe[t] += sum over b of dout[b,t].
// Deterministic without float atomics: the host buckets the positions by token (counting sort, positions
// in increasing order inside a bucket), and one block per bucket sums its rows in that fixed order.
// Floor: dout (B*T*C) is read once for dwte and once for dwpe (the second read mostly from L2), the touched
// dwte rows (at most B*T) and all of dwpe (T*C) are read and written once:
// DRAM bytes ≈ (B*T*C + 2*buckets*C + 2*T*C) * sizeof(floatX) + at most 20*B*T (bucket tables), with
// buckets = distinct tokens <= min(B*T, Vp); one add per element read: memory-bound.
// With a vocabulary range [v0, v0 + Vs) (tensor parallelism), the host builds buckets for the ids in the range only
// and the blocks write the slice's rows; a row's sum and its stochastic rounding (drawn from its global element
// index) do not depend on the range: every row comes out bit-identical to the whole-vocabulary call's.

#define ENCODER_BACKWARD_WARPS 8                 // warps of a dwte block, sharing one bucket's rows
#define ENCODER_BACKWARD_SLICE (32 * x128::size)  // channels of a dwte block: 32 lanes x one vector

// One block per (bucket, slice of 32 vectors: 256 channels in bf16). The warps take the bucket's positions
// round-robin, each lane summing one vector of channels in fp32; the warps' partial sums are then added in
// warp order, so the result depends only on the bucket's content, never on scheduling.
// bucket = {token, begin, end, unused}; dwte holds the rows [v0, ...) of the table (v0 = 0: the whole table).
__global__ void encoder_backward_wte_kernel(floatX* __restrict__ dwte, const floatX* __restrict__ dout,
                                            const int* __restrict__ positions, const int4* __restrict__ buckets,
                                            int C, int v0, unsigned int seed) {
    __shared__ float warp_sums[ENCODER_BACKWARD_WARPS * ENCODER_BACKWARD_SLICE];
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int slice_channel = lane * x128::size;
    const int c = blockIdx.y * ENCODER_BACKWARD_SLICE + slice_channel;
    const int4 bucket = buckets[blockIdx.x];

    float sum[x128::size];
    for (int k = 0; k < x128::size; k++) sum[k] = 0.0f;
    if (c < C) {
        for (int i = bucket.y + warp; i < bucket.z; i += ENCODER_BACKWARD_WARPS) {
            x128 d = load128cs(dout + (size_t)positions[i] * C + c);
            for (int k = 0; k < x128::size; k++) sum[k] += (float)d[k];
        }
    }
    float* mine = warp_sums + warp * ENCODER_BACKWARD_SLICE + slice_channel;
    for (int k = 0; k < x128::size; k++) mine[k] = sum[k];
    __syncthreads();
    if (warp != 0 || c >= C) return;

    for (int w = 1; w < ENCODER_BACKWARD_WARPS; w++) {
        const float* theirs = warp_sums + w * ENCODER_BACKWARD_SLICE + slice_channel;
        for (int k = 0; k < x128::size; k++) sum[k] += theirs[k];
    }
    const size_t offset = (size_t)bucket.x * C + c;  // in the whole table: the random stream of the element
    floatX* target = dwte + (size_t)(bucket.x - v0) * C + c;
    x128 old_value = load128(target);
    x128 new_value;
    for (int k = 0; k < x128::size; k++) {
        unsigned int random = random_u32(seed, (unsigned int)(offset + k));
        stochastic_rounding((float)old_value[k] + sum[k], &new_value[k], random);
    }
    store128(target, new_value);
}

// One thread per (t, 8 channels): sums the B sequences in order.
__global__ void encoder_backward_wpe_kernel(floatX* __restrict__ dwpe, const floatX* __restrict__ dout, int B,
                                            int T, int C, unsigned int seed) {
    size_t idx = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * x128::size;  // into (T, C)
    if (idx >= (size_t)T * C) return;
    float sum[x128::size];
    for (int k = 0; k < x128::size; k++) sum[k] = 0.0f;
    for (int b = 0; b < B; b++) {
        x128 d = load128cs(dout + (size_t)b * T * C + idx);
        for (int k = 0; k < x128::size; k++) sum[k] += (float)d[k];
    }
    x128 old_value = load128(dwpe + idx);
    x128 new_value;
    for (int k = 0; k < x128::size; k++) {
        unsigned int random = random_u32(seed, (unsigned int)(idx + k));
        stochastic_rounding((float)old_value[k] + sum[k], &new_value[k], random);
    }
    store128(dwpe + idx, new_value);
}

// The bucket table: positions (N, padded to a multiple of 4 ints so the int4 buckets that follow are 16-byte
// aligned), then one int4 {token, begin, end, 0} per distinct token; kept between calls and grown when a larger batch
// arrives. The host builds it in pinned staging memory, from which cudaMemcpyAsync is a DMA the host does not wait
// for (from pageable memory it goes through a driver buffer, and CUDA allows it to be synchronous with respect to the
// host). A staging buffer may be rebuilt only once the copy out of it has finished, which its event tells; with two
// buffers that is the copy of the call before the last, so the host can prepare a backward pass while the GPU still
// runs the previous one.
#define ENCODER_STAGING_BUFFERS 2

struct EncoderBuckets {
    int* host_tables[ENCODER_STAGING_BUFFERS];  // pinned
    cudaEvent_t copied[ENCODER_STAGING_BUFFERS];  // recorded after the last copy out of host_tables[i]
    int next;                                    // the staging buffer the next call builds in
    int* device_table;
    size_t table_capacity;  // ints, of each host table and of the device table
    int* token_cursor;      // per token id: occurrences, then where its next position goes
    size_t token_capacity;
};

static int encoder_compare_buckets(const void* a, const void* b) {
    const int4* x = (const int4*)a;
    const int4* y = (const int4*)b;
    int size_x = x->z - x->y, size_y = y->z - y->y;
    if (size_x != size_y) return size_x > size_y ? -1 : 1;
    return x->x < y->x ? -1 : (x->x > y->x ? 1 : 0);
}

// The staging buffer for a table of table_ints ints, once the copy last issued from it has finished. Growing
// replaces every buffer (after their copies, and the device table's readers: cudaFree waits for the device).
static int* encoder_staging_table(EncoderBuckets* table, size_t table_ints) {
    if (table->copied[0] == nullptr) {
        for (int i = 0; i < ENCODER_STAGING_BUFFERS; i++)
            cudaCheck(cudaEventCreateWithFlags(&table->copied[i], cudaEventDisableTiming));
    }
    if (table_ints > table->table_capacity) {
        for (int i = 0; i < ENCODER_STAGING_BUFFERS; i++) {
            cudaCheck(cudaEventSynchronize(table->copied[i]));
            cudaCheck(cudaFreeHost(table->host_tables[i]));
            cudaCheck(cudaMallocHost(&table->host_tables[i], table_ints * sizeof(int)));
        }
        cudaCheck(cudaFree(table->device_table));
        cudaCheck(cudaMalloc(&table->device_table, table_ints * sizeof(int)));
        table->table_capacity = table_ints;
    }
    cudaCheck(cudaEventSynchronize(table->copied[table->next]));
    return table->host_tables[table->next];
}

// Counting sort of the positions holding ids in [v0, v0 + Vs) (the whole vocabulary: v0 = 0, Vs = INT_MAX) by
// token (positions ascending inside a bucket) into the next staging buffer; returns the number of buckets, of global
// ids. Positions of other ids are left out, so the positions array may end before padded_n. Buckets are listed largest
// first so that the longest blocks start early and overlap the many short ones: only the schedule depends on that
// order, not the sums.
static int encoder_build_buckets_vocab_range(EncoderBuckets* table, const int* inputs_cpu, int N, int v0, int Vs) {
    int max_token = 0;
    for (int i = 0; i < N; i++) {
        if (inputs_cpu[i] < 0) {
            fprintf(stderr, "encoder_backward: negative token id %d at position %d\n", inputs_cpu[i], i);
            exit(EXIT_FAILURE);
        }
        if (inputs_cpu[i] > max_token) max_token = inputs_cpu[i];
    }
    // the ids counted: [v0, end), in 64 bits since v0 + Vs overflows for the whole vocabulary
    const long long end = (long long)v0 + Vs < (long long)max_token + 1 ? (long long)v0 + Vs : (long long)max_token + 1;
    const size_t tokens = end > v0 ? (size_t)(end - v0) : 0;  // cursor entries, indexed by id - v0
    if (tokens > table->token_capacity) {
        free(table->token_cursor);
        table->token_cursor = (int*)malloc(tokens * sizeof(int));
        table->token_capacity = tokens;
    }
    size_t padded_n = CEIL_DIV((size_t)N, (size_t)4) * 4;
    int* host_table = encoder_staging_table(table, padded_n + 4 * (size_t)N);  // at most N buckets
    int* cursor = table->token_cursor;
    if (tokens > 0) memset(cursor, 0, tokens * sizeof(int));
    for (int i = 0; i < N; i++) {
        const int v = inputs_cpu[i] - v0;
        if (v >= 0 && (size_t)v < tokens) cursor[v]++;
    }

    int* positions = host_table;
    int4* buckets = (int4*)(host_table + padded_n);
    int num_buckets = 0, begin = 0;
    for (size_t v = 0; v < tokens; v++) {
        int count = cursor[v];
        if (count == 0) continue;
        buckets[num_buckets++] = make_int4(v0 + (int)v, begin, begin + count, 0);
        cursor[v] = begin;
        begin += count;
    }
    for (int i = 0; i < N; i++) {
        const int v = inputs_cpu[i] - v0;
        if (v >= 0 && (size_t)v < tokens) positions[cursor[v]++] = i;
    }
    qsort(buckets, num_buckets, sizeof(int4), encoder_compare_buckets);
    return num_buckets;
}

// Builds the bucket table of the positions of inputs_cpu (N) holding ids in [v0, v0 + Vs) and copies it into
// table->device_table on stream (the positions first, the buckets from padded_n = N rounded up to a multiple of 4
// ints on); returns the bucket count, 0 when no position holds an id of the range.
static int encoder_upload_buckets_vocab_range(EncoderBuckets* table, const int* inputs_cpu, int N, int v0, int Vs,
                                              cudaStream_t stream) {
    const int num_buckets = encoder_build_buckets_vocab_range(table, inputs_cpu, N, v0, Vs);
    const size_t used_ints = CEIL_DIV((size_t)N, (size_t)4) * 4 + 4 * (size_t)num_buckets;
    cudaCheck(cudaMemcpyAsync(table->device_table, table->host_tables[table->next], used_ints * sizeof(int),
                              cudaMemcpyHostToDevice, stream));
    cudaCheck(cudaEventRecord(table->copied[table->next], stream));
    table->next = (table->next + 1) % ENCODER_STAGING_BUFFERS;
    return num_buckets;
}

// the same for the whole vocabulary (inline: encoder_backward does not call it, the lab does)
static inline int encoder_upload_buckets(EncoderBuckets* table, const int* inputs_cpu, int N, cudaStream_t stream) {
    return encoder_upload_buckets_vocab_range(table, inputs_cpu, N, 0, INT_MAX, stream);
}

// dwte_slice (Vs,C), the rows [v0, v0 + Vs) of dwte, += per id in the range, the sum of dout over the positions
// holding it (the positions of other ids are the other processes'); dwpe (maxT,C) += sum over b of dout[b,t] (dwpe
// NULL: a model without wpe, or a process that leaves it to another). inputs_cpu is the host copy of inp (B,T). bf16
// results are rounded stochastically from seed, each row as encoder_backward rounds it.
void encoder_backward_vocab_range(floatX* dwte_slice, floatX* dwpe, const floatX* dout, const int* inp,
                                  const int* inputs_cpu, int B, int T, int C, int v0, int Vs, unsigned int seed,
                                  cudaStream_t stream) {
    static EncoderBuckets table = {};
    (void)inp;  // the device copy is not needed: the buckets come from inputs_cpu
    const int N = B * T;
    const int num_buckets = encoder_upload_buckets_vocab_range(&table, inputs_cpu, N, v0, Vs, stream);
    const size_t padded_n = CEIL_DIV((size_t)N, (size_t)4) * 4;

    if (num_buckets > 0) {  // a grid of 0 blocks is a launch error
        dim3 wte_grid(num_buckets, CEIL_DIV(C, ENCODER_BACKWARD_SLICE));
        encoder_backward_wte_kernel<<<wte_grid, ENCODER_BACKWARD_WARPS * 32, 0, stream>>>(
            dwte_slice, dout, table.device_table, (const int4*)(table.device_table + padded_n), C, v0, seed);
        cudaCheck(cudaGetLastError());
    }
    if (dwpe == nullptr) return;

    const int block_size = 256;
    unsigned int wpe_grid = (unsigned int)CEIL_DIV((size_t)T * C / x128::size, (size_t)block_size);
    encoder_backward_wpe_kernel<<<wpe_grid, block_size, 0, stream>>>(dwpe, dout, B, T, C, seed + 1);
    cudaCheck(cudaGetLastError());
}

// dwte (Vp,C) += per token, the sum of dout over the positions holding it; dwpe (maxT,C) += sum over b of
// dout[b,t] (dwpe NULL: a model without wpe). inputs_cpu is the host copy of inp (B,T). bf16 results are rounded
// stochastically from seed.
void encoder_backward(floatX* dwte, floatX* dwpe, const floatX* dout, const int* inp, const int* inputs_cpu, int B,
                      int T, int C, unsigned int seed, cudaStream_t stream) {
    encoder_backward_vocab_range(dwte, dwpe, dout, inp, inputs_cpu, B, T, C, 0, INT_MAX, seed, stream);
}

// ----------------------------------------------------------------------------------------------------
// The sizes the encoder kernels support; false with a one-line reason otherwise. Called by the trainers at start-up.
bool encoder_support(int C, char* why, size_t why_size) {
    if (C <= 0 || C % 8 != 0) {
        snprintf(why, why_size, "C = %d: the encoder kernels need C a positive multiple of 8 (16-byte vectors of 8 bf16)", C);
        return false;
    }
    return true;
}
