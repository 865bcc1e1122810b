// dev/cuda/moe_slots.cu: kernel lab for the MoE slot assignment: given each token's k experts, the slot of every
// choice in its expert's queue in priority order (every first choice in token order, then every second choice,
// ...), dropped (-1) when the expert's `capacity` rows are full, and the choice's row in the expert buffer
// (choice_row) in the padded layout (expert e's rows from e*capacity) or the packed dropless one (expert e's rows
// after the choices of the experts below e); the inverse map row_choice (-1 for padding rows); expert_count
// (choices routed to e before dropping) and kept_count (rows used). Also checks moe_capacity against values the
// PyTorch formula gives. doc/moe.md; the layouts: llmc/moe_common.cuh.
// Build and run on the CPU backend (small sizes):
//   make build/lab/moe_slots_bf16   (build/lab/moe_slots_fp32: the fp32 build)
//   build/lab/moe_slots_bf16 -s          (the kernels move ints: the fp32 build is the same)
// On a GPU: nvcc -std=c++17 -O3 --use_fast_math -arch=sm_90 -I. dev/cuda/moe_slots.cu -o moe_slots
//   ./moe_slots [variant] [-s]   (default: production sizes N = 65536 tokens, E = 8 and 64 with k = 1, 2, 8 at
//                                 CF 1.25, and k = 2 dropless packed; -s: N = 69, E = 4, k = 1 and 2 at CF 0.5
//                                 (drops, tokens with every choice dropped), dropless packed (k = 1, 2) and dropless
//                                 padded (k = 2); N = 300 with E = 40 and 200 (several tiles, experts of 6 and 8
//                                 bits, an E that divides no block), E = 1)
// Variants:
//   1  one block per expert scans the N*k choices in priority order, a ballot per warp and the warps' counts in
//      shared memory giving each choice its prefix count (packed: a first pass counts the choices of the lower
//      experts). The baseline for the tiled kernel: E blocks (8 of an H100's 132 SMs at E = 8), each reading all N*k
//      choices.
//   2  one block, two passes: each thread counts, per expert, the choices of its contiguous segment of the
//      priority order; thread e scans expert e's counts over the threads; each thread then walks its segment
//      again handing out rows from its offsets. Shared memory (E, threads) ints: small E only; padded layout only.
//   3  llmc/moe_slots.cuh moe_assign_slots: tiles of the priority order, one block each: per-tile counts, one block
//      scans them over the tiles, then each tile hands out its slots (warp peer masks, a scan over the warps).
//      N*k / 512 blocks. The trainer's.
// Floor (see llmc/moe_slots.cuh): DRAM bytes = N*k*4 (read) + N*k*4 + R*4 + 8*E (written), R = the buffer's rows;
// variant 1 also reads expert_index E times (2E packed) from L2, variant 3 twice.
#include "common.h"
#include "../../llmc/moe_slots.cuh"
#include "moe_reference.h"

