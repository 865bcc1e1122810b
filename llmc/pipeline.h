// llmc/pipeline.h: pipeline parallelism (-pp N; doc/parallelism.md, "Pipeline parallelism"): the layers cut into
// stages, the schedules as each stage's ordered list of passes over the step's micro-batches, the process groups, the
// sends between neighbouring stages, and each pass's begin and end (the step line's idle fractions, the -ppt trace).
// The model's side (which tensors and activations a stage holds, its part of the forward and backward passes) is
// train_gpt.cu's; this header knows layers, stages and micro-batches only.
//
// Processes: rank = stage * S + i, S = P / N the processes of a stage (its tensor- and data-parallel groups, ranked
// inside the stage as without -pp). The stage's processes are its own world; the N processes with the same i, one per
// stage, form the pipeline group, over which activations go forward and their gradients back (ncclSend/ncclRecv on the
// compute stream), and the loss and the gradient norm are summed.
//
// A schedule is, per stage, the order of its forward (F) and backward (B) passes over micro-batches 0..m-1, each B in
// micro-batch order so that every schedule accumulates the gradients alike. Between two passes a stage sends what the
// first produced and receives what the second needs. When both go to the same neighbour and that neighbour, between
// two of its passes, receives the one and sends the other, the two stages exchange them in one NCCL group each
// (Megatron's send_forward_recv_backward and send_backward_recv_forward, 1F1B's steady state); every other send or
// receive is a group of its own, two with the same neighbour in the order that neighbour takes them. So each group of
// one stage meets exactly one group of its neighbour's (which cpu/cucc --check verifies), and no stage waits to send on
// a neighbour that waits on it (test_host_utils runs every schedule's groups with blocking sends and receives).
// Tests: host-utils (the schedules' invariants and the balanced cut), pipeline-cli (dev/test/test_pipeline_parallel.sh).
#pragma once
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "multi_gpu.cuh"

#define PIPELINE_MAX_STAGES 64

// the schedules, as -pps names them, with the idle fraction each leaves: its bubble over its busy time (GPipe and 1F1B
// the same, 1F1B holding fewer micro-batches' activations; ZB-H1 a third of it, at m >= p)
typedef enum { SCHEDULE_GPIPE, SCHEDULE_1F1B, SCHEDULE_INTERLEAVED, SCHEDULE_ZB, NUM_SCHEDULES } PipelineSchedule;
static const char* const pipeline_schedule_names[NUM_SCHEDULES] = {"gpipe", "1f1b", "interleaved", "zb"};
// (interleaved: v model chunks per stage, a v-th of the bubble)
static double pipeline_formula_idle(PipelineSchedule schedule, int p, int m, int v) {
    if (schedule == SCHEDULE_ZB) return (double)(p - 1) / (3.0 * m);
    return (double)(p - 1) / ((schedule == SCHEDULE_INTERLEAVED ? v : 1) * (double)m);
}
static int pipeline_schedule_number(const char* name) {
    for (int i = 0; i < NUM_SCHEDULES; i++)
        if (strcmp(name, pipeline_schedule_names[i]) == 0) return i;
    return -1;
}

// F, B (with ZB the input gradients only) and W (ZB: the layers' weight gradients, deferred)
typedef enum { PASS_FORWARD, PASS_BACKWARD, PASS_WEIGHT } PassKind;
static const char pass_letters[3] = {'F', 'B', 'W'};
typedef struct {
    PassKind kind;
    int micro;  // the micro-batch, 0..m-1
    int chunk;  // interleaved: the stage's model chunk, 0..v-1 (model chunk chunk * p + stage); else 0
} PipelinePass;

