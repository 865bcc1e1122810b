// llmc/moe_common.cuh: what the Switch-Transformer MoE layer's kernels share: the shapes and the expert buffer's two
// layouts (below), the size limits (moe_support), the capacity (moe_capacity), the block sizes, and the refusals of
// a call that breaks them. The kernels are one header each: the router (llmc/moe_router.cuh), the slot assignment
// (moe_slots.cuh), dispatch and combine (moe_dispatch_combine.cuh), the router's losses (moe_losses.cuh) and
// aux-loss-free balancing (moe_balance.cuh); the semantics are doc/moe.md's; the router GEMM and the expert FFN
// (batched or grouped GEMMs over E: llmc/expert_matmul.cuh) are not here.
// Each of those headers includes this one and names its lab and its tests.
//
// Shapes (N = B*T tokens of one micro-batch, E experts, k = top-k, C channels, R = rows of the expert buffer):
//   logits, probs, d_logits (N, E) fp32          logsumexp (N) fp32
//   expert_index, choice_row (N, k) int           gates, d_gates (N, k) fp32
//   row_choice (R) int                            expert_count, kept_count (E) int
//   x, out, dout, dx (N, C) floatX                expert_input, expert_output and their gradients (R, C) floatX
//   scratch of the slot assignment and of the losses: moe_assign_slots_scratch_size ints, moe_router_losses_partials_size
//   floats (the caller's, so that no call allocates)
// A "choice" (t, j) is the j-th expert of token t, flattened as t*k + j. The expert buffer holds one row per kept
// choice, grouped by expert in expert order, in one of two layouts:
//   padded (a capacity limit): expert e owns rows [e*cap, (e+1)*cap), R = E*cap; the rows past its kept choices
//     are padding (zeros in expert_input), so that the experts run as one batched GEMM of equal shapes;
//   packed (dropless): expert e owns rows [offset_e, offset_e + count_e), offset_e = the choices routed to experts
//     below e, R = N*k, no padding: the experts run as one grouped GEMM of their exact row counts.
// choice_row[t, j] is the choice's row, or -1 when it was dropped; row_choice is the inverse map, the choice in
// each row or -1 for padding; together they let every kernel gather (one writer per output element, no
// scatter-add, no atomics). `capacity` is always what moe_capacity() returns (>= 1; dropless routing is
// capacity = N, which no expert can exceed since a token's k experts are distinct).
// Sizes supported (moe_support): C a multiple of 8 (16-byte vectors of a row), 1 <= E <= 256 (a warp holds a
// token's logits in 8 registers per lane), 1 <= k <= min(E, 32) (lane j keeps the j-th pick).
// Index arithmetic: element offsets into (N, E), (N, C) and (R, C) arrays are size_t (N*C, R*C pass 2^31 at
// production sizes: R = N*k rows dropless, times C); choice and row indices are int, which moe_assign_slots_launch
// bounds (N*k < 2^30 choices, E*capacity < 2^30 rows) for every kernel after it: at N = 65536 tokens, k = 32 and
// E = 256 they are 2^21 and at most 2^24. Grids are at most max(R, N*k) / 8 blocks of warps.
// Tests: those of the five kernel headers (moe-* and check-moe-* hold the whole layer to PyTorch).
#pragma once
#include <limits.h>
#include <math.h>
#include "common.cuh"

#define MOE_MAX_EXPERTS 256
#define MOE_MAX_TOP_K 32
#define MOE_WARP_KERNEL_BLOCK_SIZE 256   // warp-per-item kernels: 8 items per block
#define MOE_SLOTS_BLOCK_SIZE 256         // slot count and assign passes: a tile of 512 choices per block
#define MOE_SLOTS_ITEMS 2                // choices per thread in a tile of the slot passes
#define MOE_SLOTS_SCAN_BLOCK_SIZE 1024   // the slot scan's one block: 1024 / E threads share each expert's tiles
#define MOE_LOSSES_BLOCK_SIZE 256        // the losses' first pass
#define MOE_LOSSES_MAX_BLOCKS 512        // its grid at most: the partials scratch holds 2 floats per block

// the router's score functions (doc/moe.md; model-file header word 27)
#define MOE_SCORE_SOFTMAX 0
#define MOE_SCORE_SIGMOID 1

// a group's score in grouped routing (doc/moe.md, "Routing options" 9 and 11)
#define MOE_GROUP_MAX_KEY 0    // device-limited routing (-dl): the largest key among the group's experts
#define MOE_GROUP_TOP2_SUM 1   // the model's expert groups (DeepSeek-V3): the sum of the two largest affinity + bias

// ----------------------------------------------------------------------------------------------------
// host side

// Rows per expert buffer: ceil(k * CF * N / E), evaluated in double as ((k * CF) * N) / E so that the PyTorch
// reference (math.ceil(k * cf * N / E) with the same decimal cf) gets the same integer; CF is a double for the
// same reason (a float 1.1 is not the double 1.1). An expert receives at most N choices (a token's k experts are
// distinct), so the result is clamped to N, and CF <= 0 (dropless) gives N: every choice fits.
int moe_capacity(int N, int E, int k, double capacity_factor) {
    if (capacity_factor <= 0.0) return N;
    const double rows = ceil((double)k * capacity_factor * (double)N / (double)E);
    return rows < (double)N ? (int)rows : N;
}

// The sizes these kernels support; false with a one-line reason otherwise. Called by the trainer at start-up.
bool moe_support(int C, int E, int k, int H, char* why, size_t why_size) {
    if (C <= 0 || C % 8 != 0) {
        snprintf(why, why_size, "C = %d: the MoE dispatch and combine kernels need C a positive multiple of 8 "
                 "(16-byte vectors of 8 bf16)", C);
        return false;
    }
    if (E < 1 || E > MOE_MAX_EXPERTS) {
        snprintf(why, why_size, "E = %d experts: the router kernels hold a token's logits in one warp, "
                 "1 <= E <= %d", E, MOE_MAX_EXPERTS);
        return false;
    }
    if (k < 1 || k > E || k > MOE_MAX_TOP_K) {
        snprintf(why, why_size, "top-k = %d: needs 1 <= k <= E (%d) and k <= %d (one lane per pick)", k, E,
                 MOE_MAX_TOP_K);
        return false;
    }
    if (H <= 0 || H % 8 != 0) {
        snprintf(why, why_size, "expert hidden size H = %d: the expert GEMMs need H a positive multiple of 8", H);
        return false;
    }
    return true;
}

// Refusals are one line and exit: these are programming errors of the caller, never data-dependent.
static void moe_require(bool condition, const char* function, const char* what) {
    if (!condition) {
        fprintf(stderr, "%s: %s\n", function, what);
        exit(EXIT_FAILURE);
    }
}

static void moe_require_aligned(const char* function, const void* a, const void* b, const void* c) {
    moe_require(((uintptr_t)a | (uintptr_t)b | (uintptr_t)c) % 16 == 0, function, "buffers must be 16-byte aligned");
}

static int moe_warp_grid(size_t warps, int block_size) { return (int)CEIL_DIV(warps, (size_t)(block_size / 32)); }