// The per-expert baseline for the tiled kernel of llmc/moe_slots.cuh: one block per expert e walks the
// N*k choices in priority order, SLOTS_ITEMS * blockDim.x at a time (thread x takes base + i*blockDim.x + x);
// a ballot per warp and item, and the warps' counts in shared memory, give each choice of e its exclusive prefix
// count = its slot. Only block e writes the choices and rows of e. Packed layout: first_row = the choices routed
// to the experts below e, counted by the block in a first pass.
#define SLOTS_ITEMS 4
__global__ void slots_block_per_expert_kernel(int* choice_row, int* row_choice, int* expert_count, int* kept_count,
                                              const int* expert_index, int N, int k, int capacity, bool packed) {
    __shared__ int warp_counts[SLOTS_ITEMS * 32];  // (item, warp): choices of this expert
    const int expert = blockIdx.x;
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int num_warps = blockDim.x / 32;
    const int num_choices = N * k;
    const unsigned int lanes_below = (1u << lane) - 1u;
    int first_row = expert * capacity;
    if (packed) {
        first_row = 0;
        for (int base = 0; base < num_choices; base += blockDim.x) {
            const int choice = base + threadIdx.x;
            first_row += __syncthreads_count(choice < num_choices && expert_index[choice] < expert);
        }
    }
    int routed = 0;  // choices of this expert in priority order so far
    for (int base = 0; base < num_choices; base += SLOTS_ITEMS * blockDim.x) {
        int choice[SLOTS_ITEMS];
        bool mine[SLOTS_ITEMS];
        for (int i = 0; i < SLOTS_ITEMS; i++) {
            const int priority = base + i * blockDim.x + threadIdx.x;
            choice[i] = priority < num_choices ? (priority % N) * k + priority / N : -1;
            mine[i] = choice[i] >= 0 && expert_index[choice[i]] == expert;
        }
        unsigned int ballot[SLOTS_ITEMS];
        for (int i = 0; i < SLOTS_ITEMS; i++) {
            ballot[i] = __ballot_sync(0xffffffff, mine[i]);
            if (lane == 0) warp_counts[i * 32 + warp] = __popc(ballot[i]);
        }
        __syncthreads();
        // before = choices of e earlier in priority order: earlier items, then earlier warps of this item
        int before = routed;
        for (int i = 0; i < SLOTS_ITEMS; i++) {
            int item_total = 0, earlier_warps = 0;
            for (int w = 0; w < num_warps; w++) {
                const int count = warp_counts[i * 32 + w];
                if (w < warp) earlier_warps += count;
                item_total += count;
            }
            if (mine[i]) {
                const int s = before + earlier_warps + __popc(ballot[i] & lanes_below);
                choice_row[choice[i]] = s < capacity ? first_row + s : -1;
                if (s < capacity) row_choice[first_row + s] = choice[i];
            }
            before += item_total;
        }
        routed = before;
        __syncthreads();  // warp_counts is rewritten by the next chunk
    }
    const int kept_rows = routed < capacity ? routed : capacity;
    if (!packed) {
        for (int row = kept_rows + threadIdx.x; row < capacity; row += blockDim.x) {
            row_choice[(size_t)expert * capacity + row] = -1;
        }
    }
    if (threadIdx.x == 0) {
        expert_count[expert] = routed;
        kept_count[expert] = kept_rows;
    }
}

__global__ void slots_single_block_kernel(int* choice_row, int* row_choice, int* expert_count, int* kept_count,
                                          const int* expert_index, int N, int E, int k, int capacity) {
    extern __shared__ int offsets[];  // (E, blockDim.x): choices of e before this thread's segment, then running
    const int num_choices = N * k;
    const int segment = CEIL_DIV(num_choices, (int)blockDim.x);
    const int begin = threadIdx.x * segment;
    const int end = begin + segment < num_choices ? begin + segment : num_choices;
    for (int e = 0; e < E; e++) offsets[e * blockDim.x + threadIdx.x] = 0;
    for (int priority = begin; priority < end; priority++) {
        const int choice = (priority % N) * k + priority / N;
        offsets[expert_index[choice] * blockDim.x + threadIdx.x]++;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int running = 0;
        for (int thread = 0; thread < (int)blockDim.x; thread++) {
            const int count = offsets[e * blockDim.x + thread];
            offsets[e * blockDim.x + thread] = running;
            running += count;
        }
        expert_count[e] = running;
        kept_count[e] = running < capacity ? running : capacity;
        for (int row = kept_count[e]; row < capacity; row++) row_choice[(size_t)e * capacity + row] = -1;
    }
    __syncthreads();
    for (int priority = begin; priority < end; priority++) {
        const int choice = (priority % N) * k + priority / N;
        const int e = expert_index[choice];
        const int s = offsets[e * blockDim.x + threadIdx.x]++;
        choice_row[choice] = s < capacity ? e * capacity + s : -1;
        if (s < capacity) row_choice[(size_t)e * capacity + s] = choice;
    }
}

struct SlotBuffers {
    int* expert_index;
    int* choice_row;
    int* row_choice;
    int* expert_count;
    int* kept_count;
    int* scratch;  // variant 3: moe_assign_slots_launch_scratch_size ints for the smallest block size
};

static const int LLMC_BLOCK_SIZE = 0;  // variant 3: run moe_assign_slots itself, with its block size

static size_t single_block_shared_bytes(int E, int block_size) { return (size_t)E * block_size * sizeof(int); }

static void run_variant(int variant, const SlotBuffers* d, int N, int E, int k, int capacity, bool packed,
                        int block_size) {
    if (variant == 1) {
        slots_block_per_expert_kernel<<<E, block_size>>>(d->choice_row, d->row_choice, d->expert_count, d->kept_count,
                                                         d->expert_index, N, k, capacity, packed);
        cudaCheck(cudaGetLastError());
    } else if (variant == 2) {
        slots_single_block_kernel<<<1, block_size, single_block_shared_bytes(E, block_size)>>>(
            d->choice_row, d->row_choice, d->expert_count, d->kept_count, d->expert_index, N, E, k, capacity);
        cudaCheck(cudaGetLastError());
    } else if (block_size == LLMC_BLOCK_SIZE) {
        moe_assign_slots(d->choice_row, d->row_choice, d->expert_count, d->kept_count, d->scratch, d->expert_index, N,
                         E, k, capacity, packed, 0);
    } else {
        moe_assign_slots_launch(d->choice_row, d->row_choice, d->expert_count, d->kept_count, d->scratch,
                                d->expert_index, N, E, k, capacity, packed, block_size, 0);
    }
}