// Stage s's passes over m micro-batches, in order, into passes (2m of them; ZB 3m; interleaved 2mv). GPipe: every forward pass, then every
// backward. 1F1B: min(p-s-1, m) forward passes to fill the pipeline, then one forward and one backward in turn, then the
// backward passes left; so stage s holds at most p-s micro-batches' activations.
// ZB-H1 (Qi et al. 2024): each backward pass split into B and W, the schedule of a simulation in which every pass costs
// one unit: at each unit every stage runs, of what its inputs allow, its oldest W once p are pending, else the next B,
// else the next F while fewer than p-s micro-batches are past their F and not their B (1F1B's bound), else its oldest
// W. It takes 3m + p - 1 units for m >= p (the bubble (p-1)/(3m) of the busy time). A micro-batch's activation slot is
// held until its W, so a stage holds up to 2p - 1 (ZB-H1's accounting, which frees at B what only B reads and so stays
// at 1F1B's p, does not apply to whole slots). Stage s's passes (3m) into passes.
static int pipeline_zb_passes(int p, int s, int m, PipelinePass* passes) {
    // per stage and micro-batch the unit at whose end its F and B are done (-1: not yet)
    int* f_done = (int*)malloc_check((size_t)p * m * sizeof(int));
    int* b_done = (int*)malloc_check((size_t)p * m * sizeof(int));
    int* next = (int*)calloc(3 * (size_t)p, sizeof(int));  // per stage: next F, next B, next W (micro-batch)
    for (int i = 0; i < p * m; i++) f_done[i] = b_done[i] = -1;
    int n = 0, left = 3 * p * m;
    for (int t = 0; left > 0; t++) {
        int* chosen = (int*)malloc_check((size_t)p * sizeof(int));  // per stage: 0 F, 1 B, 2 W, -1 idle
        for (int st = 0; st < p; st++) {
            int f = next[3 * st], b = next[3 * st + 1], w = next[3 * st + 2], pending = b - w;
            int b_ready = b < m && f_done[st * m + b] >= 0 && f_done[st * m + b] <= t &&
                          (st == p - 1 || (b_done[(st + 1) * m + b] >= 0 && b_done[(st + 1) * m + b] <= t));
            int f_ready = f < m && f - b < p - st &&
                          (st == 0 || (f_done[(st - 1) * m + f] >= 0 && f_done[(st - 1) * m + f] <= t));
            chosen[st] = pending >= p ? 2 : b_ready ? 1 : f_ready ? 0 : pending > 0 ? 2 : -1;
        }
        for (int st = 0; st < p; st++) {
            if (chosen[st] < 0) continue;
            int i = next[3 * st + chosen[st]]++;
            if (chosen[st] == 0) f_done[st * m + i] = t + 1;
            if (chosen[st] == 1) b_done[st * m + i] = t + 1;
            if (st == s) passes[n++] = (PipelinePass){(PassKind)chosen[st], i, 0};
            left--;
        }
        free(chosen);
    }
    free(f_done);
    free(b_done);
    free(next);
    return n;
}

// Interleaved 1F1B (Narayanan et al. 2021, Megatron's order), m a multiple of p: the k-th forward pass of a stage is
// micro-batch (k / pv) p + k % p through chunk (k / p) % v, the k-th backward the same micro-batch through chunk
// v - 1 - (k / p) % v; (p-s-1) 2 + (v-1) p forward passes fill the pipeline (all m v of them when m = p), then one
// forward and one backward in turn, then the backward passes left. With every chunk's pass costing one unit it takes
// 2 (m v + p - 1) units: a bubble of (p-1)/(v m) of the busy time.
static PipelinePass interleaved_pass(PassKind kind, int k, int p, int v) {
    int chunk = (k / p) % v;
    return (PipelinePass){kind, (k / (p * v)) * p + k % p, kind == PASS_FORWARD ? chunk : v - 1 - chunk};
}
static int pipeline_interleaved_passes(int p, int s, int m, int v, PipelinePass* passes) {
    int n = 0, total = m * v, warmup = m == p ? total : (p - s - 1) * 2 + (v - 1) * p;
    if (warmup > total) warmup = total;
    for (int k = 0; k < warmup; k++) passes[n++] = interleaved_pass(PASS_FORWARD, k, p, v);
    for (int k = 0; k < total - warmup; k++) {
        passes[n++] = interleaved_pass(PASS_FORWARD, warmup + k, p, v);
        passes[n++] = interleaved_pass(PASS_BACKWARD, k, p, v);
    }
    for (int k = total - warmup; k < total; k++) passes[n++] = interleaved_pass(PASS_BACKWARD, k, p, v);
    return n;
}

