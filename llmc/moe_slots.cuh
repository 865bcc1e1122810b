// llmc/moe_slots.cuh: the MoE layer's slot assignment: each (token, choice) gets its row of the expert buffer in
// priority order under the capacity limit (padded layout) or without one (packed, dropless), deterministically and
// without atomics. Shapes, layouts and limits: llmc/moe_common.cuh; semantics: doc/moe.md, "Routing" 4.
// Lab: dev/cuda/moe_slots.cu (e.g. `make build/lab/moe_slots_bf16 && build/lab/moe_slots_bf16 -s`).
// Tests (dev/test/run_tests.sh NAME, patterns work): lab-moe_slots_{bf16,fp32} and their lab-check- twins; moe-* and
// check-moe-* (the drops and the routing against PyTorch).
#pragma once
#include "moe_common.cuh"

// ----------------------------------------------------------------------------------------------------
// Slot assignment, three passes over tiles of the priority order p = j*N + t (every first choice in token order,
// then every second choice, ...; choice = t*k + j). A tile is MOE_SLOTS_ITEMS * blockDim.x consecutive
// priorities, one block each; warp w of a block takes the tile's priorities [w*32*ITEMS, (w+1)*32*ITEMS), 32 at a
// time (item i: lane x takes w*32*ITEMS + i*32 + x), so that the order inside a tile is (warp, item, lane).
//   1. count: block b counts its tile's choices per expert: counts[b, e];
//   2. scan (one block): per expert, the exclusive prefix of counts over the tiles in place (slot of the tile's
//      first choice of e), the totals expert_count[e] and kept_count[e] = min(total, capacity), and each expert's
//      first row (padded: e * capacity; packed: the choices routed to the experts below e);
//   3. assign: block b gives each choice of its tile its slot s = the tile's offset for e + the choices of e
//      before it in the tile; s >= capacity is dropped (-1), a kept choice gets row first_row[e] + s.
// Inside a tile, a choice's rank among the choices of its expert comes from the warp's peer mask (the lanes with
// the same expert: one ballot per bit of the expert index, as __match_any_sync would give, which the CPU backend
// lacks), the counts of earlier items of its warp and, after a scan over the warps in shared memory, the counts of
// earlier warps. Integers only and every count has one writer, so the result depends on expert_index alone (the
// same slots as one pass in priority order, doc/moe.md). Padded layout: rows [kept_count[e], capacity) of each
// expert are marked padding (-1) by the assign pass, grid-strided; the packed layout (dropless) has no padding.
// Floor: DRAM reads N*k*4 bytes of expert_index (the assign pass reads them again, from L2) and writes N*k*4
// (choice_row) + R*4 (row_choice) + 8*E; the counts and offsets, 2 * (N*k / tile) * E ints, stay in L2. At
// N = 65536, k = 1, E = 8 with CF 1.25 that is 0.8 MB (0.2 us at ~4.8 TB/s), at k = 8, E = 64 6.8 MB (1.4 us):
// below the three dependent launches (a few us), so what matters is that every pass spreads over the GPU:
// N*k / 512 blocks (128 at 65536 choices) instead of one block per expert, each of which walked all N*k choices.

// the lanes of this warp whose expert equals this lane's, among the lanes with valid set (every lane calls it);
// expert_bits: the bits of the largest expert index
__device__ inline unsigned int moe_warp_peers(int expert, bool valid, int expert_bits) {
    unsigned int peers = __ballot_sync(0xffffffff, valid);
    for (int b = 0; b < expert_bits; b++) {
        const bool bit = (expert >> b) & 1;
        const unsigned int ones = __ballot_sync(0xffffffff, bit);
        peers &= bit ? ones : ~ones;
    }
    return peers;
}

// choice (t*k + j) of priority p = j*N + t
__device__ inline int moe_choice_of_priority(int priority, int N, int k) { return (priority % N) * k + priority / N; }

__global__ void moe_slots_count_kernel(int* __restrict__ tile_counts, const int* __restrict__ expert_index, int N,
                                       int E, int k, int expert_bits) {
    __shared__ int counts[MOE_MAX_EXPERTS];
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int num_choices = N * k;  // < 2^30: moe_assign_slots_launch
    for (int e = threadIdx.x; e < E; e += blockDim.x) counts[e] = 0;
    __syncthreads();
    const int warp_base = blockIdx.x * MOE_SLOTS_ITEMS * blockDim.x + warp * 32 * MOE_SLOTS_ITEMS;
    for (int i = 0; i < MOE_SLOTS_ITEMS; i++) {
        const int priority = warp_base + i * 32 + lane;
        const bool valid = priority < num_choices;
        const int expert = valid ? expert_index[moe_choice_of_priority(priority, N, k)] : 0;
        const unsigned int peers = moe_warp_peers(expert, valid, expert_bits);
        // the lowest lane of each group of peers adds the group: integer adds, in any order the same sum
        if (valid && __ffs(peers) - 1 == lane) atomicAdd(&counts[expert], __popc(peers));
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) tile_counts[(size_t)blockIdx.x * E + e] = counts[e];
}