// moe_capacity against math.ceil(k * cf * N / E) as Python evaluates it (values printed by python3), the
// dropless rule and the clamp to N. 80, 8, 1, 1.1 is 11 in double; the float 1.1f would give 12.
static void check_capacity(void) {
    struct CapacityCase { int N, E, k; double cf; int want; };
    const CapacityCase cases[] = {{69, 4, 1, 0.5, 9},        {69, 4, 2, 0.5, 18},   {8192, 8, 1, 1.25, 1280},
                                  {8192, 8, 2, 1.25, 2560},  {80, 8, 1, 1.1, 11},   {69, 4, 2, 0.0, 69},
                                  {69, 4, 1, -1.0, 69},      {69, 4, 2, 3.0, 69},   {1, 8, 1, 1e-6, 1}};
    for (const CapacityCase& c : cases) {
        const int got = moe_capacity(c.N, c.E, c.k, c.cf);
        if (got != c.want) {
            printf("FAIL moe_capacity(N=%d, E=%d, k=%d, cf=%g) = %d, want %d\n", c.N, c.E, c.k, c.cf, got, c.want);
            exit(EXIT_FAILURE);
        }
    }
    printf("  %-28s ok (%zu cases)\n", "moe_capacity", sizeof(cases) / sizeof(cases[0]));
}