// (passes holds 3 m v of them)
static int pipeline_passes(PipelineSchedule schedule, int p, int s, int m, int v, PipelinePass* passes) {
    if (schedule == SCHEDULE_ZB) return pipeline_zb_passes(p, s, m, passes);
    if (schedule == SCHEDULE_INTERLEAVED) return pipeline_interleaved_passes(p, s, m, v, passes);
    int n = 0, warmup = schedule == SCHEDULE_GPIPE ? m : (p - s - 1 < m ? p - s - 1 : m);
    for (int i = 0; i < warmup; i++) passes[n++] = (PipelinePass){PASS_FORWARD, i, 0};
    for (int i = 0; i < m - warmup; i++) {
        passes[n++] = (PipelinePass){PASS_FORWARD, warmup + i, 0};
        passes[n++] = (PipelinePass){PASS_BACKWARD, i, 0};
    }
    for (int i = m - warmup; i < m; i++) passes[n++] = (PipelinePass){PASS_BACKWARD, i, 0};
    return n;
}

// The most micro-batches whose activations a stage holds at once under these passes (from the forward pass of its first
// chunk to the last pass that reads them: the backward of that chunk, or with ZB the W): the activation slots it
// needs, each holding every chunk's layers. Micro-batch i uses slot i % slots (those passes run in micro-batch order,
// so the micro-batches in flight are consecutive).
static int pipeline_slots(const PipelinePass* passes, int n) {
    int held = 0, most = 0, has_w = 0;
    for (int k = 0; k < n; k++) has_w |= passes[k].kind == PASS_WEIGHT;
    PassKind release = has_w ? PASS_WEIGHT : PASS_BACKWARD;
    for (int k = 0; k < n; k++) {
        if (passes[k].chunk != 0) continue;
        held += passes[k].kind == PASS_FORWARD ? 1 : passes[k].kind == release ? -1 : 0;
        if (held > most) most = held;
    }
    return most;
}

// The layers' cut: stage s holds layers [first[s], first[s+1]), first[0] = 0, first[p] = L, at least one each.
// Balanced: the cut whose costliest stage is cheapest, a layer costing layer_cost, the first stage also first_cost (the
// embedding), the last also last_cost (the classifier and the loss); of equal cuts, the one whose last stage is
// shortest (and so on backwards).
static void pipeline_balance(int L, int p, double layer_cost, double first_cost, double last_cost, int* first) {
    // best[s][l]: the cheapest costliest stage of layers [0, l) on stages 0..s; cut[s][l] the first layer of stage s
    double* best = (double*)malloc_check((size_t)p * (L + 1) * sizeof(double));
    int* cut = (int*)malloc_check((size_t)p * (L + 1) * sizeof(int));
    for (int s = 0; s < p; s++) {
        for (int l = 0; l <= L; l++) {
            best[s * (L + 1) + l] = 1e300;
            cut[s * (L + 1) + l] = 0;
            if (l < s + 1) continue;
            if (s == 0) {
                best[l] = first_cost + l * layer_cost + (p == 1 ? last_cost : 0.0);
                continue;
            }
            for (int k = l - 1; k >= s; k--) {  // stage s holds [k, l)
                double own = (l - k) * layer_cost + (s == p - 1 ? last_cost : 0.0);
                double before = best[(s - 1) * (L + 1) + k];
                double worst = own > before ? own : before;
                if (worst < best[s * (L + 1) + l] - 1e-9 * worst) {
                    best[s * (L + 1) + l] = worst;
                    cut[s * (L + 1) + l] = k;
                }
            }
        }
    }
    first[p] = L;
    for (int s = p - 1; s > 0; s--) first[s] = cut[s * (L + 1) + first[s + 1]];
    first[0] = 0;
    free(best);
    free(cut);
}
// -ppl a,b,...: the layers per stage as given; 0 and one line naming the flag if they do not fit L and p.
static int pipeline_parse_layers(const char* list, int L, int p, int* first) {
    int n = 0, sum = 0;
    const char* at = list;
    first[0] = 0;
    while (*at) {
        char* end;
        long v = strtol(at, &end, 10);
        if (end == at || v < 1 || (*end != ',' && *end != '\0') || n >= PIPELINE_MAX_STAGES) {
            fprintf(stderr, "-ppl %s: expected the layers of each stage, each 1 or more, separated by commas\n", list);
            return 0;
        }
        sum += (int)v;
        first[++n] = sum;
        at = *end == ',' ? end + 1 : end;
    }
    if (n != p || sum != L) {
        fprintf(stderr, "-ppl %s: %d stages of %d layers in all; -pp %d over the model's %d layers expects %d stages "
                "of %d\n", list, n, sum, p, L, p, L);
        return 0;
    }
    return 1;
}