// One block of at least E threads (any multiple of 32, up to 1024): thread (segment, e) = (x / E, x % E) owns
// expert e's counts over one contiguous range of tiles; segment sums, their exclusive scan per expert (thread e),
// then each thread writes its range's exclusive offsets. tile_offsets (tiles, E) and first_row (E) follow the counts
// in the scratch: the counts are never overwritten, so a grid that runs only partly (the CPU backend's edge mode)
// still scans counts, never the offsets of an earlier call.
__global__ void moe_slots_scan_kernel(const int* __restrict__ tile_counts, int* __restrict__ tile_offsets,
                                      int* __restrict__ first_row,
                                      int* __restrict__ expert_count, int* __restrict__ kept_count, int num_tiles,
                                      int E, int capacity, bool packed) {
    __shared__ int segment_sums[1024];  // (segment, E), segments * E <= blockDim.x
    __shared__ int totals[MOE_MAX_EXPERTS];
    const int e = threadIdx.x % E;
    const int segment = threadIdx.x / E;
    const int num_segments = blockDim.x / E;
    const int tiles_per_segment = CEIL_DIV(num_tiles, num_segments);
    const int first_tile = segment * tiles_per_segment;
    const int end_tile = min(first_tile + tiles_per_segment, num_tiles);
    const bool active = segment < num_segments;  // the last threads when E does not divide blockDim.x
    if (active) {
        int sum = 0;
        for (int tile = first_tile; tile < end_tile; tile++) sum += tile_counts[(size_t)tile * E + e];
        segment_sums[segment * E + e] = sum;
    }
    __syncthreads();
    if (threadIdx.x < E) {
        int running = 0;
        for (int s = 0; s < num_segments; s++) {
            const int count = segment_sums[s * E + e];
            segment_sums[s * E + e] = running;
            running += count;
        }
        totals[e] = running;
        expert_count[e] = running;
        kept_count[e] = min(running, capacity);
    }
    __syncthreads();
    if (active) {
        int running = segment_sums[segment * E + e];
        for (int tile = first_tile; tile < end_tile; tile++) {
            tile_offsets[(size_t)tile * E + e] = running;
            running += tile_counts[(size_t)tile * E + e];
        }
    }
    if (threadIdx.x < E) {
        int below = 0;  // packed rows are at most N*k < 2^30
        if (packed) {
            for (int other = 0; other < e; other++) below += totals[other];
        }
        first_row[e] = packed ? below : e * capacity;  // E * capacity < 2^30: moe_assign_slots_launch
    }
}

__global__ void moe_slots_assign_kernel(int* __restrict__ choice_row, int* __restrict__ row_choice,
                                        const int* __restrict__ tile_offsets, const int* __restrict__ first_row,
                                        const int* __restrict__ kept_count, const int* __restrict__ expert_index,
                                        int N, int E, int k, int expert_bits, int capacity, bool packed) {
    extern __shared__ int warp_counts[];  // (warps, E): this warp's choices of e so far, then the scan's offsets
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int num_warps = blockDim.x / 32;
    const int num_choices = N * k;
    const unsigned int lanes_below = (1u << lane) - 1u;
    for (int x = threadIdx.x; x < num_warps * E; x += blockDim.x) warp_counts[x] = 0;
    __syncthreads();
    int* my_counts = warp_counts + warp * E;
    const int warp_base = blockIdx.x * MOE_SLOTS_ITEMS * blockDim.x + warp * 32 * MOE_SLOTS_ITEMS;
    int choice[MOE_SLOTS_ITEMS], expert[MOE_SLOTS_ITEMS], rank[MOE_SLOTS_ITEMS];
    for (int i = 0; i < MOE_SLOTS_ITEMS; i++) {
        const int priority = warp_base + i * 32 + lane;
        const bool valid = priority < num_choices;
        choice[i] = valid ? moe_choice_of_priority(priority, N, k) : -1;
        expert[i] = valid ? expert_index[choice[i]] : 0;
        const unsigned int peers = moe_warp_peers(expert[i], valid, expert_bits);
        // the group's lowest lane alone reads and advances its expert's count, and hands the old one to its peers
        const int leader = valid ? __ffs(peers) - 1 : lane;
        int before = 0;
        if (valid && leader == lane) {
            before = my_counts[expert[i]];
            my_counts[expert[i]] = before + __popc(peers);
        }
        before = __shfl_sync(0xffffffff, before, leader);
        rank[i] = before + __popc(peers & lanes_below);
    }
    __syncthreads();
    // per expert, the warps' counts become offsets from the tile's first slot of e
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int running = tile_offsets[(size_t)blockIdx.x * E + e];
        for (int w = 0; w < num_warps; w++) {
            const int count = warp_counts[w * E + e];
            warp_counts[w * E + e] = running;
            running += count;
        }
    }
    __syncthreads();
    for (int i = 0; i < MOE_SLOTS_ITEMS; i++) {
        if (choice[i] < 0) continue;
        const int s = my_counts[expert[i]] + rank[i];
        const int row = s < capacity ? first_row[expert[i]] + s : -1;
        choice_row[choice[i]] = row;
        if (row >= 0) row_choice[row] = choice[i];
    }
    if (!packed) {
        const int num_rows = E * capacity;
        for (int row = blockIdx.x * blockDim.x + threadIdx.x; row < num_rows; row += gridDim.x * blockDim.x) {
            if (row % capacity >= kept_count[row / capacity]) row_choice[row] = -1;
        }
    }
}