int main(int argc, char** argv) {
    LabArgs args = lab_parse_args(argc, argv);
    struct Case { int N, E, k; double cf; bool packed; };
    const Case full_cases[] = {{65536, 8, 1, 1.25, false},  {65536, 8, 2, 1.25, false},  {65536, 8, 8, 1.25, false},
                               {65536, 64, 1, 1.25, false}, {65536, 64, 2, 1.25, false}, {65536, 64, 8, 1.25, false},
                               {65536, 8, 2, 0.0, true}};
    // 300 tokens: several tiles at block 64 (128 choices a tile) and at the llmc block size for k = 3; E = 40 and
    // 200 have 6 and 8 bits of expert index and divide neither the scan's block nor a warp (CF 2 at E = 200: a
    // capacity of 6, full low experts beside padded high ones); E = 1 has no bits at all
    const Case small_cases[] = {{69, 4, 1, 0.5, false},   {69, 4, 2, 0.5, false},    {69, 4, 1, 0.0, true},
                                {69, 4, 2, 0.0, true},    {69, 4, 2, 0.0, false},    {300, 40, 3, 0.5, false},
                                {300, 200, 3, 0.0, true}, {300, 200, 2, 2.0, false}, {300, 1, 1, 0.5, false}};
    const Case* cases = args.small ? small_cases : full_cases;
    const int num_cases = args.small ? (int)(sizeof(small_cases) / sizeof(small_cases[0]))
                                     : (int)(sizeof(full_cases) / sizeof(full_cases[0]));
    const int block_sizes[] = {128, 256, 512, 1024};
    const int repeats = args.small || lab_on_cpu_backend() ? 3 : 100;  // CPU-backend times are only indicative

    printf("moe_slots (%s build; ints only)\n", PRECISION_NAME);
    check_capacity();
    for (int c = 0; c < num_cases; c++) {
        const int N = cases[c].N, E = cases[c].E, k = cases[c].k;
        const int capacity = moe_capacity(N, E, k, cases[c].cf);
        const bool packed = cases[c].packed;
        const size_t num_choices = (size_t)N * k, num_rows = packed ? num_choices : (size_t)E * capacity;
        std::vector<int> expert_index = moe_skewed_routing(N, E, k);
        const MoeSlots want = moe_slots_reference(expert_index, N, E, k, capacity, packed);
        const std::vector<float> choice_row = lab_as_floats(want.choice_row), row_choice = lab_as_floats(want.row_choice);
        const std::vector<float> expert_count = lab_as_floats(want.expert_count), kept_count = lab_as_floats(want.kept_count);
        int dropped = 0, tokens_all_dropped = 0;
        for (int t = 0; t < N; t++) {
            int kept = 0;
            for (int j = 0; j < k; j++) kept += choice_row[(size_t)t * k + j] >= 0.0f;
            dropped += k - kept;
            tokens_all_dropped += kept == 0;
        }
        printf("N=%d E=%d k=%d CF=%g %s: capacity %d, %d of %zu choices dropped, %d tokens with every choice dropped\n",
               N, E, k, cases[c].cf, packed ? "packed" : "padded", capacity, dropped, num_choices, tokens_all_dropped);
        // the small capacity-limited cases exist to exercise drops: fail if the inputs stopped doing so
        if (args.small && cases[c].cf > 0.0 && tokens_all_dropped == 0) {
            printf("FAIL: the inputs drop no token entirely\n");
            exit(EXIT_FAILURE);
        }

        SlotBuffers d;
        d.expert_index = lab_ints_to_device(expert_index);
        d.choice_row = lab_poisoned<int>(num_choices);
        d.row_choice = lab_poisoned<int>(num_rows);
        d.expert_count = lab_poisoned<int>(E);
        d.kept_count = lab_poisoned<int>(E);
        const size_t scratch_ints = moe_assign_slots_launch_scratch_size(N, E, k, 32);
        const bool single_block_fits = single_block_shared_bytes(E, 1024) <= 48 * 1024;
        // several block sizes: the llmc choice, 64 threads (several tiles at -s), 1024 (one warp's worth of items
        // past the choices at -s)
        const int validation_block_sizes[] = {LLMC_BLOCK_SIZE, 64, 1024};
        for (int variant = 1; variant <= 3; variant++) {
            if (args.variant != 0 && args.variant != variant) continue;
            if (variant == 2 && (!single_block_fits || packed)) continue;
            for (int block_size : validation_block_sizes) {
                if (variant != 3 && block_size == LLMC_BLOCK_SIZE) continue;
                // 0x7f7f7f7f, not 0xff bytes: those read as -1, a valid slot and row_choice
                cudaCheck(cudaMemset(d.choice_row, 0x7f, num_choices * sizeof(int)));
                cudaCheck(cudaMemset(d.row_choice, 0x7f, num_rows * sizeof(int)));
                cudaCheck(cudaMemset(d.expert_count, 0x7f, E * sizeof(int)));
                cudaCheck(cudaMemset(d.kept_count, 0x7f, E * sizeof(int)));
                // fresh scratch, never written: a checked build reports any read of it before the kernels write it
                cudaCheck(cudaMalloc(&d.scratch, scratch_ints * sizeof(int)));
                run_variant(variant, &d, N, E, k, capacity, packed, block_size);
                cudaCheck(cudaDeviceSynchronize());
                cudaCheck(cudaFree(d.scratch));
                printf("variant %d, block %d%s\n", variant, block_size, block_size == LLMC_BLOCK_SIZE ? " (llmc's)" : "");
                lab_validate("choice_row", d.choice_row, choice_row.data(), num_choices, 0.0f, 0.0f);
                lab_validate("row_choice", d.row_choice, row_choice.data(), num_rows, 0.0f, 0.0f);
                lab_validate("expert_count", d.expert_count, expert_count.data(), E, 0.0f, 0.0f);
                lab_validate("kept_count", d.kept_count, kept_count.data(), E, 0.0f, 0.0f);
            }
        }

        char sizes[96];
        snprintf(sizes, sizeof(sizes), "N=%d E=%d k=%d capacity=%d %s", N, E, k, capacity, packed ? "packed" : "padded");
        lab_print_header("moe_slots", sizes);
        const double bytes = 8.0 * num_choices + 4.0 * num_rows + 8.0 * E;
        cudaCheck(cudaMalloc(&d.scratch, scratch_ints * sizeof(int)));
        for (int variant = 1; variant <= 3; variant++) {
            if (args.variant != 0 && args.variant != variant) continue;
            if (variant == 2 && (!single_block_fits || packed)) continue;
            for (int block_size : block_sizes) {
                float ms = lab_time_ms(repeats, [&]() { run_variant(variant, &d, N, E, k, capacity, packed, block_size); });
                lab_print_row(variant, block_size, ms, bytes, 0.0);
            }
        }
        cudaCheck(cudaFree(d.expert_index));
        cudaCheck(cudaFree(d.choice_row));
        cudaCheck(cudaFree(d.row_choice));
        cudaCheck(cudaFree(d.expert_count));
        cudaCheck(cudaFree(d.kept_count));
        cudaCheck(cudaFree(d.scratch));
    }
    return 0;
}