// The sends and receives. Each is an NCCL group of its own, a blocking rendezvous as on a GPU. Their order comes from
// the schedule's unit-cost replay (every pass one unit, each starting once the stage's previous pass and its input
// are done), which every process computes alike: a message's key is the unit at which the pass that takes it starts
// (ties: by that pass's stage, kind, micro-batch and chunk). A stage receives a pass's input just before the pass, and
// sends a message once the next pass it would start starts at or after the message's key (after its last pass: all
// left), every stage in key order. Both ends of each message so take the messages in one order, and the message of
// the least key not yet through has its sender and receiver at it: none waits on another that waits on it, whatever
// the schedule (test_host_utils runs every schedule's sends and receives as blocking rendezvous).
typedef struct {
    int send;  // 1: send the output of this stage's pass `pass` to stage `peer`; 0: receive pass `pass`'s input
    int peer, pass;
} PipelineOp;

// Where a pass's input comes from and its output goes (-1: none), with the pass there that sends or takes it: model
// chunk j = chunk * p + s follows chunk j - 1 and precedes chunk j + 1, on stages (j -/+ 1) % p (interleaved: the
// last stage's output goes round to the first). A forward pass takes the previous chunk's output and gives the next
// chunk its input; a backward pass takes the next chunk's input gradient and gives the previous chunk its own; a W
// neither.
static int pass_peer(int p, int v, int s, PipelinePass x, int output, PipelinePass* theirs) {
    int j = x.chunk * p + s, forward = x.kind == PASS_FORWARD;
    if (x.kind == PASS_WEIGHT) return -1;
    int other = forward == output ? j + 1 : j - 1;  // F's output and B's input are the next chunk's
    if (other < 0 || other >= p * v) return -1;
    *theirs = (PipelinePass){x.kind, x.micro, other / p};
    return other % p;
}
// the index of pass x in passes[n], or -1
static int pass_index(const PipelinePass* passes, int n, PipelinePass x) {
    for (int k = 0; k < n; k++)
        if (passes[k].kind == x.kind && passes[k].micro == x.micro && passes[k].chunk == x.chunk) return k;
    return -1;
}

// Every stage's passes (n each, passes[s * n + k]) and the unit each starts at in the unit-cost replay (start[s * n + k];
// -1 if the schedule cannot run, which pipeline_replay returns as 0).
static int pipeline_replay(const PipelinePass* passes, int p, int v, int n, int* start) {
    int* at = (int*)calloc(p, sizeof(int));
    int* clock = (int*)calloc(p, sizeof(int));
    int* end = (int*)malloc_check((size_t)p * n * sizeof(int));
    for (int i = 0; i < p * n; i++) start[i] = end[i] = -1;
    for (int progress = 1; progress;) {
        progress = 0;
        for (int s = 0; s < p; s++) {
            if (at[s] == n) continue;
            PipelinePass x = passes[s * n + at[s]], from;
            int ready = clock[s], blocked = 0;
            // its input from a neighbour, and its own earlier pass (B after F, W after B)
            int peer = pass_peer(p, v, s, x, 0, &from);
            if (peer >= 0) {
                int k = pass_index(passes + peer * n, n, from);
                if (end[peer * n + k] < 0) blocked = 1;
                else if (end[peer * n + k] > ready) ready = end[peer * n + k];
            }
            if (x.kind != PASS_FORWARD) {
                PipelinePass own = {x.kind == PASS_BACKWARD ? PASS_FORWARD : PASS_BACKWARD, x.micro, x.chunk};
                int k = pass_index(passes + s * n, n, own);
                if (k < 0 || end[s * n + k] < 0) blocked = 1;
                else if (end[s * n + k] > ready) ready = end[s * n + k];
            }
            if (blocked) continue;
            start[s * n + at[s]] = ready;
            end[s * n + at[s]] = clock[s] = ready + 1;
            at[s]++;
            progress = 1;
        }
    }
    int ok = 1;
    for (int s = 0; s < p; s++) ok &= at[s] == n;
    free(at);
    free(clock);
    free(end);
    return ok;
}

// A message's place in the order: its key, then the taking pass's stage, kind, micro-batch and chunk
typedef struct {
    int key, stage, kind, micro, chunk;
} MessageOrder;
static int message_before(MessageOrder a, MessageOrder b) {
    if (a.key != b.key) return a.key < b.key;
    if (a.stage != b.stage) return a.stage < b.stage;
    if (a.kind != b.kind) return a.kind < b.kind;
    if (a.micro != b.micro) return a.micro < b.micro;
    return a.chunk < b.chunk;
}