// ----------------------------------------------------------------------------------------------------
// host side

// the bits of the largest expert index E - 1 (0 for E = 1): what moe_warp_peers compares
static int moe_expert_bits(int E) {
    int bits = 0;
    while ((1 << bits) < E) bits++;
    return bits;
}

// ints of scratch moe_assign_slots_launch needs with this block size: the count of each expert in each tile of
// MOE_SLOTS_ITEMS * block_size choices, their offsets, then the experts' first rows
size_t moe_assign_slots_launch_scratch_size(int N, int E, int k, int block_size) {
    const size_t tiles = CEIL_DIV((size_t)N * k, (size_t)MOE_SLOTS_ITEMS * block_size);
    return (2 * tiles + 1) * E;  // counts and offsets (tiles, E) each, first rows (E)
}

// ints of scratch moe_assign_slots needs
size_t moe_assign_slots_scratch_size(int N, int E, int k) {
    return moe_assign_slots_launch_scratch_size(N, E, k, MOE_SLOTS_BLOCK_SIZE);
}

void moe_assign_slots_launch(int* choice_row, int* row_choice, int* expert_count, int* kept_count, int* scratch,
                             const int* expert_index, int N, int E, int k, int capacity, bool packed, int block_size,
                             cudaStream_t stream) {
    moe_require(N >= 1 && E >= 1 && E <= MOE_MAX_EXPERTS && k >= 1 && k <= E, "moe_assign_slots",
                "needs N >= 1 and 1 <= k <= E <= 256 (see moe_support)");
    moe_require(capacity >= 1, "moe_assign_slots", "capacity must be >= 1 rows (use moe_capacity; dropless = N)");
    moe_require(!packed || capacity == N, "moe_assign_slots", "the packed layout is for dropless routing (capacity N)");
    moe_require(block_size >= 32 && block_size <= 1024 && block_size % 32 == 0, "moe_assign_slots",
                "block size must be a multiple of 32, at most 1024");
    // choices and rows are int indices (choice_row, row_choice); 2^30 leaves a tile's headroom past the last one
    moe_require((size_t)N * k < (1u << 30) && (size_t)E * capacity < (1u << 30), "moe_assign_slots",
                "needs N*k < 2^30 choices and E*capacity < 2^30 rows (int indices)");
    const int tiles = (int)CEIL_DIV((size_t)N * k, (size_t)MOE_SLOTS_ITEMS * block_size);
    const int expert_bits = moe_expert_bits(E);
    int* tile_counts = scratch;                        // (tiles, E)
    int* tile_offsets = scratch + (size_t)tiles * E;   // (tiles, E)
    int* first_row = scratch + 2 * (size_t)tiles * E;  // (E)
    moe_slots_count_kernel<<<tiles, block_size, 0, stream>>>(tile_counts, expert_index, N, E, k, expert_bits);
    cudaCheck(cudaGetLastError());
    moe_slots_scan_kernel<<<1, MOE_SLOTS_SCAN_BLOCK_SIZE, 0, stream>>>(tile_counts, tile_offsets, first_row,
                                                                       expert_count, kept_count, tiles, E, capacity,
                                                                       packed);
    cudaCheck(cudaGetLastError());
    const size_t shared = (size_t)(block_size / 32) * E * sizeof(int);  // <= 32 KiB
    moe_slots_assign_kernel<<<tiles, block_size, shared, stream>>>(choice_row, row_choice, tile_offsets, first_row,
                                                                   kept_count, expert_index, N, E, k, expert_bits,
                                                                   capacity, packed);
    cudaCheck(cudaGetLastError());
}

// expert_index (N, k) -> choice_row (N, k) (-1: dropped), row_choice (R) (-1: padding row), expert_count (E) =
// choices routed to e before dropping, kept_count (E) = rows of e used. Padded layout: R = E * capacity; packed
// (dropless, capacity = N): R = N * k. scratch: moe_assign_slots_scratch_size(N, E, k) ints.
void moe_assign_slots(int* choice_row, int* row_choice, int* expert_count, int* kept_count, int* scratch,
                      const int* expert_index, int N, int E, int k, int capacity, bool packed, cudaStream_t stream) {
    moe_assign_slots_launch(choice_row, row_choice, expert_count, kept_count, scratch, expert_index, N, E, k,
                            capacity, packed, MOE_SLOTS_BLOCK_SIZE, stream);
}