// Stage s's sends and receives in the schedule over m micro-batches and v chunks: into ops (at most 2n) in order, and
// for each point k (before pass k; k = n after the last) where its ops begin, op_begin[k] (op_begin[n + 1]: their
// count). Returns 0 if the schedule cannot run.
static int pipeline_ops(PipelineSchedule schedule, int p, int s, int m, int v, PipelineOp* ops, int* op_begin) {
    PipelinePass* all = (PipelinePass*)malloc_check(3 * (size_t)m * v * p * sizeof(PipelinePass));
    int n = pipeline_passes(schedule, p, 0, m, v, all);
    for (int t = 1; t < p; t++) pipeline_passes(schedule, p, t, m, v, all + t * n);
    int* start = (int*)malloc_check((size_t)p * n * sizeof(int));
    int ok = pipeline_replay(all, p, v, n, start);
    // this stage's sends, each with the order of the message (the pass that takes it), sorted
    MessageOrder* order = (MessageOrder*)malloc_check((size_t)n * sizeof(MessageOrder));
    int* sends = (int*)malloc_check((size_t)n * sizeof(int));
    int num_sends = 0;
    for (int k = 0; k < n && ok; k++) {
        PipelinePass taker;
        int peer = pass_peer(p, v, s, all[s * n + k], 1, &taker);
        if (peer < 0) continue;
        int j = pass_index(all + peer * n, n, taker);
        MessageOrder o = {start[peer * n + j], peer, taker.kind, taker.micro, taker.chunk};
        int at = num_sends++;
        while (at > 0 && message_before(o, order[at - 1])) order[at] = order[at - 1], sends[at] = sends[at - 1], at--;
        order[at] = o, sends[at] = k;
    }
    int count = 0, next_send = 0;
    for (int k = 0; k <= n; k++) {
        op_begin[k] = count;
        // sends whose key is due by pass k's start (all of them after the last pass), merged in order with k's receive
        MessageOrder mine = {k < n ? start[s * n + k] : 0x7fffffff, s, k < n ? all[s * n + k].kind : 0,
                             k < n ? all[s * n + k].micro : 0, k < n ? all[s * n + k].chunk : 0};
        PipelinePass giver;
        int from = k < n && ok ? pass_peer(p, v, s, all[s * n + k], 0, &giver) : -1;
        while (next_send < num_sends && (k == n || order[next_send].key <= mine.key)) {
            if (from >= 0 && message_before(mine, order[next_send])) {
                ops[count++] = (PipelineOp){0, from, k};
                from = -1;
            }
            ops[count++] = (PipelineOp){1, order[next_send].stage, sends[next_send]};
            next_send++;
        }
        if (from >= 0) ops[count++] = (PipelineOp){0, from, k};
    }
    op_begin[n + 1] = count;
    free(all);
    free(start);
    free(order);
    free(sends);
    return ok;
}

// The staging buffers: each pass with an output takes a free one when it ends (the lowest), which its send frees
// again. Returns how many are in use at most; staging_of[k] is pass k's (-1: no output).
static int pipeline_staging(const PipelineOp* ops, const int* op_begin, int n, int* staging_of) {
    int used = 0, most = 0;
    unsigned char* busy = (unsigned char*)calloc(n + 1, 1);
    for (int k = 0; k < n; k++) staging_of[k] = -1;
    for (int k = 0; k <= n; k++) {
        for (int i = op_begin[k]; i < op_begin[k + 1]; i++)  // the sends of this point free their buffers
            if (ops[i].send) busy[staging_of[ops[i].pass]] = 0, used--;
        if (k == n) break;
        int sent = 0;  // pass k's output, if some point sends it, takes a buffer as the pass ends
        for (int i = op_begin[k + 1]; i < op_begin[n + 1] && !sent; i++) sent = ops[i].send && ops[i].pass == k;
        if (!sent) continue;
        int b = 0;
        while (busy[b]) b++;
        busy[b] = 1, staging_of[k] = b, used++;
        if (used > most) most = used;
    }
    free(busy);
    return most;
}

// ----------------------------------------------------------------------------------------------------
// The process groups and the sends

typedef struct {
    int stages;                           // N (1: no pipeline, and nothing below is used)
    int stage;                            // this process's
    int chunks;                           // v: model chunks per stage (interleaved), else 1
    // model chunk j = c p + s (stage s's chunk c) holds layers [first_layer[j], first_layer[j + 1])
    int first_layer[PIPELINE_MAX_STAGES + 1];
    PipelineSchedule schedule;
    int seq_len;                 // -t: the attention's share of a layer's cost in the balanced cut
    MultiGpuConfig stage_world;  // this stage's processes (the world itself at -pp 1)
    MultiGpuConfig group;        // the pipeline group: one process per stage, its rank the stage (shares the world's
                                 // NCCL stream for host sums)
    cudaEvent_t reductions_issued;  // the compute stream's sends wait for the NCCL stream's reductions (GroupComm)
    // a step's passes, the sends and receives between them, and the passes' events (the trace and the idle fractions)
    PipelinePass* passes;
    PipelineOp* ops;
    int* op_begin;  // point k's ops: ops[op_begin[k] .. op_begin[k + 1])
    // a pass's output waits for its send in a staging buffer of its own (the pass's activation slot may take the next
    // micro-batch's before the send is due): the most outputs waiting at once, and each output's buffer
    int staging_buffers;
    int* staging_of;  // per pass: its buffer, or -1 (no output)
    int num_passes, slots, micro_batches;
    cudaEvent_t start, finish, *begin, *end;
    const char* trace_path;  // -ppt: the step's passes, every rank's, written here after each step
} Pipeline;

static void pipeline_none(Pipeline* pp, const MultiGpuConfig* world) {
    memset(pp, 0, sizeof(*pp));
    pp->stages = 1;
    pp->chunks = 1;
    pp->stage_world = *world;
    pp->stage_world.used_mpi = 0;  // MPI belongs to the world's config
}

// Collective over the world, N dividing its process count (checked by the caller): N stages of P/N processes each.
static void pipeline_init(Pipeline* pp, const MultiGpuConfig* world, int stages) {
    pipeline_none(pp, world);
    if (stages == 1) return;
    int S = world->num_processes / stages;
    pp->stages = stages;
    pp->stage = world->process_rank / S;
    ncclComm_t stage_comm;
    pp->group = *world;
    pp->group.used_mpi = 0;
    multi_gpu_split_groups(world, S, &stage_comm, &pp->group);
    pp->stage_world.nccl_comm = stage_comm;
    pp->stage_world.process_rank = world->process_rank % S;
    pp->stage_world.num_processes = S;
    cudaCheck(cudaEventCreateWithFlags(&pp->reductions_issued, cudaEventDisableTiming));
}

// The memory plan's layout (-pm): stage 0 of N, of max(P/N, 1) processes. Nothing is sent or allocated.
static void pipeline_plan(Pipeline* pp, const MultiGpuConfig* world, int stages) {
    pipeline_none(pp, world);
    pp->stages = stages;
    pp->stage_world.num_processes = world->num_processes / stages > 0 ? world->num_processes / stages : 1;
    pp->stage_world.process_rank = 0;
}

static void pipeline_free(Pipeline* pp) {
    if (pp->stages == 1 || pp->group.nccl_comm == NULL) return;
    ncclCheck(ncclCommDestroy(pp->stage_world.nccl_comm));
    ncclCheck(ncclCommDestroy(pp->group.nccl_comm));
    cudaCheck(cudaEventDestroy(pp->reductions_issued));
    for (int k = 0; k < pp->num_passes; k++) {
        cudaCheck(cudaEventDestroy(pp->begin[k]));
        cudaCheck(cudaEventDestroy(pp->end[k]));
    }
    if (pp->num_passes) {
        cudaCheck(cudaEventDestroy(pp->start));
        cudaCheck(cudaEventDestroy(pp->finish));
    }
    free(pp->passes);
    free(pp->ops);
    free(pp->op_begin);
    free(pp->staging_of);
    free(pp->begin);
    free(pp->end);
}

static int pipeline_first_stage(const Pipeline* pp) { return pp->stage == 0; }
static int pipeline_last_stage(const Pipeline* pp) { return pp->stage == pp->stages - 1; }

// This stage's passes for m micro-batches (once per run: every step has the same m) and their events.
static void pipeline_prepare(Pipeline* pp, int m) {
    pp->micro_batches = m;
    pp->passes = (PipelinePass*)malloc_check(3 * (size_t)m * pp->chunks * sizeof(PipelinePass));
    pp->num_passes = pipeline_passes(pp->schedule, pp->stages, pp->stage, m, pp->chunks, pp->passes);
    pp->slots = pipeline_slots(pp->passes, pp->num_passes);
    pp->ops = (PipelineOp*)malloc_check(2 * (size_t)pp->num_passes * sizeof(PipelineOp));
    pp->op_begin = (int*)malloc_check((pp->num_passes + 2) * sizeof(int));
    pipeline_ops(pp->schedule, pp->stages, pp->stage, m, pp->chunks, pp->ops, pp->op_begin);
    pp->staging_of = (int*)malloc_check(pp->num_passes * sizeof(int));
    pp->staging_buffers = pipeline_staging(pp->ops, pp->op_begin, pp->num_passes, pp->staging_of);
    pp->begin = (cudaEvent_t*)malloc_check(pp->num_passes * sizeof(cudaEvent_t));
    pp->end = (cudaEvent_t*)malloc_check(pp->num_passes * sizeof(cudaEvent_t));
    for (int k = 0; k < pp->num_passes; k++) {
        cudaCheck(cudaEventCreate(&pp->begin[k]));
        cudaCheck(cudaEventCreate(&pp->end[k]));
    }
    cudaCheck(cudaEventCreate(&pp->start));
    cudaCheck(cudaEventCreate(&pp->finish));
}

// One NCCL group: send `count` values of `send` to stage `send_to` (-1: none), receive `count` into `recv` from stage
// `recv_from` (-1: none), on the compute stream after the NCCL stream's reductions so far (GroupComm's rule).
static void pipeline_exchange(Pipeline* pp, const floatX* send, int send_to, floatX* recv, int recv_from, size_t count,
                              cudaStream_t stream) {
    if (send_to < 0 && recv_from < 0) return;
    cudaCheck(cudaEventRecord(pp->reductions_issued, pp->group.nccl_stream));
    cudaCheck(cudaStreamWaitEvent(stream, pp->reductions_issued, 0));
    ncclCheck(ncclGroupStart());
    if (send_to >= 0) ncclCheck(ncclSend(send, count, nccl_floatX(), send_to, pp->group.nccl_comm, stream));
    if (recv_from >= 0) ncclCheck(ncclRecv(recv, count, nccl_floatX(), recv_from, pp->group.nccl_comm, stream));
    ncclCheck(ncclGroupEnd());
}
// Point k of the schedule (before pass k): its sends, each of the output of an earlier pass (`outputs`, this stage's
// passes' outputs by index), and the receive of pass k's input into `input`, each a group of its own, in order
static void pipeline_point(Pipeline* pp, int k, floatX* const* outputs, floatX* input, size_t count,
                           cudaStream_t stream) {
    for (int i = pp->op_begin[k]; i < pp->op_begin[k + 1]; i++) {
        const PipelineOp* o = &pp->ops[i];
        if (o->send) pipeline_exchange(pp, outputs[o->pass], o->peer, NULL, -1, count, stream);
        else pipeline_exchange(pp, NULL, -1, input, o->peer, count, stream);
    }
}

// The sum over the stages of n values on the device, in place, on the compute stream after the NCCL stream's
// reductions so far (as the sends): a set that every stage holds whole, each stage's part of its gradient (the
// fine-tuning adapter's). Collective over the pipeline group.
static void pipeline_sum(Pipeline* pp, floatX* values, size_t n, cudaStream_t stream) {
    if (pp->stages == 1) return;
    cudaCheck(cudaEventRecord(pp->reductions_issued, pp->group.nccl_stream));
    cudaCheck(cudaStreamWaitEvent(stream, pp->reductions_issued, 0));
    ncclCheck(ncclAllReduce(values, values, n, nccl_floatX(), ncclSum, pp->group.nccl_comm, stream));
}

// The sum over the stages of a host float (the loss, the squared gradient norm), the same on every stage.
static float pipeline_float_sum(const Pipeline* pp, float value) {
    if (pp->stages == 1) return value;
    return multi_gpu_cpu_float_sum(value, &pp->group);
}

// ----------------------------------------------------------------------------------------------------
// Measuring a step's passes

// Each pass's begin and end (ms) from the stage's start, once the step's work is done; and the stage's idle fraction:
// the time between its start and its last pass's end not spent in a pass, over the time spent in passes.
static double pipeline_measure(const Pipeline* pp, float* begin_ms, float* end_ms) {
    double busy = 0.0, span = 0.0;
    for (int k = 0; k < pp->num_passes; k++) {
        cudaCheck(cudaEventElapsedTime(&begin_ms[k], pp->start, pp->begin[k]));
        cudaCheck(cudaEventElapsedTime(&end_ms[k], pp->start, pp->end[k]));
        busy += end_ms[k] - begin_ms[k];
        if (end_ms[k] > span) span = end_ms[k];
    }
    return busy > 0.0 ? (span - busy) / busy : 0.0;
}

// After step `step` (from 1; collective over the world): the idle fractions of the idlest and the busiest stage (each
// stage's first process's), and with -ppt the trace, every rank's passes written by rank 0 (the file begun anew at the
// run's first step) as
//   step rank stage pass micro chunk begin_ms end_ms
// (pass F, B or W; chunk the stage's model chunk, interleaved; times from each rank's start of the step's passes).
static void pipeline_report(Pipeline* pp, const MultiGpuConfig* world, int step, int first_step, double* most_idle,
                            double* least_idle) {
    int n = pp->num_passes;
    float* times = (float*)malloc_check(2 * (size_t)n * sizeof(float));
    double idle = pipeline_measure(pp, times, times + n);
    // every stage's idle fraction: each rank puts its own in its place, zero elsewhere, and the sum gathers them
    int P = world->num_processes;
    float* all = (float*)calloc(P, sizeof(float));
    all[world->process_rank] = (float)idle;
    float* device;
    cudaCheck(cudaMalloc((void**)&device, P * sizeof(float)));
    cudaCheck(cudaMemcpy(device, all, P * sizeof(float), cudaMemcpyHostToDevice));
    ncclCheck(ncclAllReduce(device, device, P, ncclFloat, ncclSum, world->nccl_comm, world->nccl_stream));
    cudaCheck(cudaStreamSynchronize(world->nccl_stream));
    cudaCheck(cudaMemcpy(all, device, P * sizeof(float), cudaMemcpyDeviceToHost));
    int S = P / pp->stages;
    *most_idle = -1.0, *least_idle = 1e30;
    for (int s = 0; s < pp->stages; s++) {
        double f = all[s * S];
        if (f > *most_idle) *most_idle = f;
        if (f < *least_idle) *least_idle = f;
    }
    if (pp->trace_path) {  // every rank's passes to rank 0, one rank at a time through the same buffer
        float* rows;
        cudaCheck(cudaMalloc((void**)&rows, 2 * (size_t)n * sizeof(float)));
        FILE* f = NULL;
        if (world->process_rank == 0) {
            f = fopen(pp->trace_path, first_step ? "w" : "a");
            if (!f) {
                fprintf(stderr, "-ppt %s: cannot write the trace\n", pp->trace_path);
                exit(EXIT_FAILURE);
            }
            if (first_step) fprintf(f, "step rank stage pass micro chunk begin_ms end_ms\n");
        }
        for (int r = 0; r < P; r++) {
            if (world->process_rank == r) cudaCheck(cudaMemcpy(rows, times, 2 * (size_t)n * sizeof(float),
                                                               cudaMemcpyHostToDevice));
            ncclCheck(ncclBroadcast(rows, rows, 2 * (size_t)n, ncclFloat, r, world->nccl_comm, world->nccl_stream));
            cudaCheck(cudaStreamSynchronize(world->nccl_stream));
            if (world->process_rank != 0) continue;
            float* got = (float*)malloc_check(2 * (size_t)n * sizeof(float));
            cudaCheck(cudaMemcpy(got, rows, 2 * (size_t)n * sizeof(float), cudaMemcpyDeviceToHost));
            // every rank of a stage runs the same passes; rank r's stage is r / S
            PipelinePass* theirs =
                (PipelinePass*)malloc_check(3 * (size_t)pp->micro_batches * pp->chunks * sizeof(PipelinePass));
            pipeline_passes(pp->schedule, pp->stages, r / S, pp->micro_batches, pp->chunks, theirs);
            for (int k = 0; k < n; k++)
                fprintf(f, "%d %d %d %c %d %d %.4f %.4f\n", step, r, r / S, pass_letters[theirs[k].kind],
                        theirs[k].micro, theirs[k].chunk, got[k], got[n + k]);
            free(theirs);
            free(got);
        }
        if (f) fclose(f);
        cudaCheck(cudaFree(rows));
    }
    cudaCheck(cudaFree(device));
    free(all);
    free(times);
}
