// llmc/optimizer.cuh: a set of trainable parameters as one flat floatX buffer of named tensors, with their
// gradients and the AdamW state, sharded for ZeRO-1/2/3 over the processes that hold the same parameters — the part
// of training that does not depend on the model. The trainers (train_gpt.cu, train_moe.cu) describe their
// tensors (sizes in buffer order, weight decay or not), point their own structs into `params_memory` /
// `grads_memory`, and call:
//   sharded_parameters_allocate      parameters and gradients (padded so that every shard is equal)
//   sharded_parameters_allocate_frozen   parameters only: a set that does not train (a base model under fine-tuning)
//   sharded_parameters_set           the parameters' values (this process's shard of them under ZeRO-3)
//   sharded_parameters_allocate_optimizer   m, v and fp32 master weights for this process's shard (on the device, or
//                                    with ZeRO-Offload in pinned host memory, where AdamW then runs: llmc/adamw_host.h)
//   sharded_parameters_add_bucket    ZeRO-2/3: a reusable gradient bucket (the trainer sizes them for its slice groups)
//   sharded_parameters_add_gather_buffer    ZeRO-3: a reusable buffer that a group of parameter slices is gathered into
//   sharded_parameters_gather_begin / gather_slices / gather_end   ZeRO-3: gather a group (on the NCCL stream)
//   sharded_parameters_gathered_slices      ZeRO-3: wait for a gathered group; where its slices are
//   sharded_parameters_zero_grad     before the first micro-step of a step
//   sharded_parameters_gradient_slices      where the backward pass accumulates a group of slices' gradients
//   sharded_parameters_reduce_slices        average a set of slices over processes during the backward pass
//   sharded_parameters_norm_squared  wait for that; the squared norm of the (still loss-scaled) gradient
//   sharded_parameters_early_update  -oo 2: AdamW on the host on each gradient piece as it arrives, before the norm
//   sharded_parameters_discard_early_update   -oo 2: a skipped step undoes it
//   sharded_parameters_apply_update  clip, undo the loss scale, AdamW (or keep the early update), all-gather (ZeRO-1/2)
//   sharded_parameters_gather_all    ZeRO-3: the whole set's parameters, for the model file
//   sharded_parameters_write_state / read_state / gather_state   the optimizer state in checkpoints
// A model may have several such sets over different process groups: the MoE trainer keeps its experts in a
// second one, replicated (and so reduced and sharded) over the processes that hold the same experts. The step's
// global norm adds the sets' squared norms; the FP16 loss scale (LossScaler) and the stochastic-rounding seeds
// (optimizer_next_seed) belong to the trainer, which hands them to every set.
// Deterministic: the global norm is a fixed-order reduction, the stochastic-rounding seeds come from a host
// generator that is identical on every process, and every process updates identical values.
// Tests (dev/test/run_tests.sh NAME, patterns work): gpt-*-z* and moe-*-z* (ZeRO stages and offload against PyTorch),
// adamw-host-*, train-gpt-cli.
#pragma once
#include "common.cuh"
#include "adamw.cuh"
#include "adamw_host.h"
#include "copy_cast.cuh"
#include "global_norm.cuh"
#include "multi_gpu.cuh"
#include "utils.h"

#define MAX_PARAMETER_TENSORS 64
#define MAX_GRADIENT_BUCKETS 4
#define MAX_BUCKET_SLICES 32
#define MAX_GATHER_BUFFERS 4
#define GATHER_NONE (-2)  // a gather buffer's group when it holds nothing usable

// ZeRO-2's reusable gradient buffer: the slices of one step of the backward pass (e.g. one layer's) accumulate in it
// on the compute stream, are reduced on the NCCL stream, and are added to the fp32 gradient shard there; `reduced`
// marks the end of that, after which the bucket takes the next group.
typedef struct {
    floatX* memory;
    size_t capacity, used;  // elements
    int num_slices, num_reduced;
    size_t slice_begin[MAX_BUCKET_SLICES];   // in the flat buffer
    size_t slice_size[MAX_BUCKET_SLICES];
    size_t slice_offset[MAX_BUCKET_SLICES];  // in the bucket
    cudaEvent_t reduced;
    int reduced_recorded;
} GradientBucket;

// ZeRO-3's reusable parameter buffer: a group of parameter slices (e.g. one layer's) is gathered into it on the NCCL
// stream before the compute stream reads it (`gathered`). It keeps the group until the buffer is given another, so a
// group gathered for the forward pass serves the backward pass too when nothing took its place; an update of the
// parameters empties every buffer.
typedef struct {
    floatX* memory;
    size_t capacity, used;  // elements
    int group;              // the trainer's number for what it holds (a layer, -1 the rest), or GATHER_NONE
    int num_slices;
    size_t slice_begin[MAX_BUCKET_SLICES];   // in the flat buffer
    size_t slice_offset[MAX_BUCKET_SLICES];  // in this buffer
    cudaEvent_t gathered;
} GatherBuffer;

typedef struct {
    float learning_rate, beta1, beta2, eps, weight_decay, grad_clip;
} AdamWConfig;

typedef struct {
    int num_tensors;
    size_t sizes[MAX_PARAMETER_TENSORS];  // in buffer order
    int decays[MAX_PARAMETER_TENSORS];    // 1: weight decay applies (matrices), 0: not (biases, LayerNorms)
    // tensor i's stochastic rounding uses the step's seed + seed_ids[i] (i unless the trainer renumbers them, so
    // that inserting a tensor does not move the others' rounding)
    unsigned int seed_ids[MAX_PARAMETER_TENSORS];
    size_t num_parameters;                // real parameters
    size_t num_parameters_padded;         // rounded up so that ZeRO shards are equal and 16-byte aligned
    // the parameters [params_first, params_first + params_count) of the flat buffer: all of them (params_first 0),
    // except under ZeRO-3, where each process holds its shard only and reads the others' gathered (GatherBuffer)
    floatX* params_memory;
    size_t params_first, params_count;
    floatX* grads_memory;  // NULL under ZeRO-2/3
    // ZeRO-2/3: the backward pass writes into buckets; this process keeps only shard_grads, the fp32 sum over the
    // step's micro-steps of its shard's reduced gradients (allocated with the optimizer state)
    int zero_stage;
    GradientBucket buckets[MAX_GRADIENT_BUCKETS];
    int num_buckets;
    float* shard_grads;
    GatherBuffer gathers[MAX_GATHER_BUFFERS];
    int num_gathers;
    // optimizer state for [shard_offset, shard_offset + shard_size) of the flat buffer (all of it without ZeRO)
    size_t shard_offset, shard_size;
    float* m_memory;
    float* v_memory;
    float* master_weights;  // fp32 copy of the shard, or NULL
    int has_master;         // the checkpoints' layout: 1 when the state holds master weights (bf16/fp16 with -w 1)
    // ZeRO-Offload (-oo 1, 2): m_memory, v_memory and master_weights (always, fp32 builds too) are pinned host memory
    // and AdamW runs on the host; host_params (pinned) takes the reduced floatX gradient shard in (stages 0, 1) and the
    // updated parameters out, host_grads (pinned) the fp32 gradient shard (stages 2, 3; at 0, 1 widened on the host)
    int offload;
    int flush_subnormals;   // whether the device build flushes subnormals, which the host AdamW must match
    floatX* host_params;
    float* host_grads;
    // the pieces of the shard in the order they reach the host on the step's last micro-step (shard-local [begin,
    // end), each with the event that follows its copy on the NCCL stream); together they cover the shard's tensors
    int last_micro_step;  // the trainer's: whether the backward pass in progress is the step's last micro-step
    int num_pieces, max_pieces;
    size_t* piece_begin;
    size_t* piece_end;
    cudaEvent_t* piece_copied;
    // -oo 2, the early update (sharded_parameters_early_update): AdamW on each piece as soon as it is on the host,
    // while the device goes on with the backward pass, assuming the step will not clip. backup_* keep m, v and the
    // master weights as they were, for a step that clips or is skipped after all.
    float* backup_m;
    float* backup_v;
    float* backup_master;
    int early_done;  // the early update ran over every piece, with the settings below
    AdamWConfig early_opt;
    float early_loss_scale;
    unsigned int early_seed;
    int early_t;
    int early_adopted;  // steps whose early update was kept (a count for tests)
    float* norm_partials;
    float* norm_result;
    // the reduced gradient times this is the gradient of the step's loss: 1, except for parameters whose gradient
    // arrives summed over several processes' tokens before the reduction averages it (expert parallelism)
    float grad_multiplier;
    // a set that does not train (sharded_parameters_allocate_frozen): no gradients, no optimizer state, no reductions;
    // under ZeRO-3 its shards are gathered as any set's
    int frozen;
} ShardedParameters;

// FP16 dynamic loss scaling: a step whose gradient overflowed is skipped and halves the scale; 1000 good steps in
// a row double it. Other precisions keep the scale at 1.
typedef struct {
    float scale;
    int good_steps;  // steps since the scale last changed
} LossScaler;

static LossScaler loss_scaler_init(void) {
    LossScaler s = {PRECISION_MODE == PRECISION_FP16 ? 65536.0f : 1.0f, 0};
    return s;
}

// after a step whose gradient norm was `norm` (not finite: the step was skipped)
static void loss_scaler_update(LossScaler* s, float norm) {
    if (PRECISION_MODE != PRECISION_FP16) return;
    if (!isfinite(norm)) {
        s->scale *= 0.5f;
        s->good_steps = 0;
    } else if (++s->good_steps >= 1000) {
        s->scale *= 2.0f;
        s->good_steps = 0;
    }
}

// xorshift64*: the same sequence on every process, so that stochastic rounding agrees everywhere
static unsigned int optimizer_next_seed(unsigned long long* state) {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    return (unsigned int)((*state * 0x2545F4914F6CDD1Dull) >> 32);
}

// zero_stage 2: no gradient buffer (the trainer adds buckets); 3: nor the other processes' parameter shards (the
// trainer adds gather buffers too). frozen: no gradient buffer at any stage (sharded_parameters_allocate_frozen).
static void sharded_parameters_allocate_set(ShardedParameters* p, int num_tensors, const size_t* sizes,
                                            const int* decays, int process_rank, int num_processes, int zero_stage,
                                            int frozen) {
    if (num_tensors > MAX_PARAMETER_TENSORS) {
        fprintf(stderr, "sharded_parameters_allocate: %d tensors, at most %d\n", num_tensors, MAX_PARAMETER_TENSORS);
        exit(EXIT_FAILURE);
    }
    memset(p, 0, sizeof(*p));
    p->num_tensors = num_tensors;
    for (int i = 0; i < num_tensors; i++) {
        p->sizes[i] = sizes[i];
        p->decays[i] = decays[i];
        p->seed_ids[i] = (unsigned int)i;
        p->num_parameters += sizes[i];
    }
    size_t quantum = (size_t)num_processes * 8;
    p->num_parameters_padded = CEIL_DIV(p->num_parameters, quantum) * quantum;
    p->zero_stage = zero_stage;
    p->params_count = p->num_parameters_padded;
    if (zero_stage == 3) {
        p->params_count = p->num_parameters_padded / num_processes;
        p->params_first = (size_t)process_rank * p->params_count;
    }
    cudaCheck(cudaMalloc((void**)&p->params_memory, p->params_count * sizeof(floatX)));
    cudaCheck(cudaMemset(p->params_memory, 0, p->params_count * sizeof(floatX)));
    p->frozen = frozen;
    if (zero_stage < 2 && !frozen) {
        cudaCheck(cudaMalloc((void**)&p->grads_memory, p->num_parameters_padded * sizeof(floatX)));
        cudaCheck(cudaMemset(p->grads_memory, 0, p->num_parameters_padded * sizeof(floatX)));
    }
    size_t partials = global_norm_num_partials(p->num_parameters_padded);
    cudaCheck(cudaMalloc((void**)&p->norm_partials, partials * sizeof(float)));
    cudaCheck(cudaMalloc((void**)&p->norm_result, sizeof(float)));
    p->grad_multiplier = 1.0f;
}
static void sharded_parameters_allocate(ShardedParameters* p, int num_tensors, const size_t* sizes, const int* decays,
                                        int process_rank, int num_processes, int zero_stage) {
    sharded_parameters_allocate_set(p, num_tensors, sizes, decays, process_rank, num_processes, zero_stage, 0);
}
// A set that does not train: the functions below give it no gradient slices (NULL: the backward pass computes none),
// reduce nothing, add 0 to the norm, allocate no optimizer state and leave its parameters as they are. The trainer
// adds no buckets (ZeRO-2/3), only ZeRO-3's gather buffers.
static void sharded_parameters_allocate_frozen(ShardedParameters* p, int num_tensors, const size_t* sizes,
                                               const int* decays, int process_rank, int num_processes,
                                               int zero_stage) {
    sharded_parameters_allocate_set(p, num_tensors, sizes, decays, process_rank, num_processes, zero_stage, 1);
}

// ZeRO-3: a gather buffer of `capacity` elements; returns its number
static int sharded_parameters_add_gather_buffer(ShardedParameters* p, size_t capacity) {
    if (p->num_gathers == MAX_GATHER_BUFFERS) {
        fprintf(stderr, "sharded_parameters_add_gather_buffer: at most %d buffers\n", MAX_GATHER_BUFFERS);
        exit(EXIT_FAILURE);
    }
    GatherBuffer* b = &p->gathers[p->num_gathers];
    memset(b, 0, sizeof(*b));
    b->capacity = capacity;
    b->group = GATHER_NONE;
    cudaCheck(cudaMalloc((void**)&b->memory, (capacity > 0 ? capacity : 1) * sizeof(floatX)));
    cudaCheck(cudaEventCreateWithFlags(&b->gathered, cudaEventDisableTiming));
    return p->num_gathers++;
}

// ZeRO-2/3: a bucket of `capacity` elements; returns its number
static int sharded_parameters_add_bucket(ShardedParameters* p, size_t capacity) {
    if (p->num_buckets == MAX_GRADIENT_BUCKETS) {
        fprintf(stderr, "sharded_parameters_add_bucket: at most %d buckets\n", MAX_GRADIENT_BUCKETS);
        exit(EXIT_FAILURE);
    }
    GradientBucket* b = &p->buckets[p->num_buckets];
    memset(b, 0, sizeof(*b));
    b->capacity = capacity;
    cudaCheck(cudaMalloc((void**)&b->memory, (capacity > 0 ? capacity : 1) * sizeof(floatX)));
    cudaCheck(cudaEventCreateWithFlags(&b->reduced, cudaEventDisableTiming));
    return p->num_buckets++;
}

// m, v (and fp32 master weights when use_master_weights and the parameters are not fp32 already) for
// this process's shard: all parameters with ZeRO-0, a 1/num_processes slice with ZeRO-1. offload: in pinned host
// memory, with master weights in every precision (the host's AdamW reads them; the checkpoints keep has_master's
// layout, so that a run resumes with or without offload).
static void sharded_parameters_allocate_optimizer(ShardedParameters* p, int use_master_weights, int process_rank,
                                                  int num_processes, int zero_stage, int offload) {
    if (p->frozen) return;
    size_t n = p->num_parameters_padded;
    p->shard_size = zero_stage >= 1 ? n / num_processes : n;
    p->shard_offset = zero_stage >= 1 ? (size_t)process_rank * p->shard_size : 0;
    p->has_master = use_master_weights && PRECISION_MODE != PRECISION_FP32;
    p->offload = offload;
    if (zero_stage >= 2) {
        cudaCheck(cudaMalloc((void**)&p->shard_grads, p->shard_size * sizeof(float)));
        cudaCheck(cudaMemset(p->shard_grads, 0, p->shard_size * sizeof(float)));
    }
    if (offload) {
        cudaCheck(cudaMallocHost((void**)&p->m_memory, p->shard_size * sizeof(float)));
        cudaCheck(cudaMallocHost((void**)&p->v_memory, p->shard_size * sizeof(float)));
        cudaCheck(cudaMallocHost((void**)&p->master_weights, p->shard_size * sizeof(float)));
        cudaCheck(cudaMallocHost((void**)&p->host_params, p->shard_size * sizeof(floatX)));
        cudaCheck(cudaMallocHost((void**)&p->host_grads, p->shard_size * sizeof(float)));
        if (offload == 2) {
            p->backup_m = (float*)malloc_check(p->shard_size * sizeof(float));
            p->backup_v = (float*)malloc_check(p->shard_size * sizeof(float));
            p->backup_master = (float*)malloc_check(p->shard_size * sizeof(float));
        }
        memset(p->m_memory, 0, p->shard_size * sizeof(float));
        memset(p->v_memory, 0, p->shard_size * sizeof(float));
        cudaCheck(cudaMemcpy(p->host_params, p->params_memory + (p->shard_offset - p->params_first),
                             p->shard_size * sizeof(floatX),
                             cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < p->shard_size; i++) p->master_weights[i] = (float)p->host_params[i];
        p->flush_subnormals = adamw_device_flushes_subnormals();
        return;
    }
    cudaCheck(cudaMalloc((void**)&p->m_memory, p->shard_size * sizeof(float)));
    cudaCheck(cudaMalloc((void**)&p->v_memory, p->shard_size * sizeof(float)));
    cudaCheck(cudaMemset(p->m_memory, 0, p->shard_size * sizeof(float)));
    cudaCheck(cudaMemset(p->v_memory, 0, p->shard_size * sizeof(float)));
    p->master_weights = NULL;
    if (use_master_weights && PRECISION_MODE != PRECISION_FP32) {
        cudaCheck(cudaMalloc((void**)&p->master_weights, p->shard_size * sizeof(float)));
        copy_and_cast(p->master_weights, p->params_memory + (p->shard_offset - p->params_first), p->shard_size, 0);
    }
}

static void sharded_parameters_free(ShardedParameters* p) {
    cudaCheck(cudaFree(p->params_memory));
    cudaCheck(cudaFree(p->grads_memory));
    cudaCheck(cudaFree(p->shard_grads));
    for (int i = 0; i < p->num_buckets; i++) {
        cudaCheck(cudaFree(p->buckets[i].memory));
        cudaCheck(cudaEventDestroy(p->buckets[i].reduced));
    }
    for (int i = 0; i < p->num_gathers; i++) {
        cudaCheck(cudaFree(p->gathers[i].memory));
        cudaCheck(cudaEventDestroy(p->gathers[i].gathered));
    }
    if (p->offload) {
        cudaCheck(cudaFreeHost(p->m_memory));
        cudaCheck(cudaFreeHost(p->v_memory));
        cudaCheck(cudaFreeHost(p->master_weights));
        cudaCheck(cudaFreeHost(p->host_params));
        cudaCheck(cudaFreeHost(p->host_grads));
        free(p->backup_m);
        free(p->backup_v);
        free(p->backup_master);
        for (int i = 0; i < p->max_pieces; i++) cudaCheck(cudaEventDestroy(p->piece_copied[i]));
        free(p->piece_begin);
        free(p->piece_end);
        free(p->piece_copied);
    } else {
        cudaCheck(cudaFree(p->m_memory));
        cudaCheck(cudaFree(p->v_memory));
        cudaCheck(cudaFree(p->master_weights));
    }
    cudaCheck(cudaFree(p->norm_partials));
    cudaCheck(cudaFree(p->norm_result));
}

// The whole set's parameters (host, num_parameters values in buffer order) -> this process's: all of them, or under
// ZeRO-3 its shard (whose padding past the last tensor stays zero). What the gather buffers hold is then old.
static void sharded_parameters_set(ShardedParameters* p, const floatX* host) {
    if (p->params_first < p->num_parameters) {
        size_t n = p->num_parameters - p->params_first;
        n = n < p->params_count ? n : p->params_count;
        cudaCheck(cudaMemcpy(p->params_memory, host + p->params_first, n * sizeof(floatX), cudaMemcpyHostToDevice));
    }
    for (int b = 0; b < p->num_gathers; b++) p->gathers[b].group = GATHER_NONE;
}

static size_t sharded_parameters_offset(const ShardedParameters* p, int tensor) {
    size_t offset = 0;
    for (int i = 0; i < tensor; i++) offset += p->sizes[i];
    return offset;
}

static void sharded_parameters_zero_grad(ShardedParameters* p, cudaStream_t stream) {
    p->num_pieces = 0;
    if (p->frozen) return;
    if (p->zero_stage >= 2)
        cudaCheck(cudaMemsetAsync(p->shard_grads, 0, p->shard_size * sizeof(float), stream));
    else
        cudaCheck(cudaMemsetAsync(p->grads_memory, 0, p->num_parameters_padded * sizeof(floatX), stream));
}

// where slice `layer` of tensor i begins in the flat buffer, and its size (layer < 0: the whole tensor)
static size_t sharded_parameters_slice(const ShardedParameters* p, int i, int layer, int num_layers, size_t* size) {
    *size = layer >= 0 ? p->sizes[i] / num_layers : p->sizes[i];
    return sharded_parameters_offset(p, i) + (layer >= 0 ? (size_t)layer * *size : 0);
}

// Where the backward pass accumulates (+=) the gradients of slice `layer` of each listed tensor (as
// sharded_parameters_reduce_slices takes them): slices[j] for tensors[j]. Without ZeRO-2, their places in the gradient
// buffer (zeroed once per step). With ZeRO-2, the next free space in `bucket`, zeroed on `stream`; an empty bucket
// first waits for the reduction of what it held before. The slices stay there until reduce_slices has reduced them,
// which ZeRO-2 does on every micro-step.
static void sharded_parameters_gradient_slices(ShardedParameters* p, int bucket, const int* tensors, int count,
                                               int layer, int num_layers, floatX** slices, cudaStream_t stream) {
    if (p->frozen) {
        for (int j = 0; j < count; j++) slices[j] = NULL;
        return;
    }
    if (p->zero_stage < 2) {
        for (int j = 0; j < count; j++) {
            size_t n;
            slices[j] = p->grads_memory + sharded_parameters_slice(p, tensors[j], layer, num_layers, &n);
        }
        return;
    }
    GradientBucket* b = &p->buckets[bucket];
    if (b->num_slices == 0 && b->reduced_recorded) cudaCheck(cudaStreamWaitEvent(stream, b->reduced, 0));
    size_t first = b->used;
    for (int j = 0; j < count; j++) {
        size_t n, begin = sharded_parameters_slice(p, tensors[j], layer, num_layers, &n);
        if (b->num_slices == MAX_BUCKET_SLICES || b->used + n > b->capacity) {
            fprintf(stderr, "sharded_parameters_gradient_slices: bucket %d (%zu elements, %d slices) is too small\n",
                    bucket, b->capacity, MAX_BUCKET_SLICES);
            exit(EXIT_FAILURE);
        }
        slices[j] = b->memory + b->used;
        if (n == 0) continue;  // a tensor this model does not have
        b->slice_begin[b->num_slices] = begin;
        b->slice_size[b->num_slices] = n;
        b->slice_offset[b->num_slices] = b->used;
        b->num_slices++;
        b->used += n;
    }
    if (b->used > first) cudaCheck(cudaMemsetAsync(b->memory + first, 0, (b->used - first) * sizeof(floatX), stream));
}

// ZeRO-2: the places sharded_parameters_gradient_slices will give the listed slices when it takes them into `bucket`
// with *used values of it taken (0: empty; *used moves past them): a ZB pipeline's weight gradients, queued by its B
// pass, take their space in its W pass
static void sharded_parameters_bucket_slices_ahead(const ShardedParameters* p, int bucket, const int* tensors,
                                                   int count, int layer, int num_layers, size_t* used,
                                                   floatX** slices) {
    for (int j = 0; j < count; j++) {
        size_t n;
        sharded_parameters_slice(p, tensors[j], layer, num_layers, &n);
        slices[j] = p->buckets[bucket].memory + *used;
        *used += n;
    }
}

// ZeRO-Offload: shard-local [begin, end) of the gradient shard is on its way to the host, behind the copy just queued
// on `stream`
static void sharded_parameters_add_piece(ShardedParameters* p, size_t begin, size_t end, cudaStream_t stream) {
    if (p->num_pieces == p->max_pieces) {
        int grown = p->max_pieces > 0 ? 2 * p->max_pieces : 64;
        p->piece_begin = (size_t*)realloc(p->piece_begin, grown * sizeof(size_t));
        p->piece_end = (size_t*)realloc(p->piece_end, grown * sizeof(size_t));
        p->piece_copied = (cudaEvent_t*)realloc(p->piece_copied, grown * sizeof(cudaEvent_t));
        if (!p->piece_begin || !p->piece_end || !p->piece_copied) {
            fprintf(stderr, "sharded_parameters_add_piece: out of host memory\n");
            exit(EXIT_FAILURE);
        }
        for (int i = p->max_pieces; i < grown; i++)
            cudaCheck(cudaEventCreateWithFlags(&p->piece_copied[i], cudaEventDisableTiming));
        p->max_pieces = grown;
    }
    p->piece_begin[p->num_pieces] = begin;
    p->piece_end[p->num_pieces] = end;
    cudaCheck(cudaEventRecord(p->piece_copied[p->num_pieces], stream));
    p->num_pieces++;
}

// ZeRO-2: shard[i] += bucket[i] (fp32 sums of the micro-steps' reduced gradients). Element by element, since a
// slice's piece of a shard has no alignment. Floor: n * (sizeof(floatX) + 8) bytes, one flop per element.
__global__ void gradient_shard_accumulate_kernel(float* shard, const floatX* bucket, size_t n) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) shard[i] += (float)bucket[i];
}

// ZeRO-2's reduction of the listed slices, which sharded_parameters_gradient_slices put into a bucket: each piece of
// a slice is averaged into the bucket of the process whose shard holds it, which adds it to its shard_grads. All on
// the NCCL stream; once a bucket's slices are all reduced, the bucket is free for the next group.
static void sharded_parameters_reduce_bucket(ShardedParameters* p, const int* tensors, int count, int layer,
                                             int num_layers, const MultiGpuConfig* mg) {
    for (int j = 0; j < count; j++) {
        size_t n, begin = sharded_parameters_slice(p, tensors[j], layer, num_layers, &n);
        if (n == 0) continue;
        // slices are reduced in the order they were put into their bucket: it is the next one of one of them
        GradientBucket* b = NULL;
        for (int k = 0; k < p->num_buckets && !b; k++) {
            GradientBucket* c = &p->buckets[k];
            if (c->num_reduced < c->num_slices && c->slice_begin[c->num_reduced] == begin) b = c;
        }
        if (!b) {
            fprintf(stderr, "sharded_parameters_reduce_slices: tensor %d slice %d is not the next in any bucket\n",
                    tensors[j], layer);
            exit(EXIT_FAILURE);
        }
        const int s = b->num_reduced;
        floatX* slice = b->memory + b->slice_offset[s];
        if (mg->num_processes > 1) {
            ncclCheck(ncclGroupStart());
            for (int r = 0; r < mg->num_processes; r++) {
                size_t shard_begin = (size_t)r * p->shard_size, shard_end = shard_begin + p->shard_size;
                size_t a = begin > shard_begin ? begin : shard_begin;
                size_t e = begin + n < shard_end ? begin + n : shard_end;
                if (a < e)
                    ncclCheck(ncclReduce(slice + (a - begin), slice + (a - begin), e - a, nccl_floatX(), ncclAvg, r,
                                         mg->nccl_comm, mg->nccl_stream));
            }
            ncclCheck(ncclGroupEnd());
        }
        size_t a = begin > p->shard_offset ? begin : p->shard_offset;
        size_t e = begin + n < p->shard_offset + p->shard_size ? begin + n : p->shard_offset + p->shard_size;
        if (a < e) {
            const int block_size = 256;
            gradient_shard_accumulate_kernel<<<(unsigned int)CEIL_DIV(e - a, (size_t)block_size), block_size, 0,
                                               mg->nccl_stream>>>(p->shard_grads + (a - p->shard_offset),
                                                                  slice + (a - begin), e - a);
            cudaCheck(cudaGetLastError());
            if (p->offload && p->last_micro_step) {  // the piece's step gradient is complete: to the host
                cudaCheck(cudaMemcpyAsync(p->host_grads + (a - p->shard_offset), p->shard_grads + (a - p->shard_offset),
                                          (e - a) * sizeof(float), cudaMemcpyDeviceToHost, mg->nccl_stream));
                sharded_parameters_add_piece(p, a - p->shard_offset, e - p->shard_offset, mg->nccl_stream);
            }
        }
        if (++b->num_reduced == b->num_slices) {
            cudaCheck(cudaEventRecord(b->reduced, mg->nccl_stream));
            b->reduced_recorded = 1;
            b->num_slices = b->num_reduced = 0;
            b->used = 0;
        }
    }
}

// The NCCL calls of sharded_parameters_reduce_slices, on the NCCL stream in one group
static void sharded_parameters_reduce_group(ShardedParameters* p, const int* tensors, int count, int layer,
                                            int num_layers, const MultiGpuConfig* mg, int zero_stage) {
    ncclCheck(ncclGroupStart());
    for (int j = 0; j < count; j++) {
        int i = tensors[j];
        size_t n = layer >= 0 ? p->sizes[i] / num_layers : p->sizes[i];
        size_t begin = sharded_parameters_offset(p, i) + (layer >= 0 ? (size_t)layer * n : 0);
        size_t end = begin + n;
        if (n == 0) continue;  // a tensor this model does not have
        if (zero_stage == 0) {
            ncclCheck(ncclAllReduce(p->grads_memory + begin, p->grads_memory + begin, n, nccl_floatX(), ncclAvg,
                                    mg->nccl_comm, mg->nccl_stream));
            continue;
        }
        for (int r = 0; r < mg->num_processes; r++) {
            size_t shard_begin = (size_t)r * p->shard_size, shard_end = shard_begin + p->shard_size;
            size_t a = begin > shard_begin ? begin : shard_begin;
            size_t b = end < shard_end ? end : shard_end;
            if (a < b) {
                ncclCheck(ncclReduce(p->grads_memory + a, p->grads_memory + a, b - a, nccl_floatX(), ncclAvg, r,
                                     mg->nccl_comm, mg->nccl_stream));
            }
        }
    }
    ncclCheck(ncclGroupEnd());
}

// The gradient reduction, overlapped with the backward pass: as soon as the backward pass has finished with
// slice `layer` of each listed tensor (a tensor stacked over num_layers layers; layer < 0: the whole tensor),
// these slices are averaged over processes on the NCCL stream, in one NCCL group, while the main stream goes
// on. ZeRO-0 all-reduces them; ZeRO-1 reduces each piece of a slice to the process whose shard holds it (the
// reduce-scatter of the whole buffer, done slice by slice), so each process ends with the average of its shard.
// The trainer must cover every tensor exactly once per step (on the last micro-step). With ZeRO-Offload, this
// process's part of each reduced slice then goes to the host on the same stream, behind its reduction and beside
// the backward pass (one process too), so that the update finds the gradient shard there. ZeRO-2 does this on every
// micro-step, from the bucket the slices were put into (sharded_parameters_reduce_bucket): the micro-steps' reduced
// gradients are summed in fp32 in shard_grads, and on the last micro-step offload copies each piece of that sum to the
// host as soon as it is complete. Every piece copied is recorded (sharded_parameters_add_piece) for the host's AdamW.
static void sharded_parameters_reduce_slices(ShardedParameters* p, const int* tensors, int count, int layer,
                                             int num_layers, const MultiGpuConfig* mg, int zero_stage,
                                             cudaStream_t stream) {
    if (p->frozen || (mg->num_processes == 1 && !p->offload && p->zero_stage < 2)) return;
    cudaCheck(cudaEventRecord(mg->compute_done, stream));
    cudaCheck(cudaStreamWaitEvent(mg->nccl_stream, mg->compute_done, 0));
    if (p->zero_stage >= 2) {
        sharded_parameters_reduce_bucket(p, tensors, count, layer, num_layers, mg);
        return;
    }
    if (mg->num_processes > 1) sharded_parameters_reduce_group(p, tensors, count, layer, num_layers, mg, zero_stage);
    if (!p->offload) return;
    for (int j = 0; j < count; j++) {
        size_t n = layer >= 0 ? p->sizes[tensors[j]] / num_layers : p->sizes[tensors[j]];
        size_t begin = sharded_parameters_offset(p, tensors[j]) + (layer >= 0 ? (size_t)layer * n : 0);
        size_t a = begin > p->shard_offset ? begin : p->shard_offset;
        size_t b = begin + n < p->shard_offset + p->shard_size ? begin + n : p->shard_offset + p->shard_size;
        if (a < b) {
            cudaCheck(cudaMemcpyAsync(p->host_params + (a - p->shard_offset), p->grads_memory + a, (b - a) * sizeof(floatX),
                                      cudaMemcpyDeviceToHost, mg->nccl_stream));
            sharded_parameters_add_piece(p, a - p->shard_offset, b - p->shard_offset, mg->nccl_stream);
        }
    }
}


// ----------------------------------------------------------------------------------------------------
// ZeRO-3: the parameters a layer needs, gathered from the processes whose shards hold them. The trainer gathers a
// group (gather_begin, one gather_slices per stacked set of tensors, gather_end) ahead of its use, on the NCCL stream,
// so that the next layer's gather overlaps this layer's compute; gathered_slices makes the compute stream wait for it.

// Starts gathering `group` into gather buffer `buffer`: 0 when the buffer holds it already (nothing to gather). The
// buffer's previous group may still be read by work queued on `stream`: the gather waits for all of it.
static int sharded_parameters_gather_begin(ShardedParameters* p, int buffer, int group, const MultiGpuConfig* mg,
                                           cudaStream_t stream) {
    GatherBuffer* b = &p->gathers[buffer];
    if (b->group == group) return 0;
    b->group = group;
    b->used = 0;
    b->num_slices = 0;
    cudaCheck(cudaEventRecord(mg->compute_done, stream));
    cudaCheck(cudaStreamWaitEvent(mg->nccl_stream, mg->compute_done, 0));
    return 1;
}

// Gathers slice `layer` of each listed tensor (as sharded_parameters_gradient_slices takes them) into the buffer: each
// piece from the process whose shard holds it, in one NCCL group (a copy with one process).
static void sharded_parameters_gather_slices(ShardedParameters* p, int buffer, const int* tensors, int count, int layer,
                                             int num_layers, const MultiGpuConfig* mg) {
    GatherBuffer* b = &p->gathers[buffer];
    if (mg->num_processes > 1) ncclCheck(ncclGroupStart());
    for (int j = 0; j < count; j++) {
        size_t n, begin = sharded_parameters_slice(p, tensors[j], layer, num_layers, &n);
        if (n == 0) continue;  // a tensor this model does not have
        if (b->num_slices == MAX_BUCKET_SLICES || b->used + n > b->capacity) {
            fprintf(stderr, "sharded_parameters_gather_slices: gather buffer %d (%zu elements, %d slices) is too small\n",
                    buffer, b->capacity, MAX_BUCKET_SLICES);
            exit(EXIT_FAILURE);
        }
        floatX* slice = b->memory + b->used;
        b->slice_begin[b->num_slices] = begin;
        b->slice_offset[b->num_slices] = b->used;
        b->num_slices++;
        b->used += n;
        if (mg->num_processes == 1) {
            cudaCheck(cudaMemcpyAsync(slice, p->params_memory + begin, n * sizeof(floatX), cudaMemcpyDeviceToDevice,
                                      mg->nccl_stream));
            continue;
        }
        for (int r = 0; r < mg->num_processes; r++) {
            size_t shard_begin = (size_t)r * p->params_count, shard_end = shard_begin + p->params_count;
            size_t a = begin > shard_begin ? begin : shard_begin;
            size_t e = begin + n < shard_end ? begin + n : shard_end;
            if (a >= e) continue;
            // the root sends from its shard; the others' send buffer is not read
            const floatX* send = r == mg->process_rank ? p->params_memory + (a - p->params_first) : slice + (a - begin);
            ncclCheck(ncclBroadcast(send, slice + (a - begin), e - a, nccl_floatX(), r, mg->nccl_comm, mg->nccl_stream));
        }
    }
    if (mg->num_processes > 1) ncclCheck(ncclGroupEnd());
}

static void sharded_parameters_gather_end(ShardedParameters* p, int buffer, const MultiGpuConfig* mg) {
    cudaCheck(cudaEventRecord(p->gathers[buffer].gathered, mg->nccl_stream));
}

// Where slice `layer` of each listed tensor is in the buffer, which must hold them (NULL for a tensor this model does
// not have), once `stream` has waited for their gather.
static void sharded_parameters_gathered_slices(ShardedParameters* p, int buffer, const int* tensors, int count,
                                               int layer, int num_layers, floatX** slices, cudaStream_t stream) {
    GatherBuffer* b = &p->gathers[buffer];
    cudaCheck(cudaStreamWaitEvent(stream, b->gathered, 0));
    for (int j = 0; j < count; j++) {
        size_t n, begin = sharded_parameters_slice(p, tensors[j], layer, num_layers, &n);
        slices[j] = NULL;
        for (int s = 0; s < b->num_slices && n > 0 && !slices[j]; s++)
            if (b->slice_begin[s] == begin) slices[j] = b->memory + b->slice_offset[s];
        if (n > 0 && !slices[j]) {
            fprintf(stderr, "sharded_parameters_gathered_slices: tensor %d slice %d is not in gather buffer %d\n",
                    tensors[j], layer, buffer);
            exit(EXIT_FAILURE);
        }
    }
}

// The whole set's real parameters (num_parameters) into `host`, through gather buffer 0, which is emptied (collective
// over mg; synchronous).
static void sharded_parameters_gather_all(ShardedParameters* p, floatX* host, const MultiGpuConfig* mg,
                                          cudaStream_t stream) {
    GatherBuffer* b = &p->gathers[0];
    size_t chunk = b->capacity;
    b->group = GATHER_NONE;
    cudaCheck(cudaEventRecord(mg->compute_done, mg->nccl_stream));  // a prefetch still reading the buffer
    cudaCheck(cudaStreamWaitEvent(stream, mg->compute_done, 0));
    for (int r = 0; r < mg->num_processes; r++) {
        for (size_t done = 0; done < p->params_count; done += chunk) {
            size_t begin = (size_t)r * p->params_count + done;
            if (begin >= p->num_parameters) break;
            size_t n = p->params_count - done < chunk ? p->params_count - done : chunk;
            if (n > p->num_parameters - begin) n = p->num_parameters - begin;
            if (mg->num_processes == 1)
                cudaCheck(cudaMemcpyAsync(b->memory, p->params_memory + done, n * sizeof(floatX),
                                          cudaMemcpyDeviceToDevice, stream));
            else
                ncclCheck(ncclBroadcast(r == mg->process_rank ? p->params_memory + done : b->memory, b->memory, n,
                                        nccl_floatX(), r, mg->nccl_comm, stream));
            cudaCheck(cudaMemcpyAsync(host + begin, b->memory, n * sizeof(floatX), cudaMemcpyDeviceToHost, stream));
            cudaCheck(cudaStreamSynchronize(stream));
        }
    }
}

// After the micro-steps' backward passes: waits for the overlapped reduction (sharded_parameters_reduce_slices)
// and returns the squared norm of the gradient of this set (times grad_multiplier, still multiplied by the loss
// scale), identical on every process of mg (inf or NaN when an FP16 gradient overflowed). The padding past the
// last tensor is never reduced: it stays zero everywhere.
static float sharded_parameters_norm_squared(ShardedParameters* p, const MultiGpuConfig* mg, int zero_stage,
                                             cudaStream_t stream) {
    if (p->frozen) return 0.0f;  // the same on every process: nothing to sum over them
    if (mg->num_processes > 1 || p->offload || p->zero_stage >= 2) {
        cudaCheck(cudaEventRecord(mg->compute_done, mg->nccl_stream));
        cudaCheck(cudaStreamWaitEvent(stream, mg->compute_done, 0));
    }
    // with ZeRO-1 each process holds the reduced gradient of its shard only: the squares are summed over processes
    size_t offset = zero_stage >= 1 ? p->shard_offset : 0;
    size_t count = zero_stage >= 1 ? p->shard_size : p->num_parameters_padded;
    if (p->zero_stage >= 2)  // the same sums of squares as the floatX shard's (llmc/global_norm.cuh)
        global_norm_squared(p->norm_partials, p->shard_grads, count, stream);
    else
        global_norm_squared(p->norm_partials, p->grads_memory + offset, count, stream);
    global_norm_aggregate(p->norm_result, p->norm_partials, global_norm_num_partials(count), false, stream);
    float norm2;
    cudaCheck(cudaMemcpyAsync(&norm2, p->norm_result, sizeof(float), cudaMemcpyDeviceToHost, stream));
    cudaCheck(cudaStreamSynchronize(stream));
    if (zero_stage >= 1 && mg->num_processes > 1) norm2 = multi_gpu_cpu_float_sum(norm2, mg);
    return norm2 * p->grad_multiplier * p->grad_multiplier;
}

// The same over some of the set's tensors (include[i] nonzero: tensor i counts): tensor parallelism counts a tensor
// that every member holds whole on one member only (llmc/tensor_parallel.cuh). Each tensor's part of this process's
// gradient (ZeRO-2/3: of its fp32 shard) is summed as its own segment, in tensor order.
static float sharded_parameters_norm_squared_of(ShardedParameters* p, const int* include, const MultiGpuConfig* mg,
                                                int zero_stage, cudaStream_t stream) {
    if (p->frozen) return 0.0f;
    if (mg->num_processes > 1 || p->offload || p->zero_stage >= 2) {
        cudaCheck(cudaEventRecord(mg->compute_done, mg->nccl_stream));
        cudaCheck(cudaStreamWaitEvent(stream, mg->compute_done, 0));
    }
    size_t lo = zero_stage >= 1 ? p->shard_offset : 0;
    size_t hi = zero_stage >= 1 ? p->shard_offset + p->shard_size : p->num_parameters_padded;
    size_t offset = 0;
    int segments = 0;
    for (int i = 0; i < p->num_tensors; i++) {
        size_t begin = offset > lo ? offset : lo, end = offset + p->sizes[i] < hi ? offset + p->sizes[i] : hi;
        offset += p->sizes[i];
        if (!include[i] || begin >= end) continue;
        if (p->zero_stage >= 2) global_norm_squared(p->norm_partials, p->shard_grads + (begin - lo), end - begin, stream);
        else global_norm_squared(p->norm_partials, p->grads_memory + begin, end - begin, stream);
        global_norm_aggregate(p->norm_result, p->norm_partials, global_norm_num_partials(end - begin), segments > 0,
                              stream);
        segments++;
    }
    float norm2 = 0.0f;
    if (segments > 0) {
        cudaCheck(cudaMemcpyAsync(&norm2, p->norm_result, sizeof(float), cudaMemcpyDeviceToHost, stream));
        cudaCheck(cudaStreamSynchronize(stream));
    }
    if (zero_stage >= 1 && mg->num_processes > 1) norm2 = multi_gpu_cpu_float_sum(norm2, mg);
    return norm2 * p->grad_multiplier * p->grad_multiplier;
}

// Gradient clipping as torch.nn.utils.clip_grad_norm_: scale by max_norm / (norm + 1e-6) when below 1.
static float sharded_parameters_clip_scale(float norm, float max_norm) {
    float coef = max_norm / (norm + 1e-6f);
    return coef < 1.0f ? coef : 1.0f;
}

// ZeRO-Offload's AdamW on the host over shard-local [begin, end), from host_grads, in place on m, v and the master
// weights, the new parameters into host_params: per tensor piece, with the noise indexed from the tensor's start, the
// same operations as adamw_update's kernel, bit for bit (llmc/adamw_host.h)
static void sharded_parameters_host_adamw(ShardedParameters* p, const AdamWConfig* opt, float grad_scale,
                                          unsigned int seed, int t, size_t begin, size_t end) {
    float beta1_correction = 1.0f - powf(opt->beta1, (float)t);
    float beta2_correction = 1.0f - powf(opt->beta2, (float)t);
    size_t tensor_begin = 0;
    for (int i = 0; i < p->num_tensors; i++) {
        size_t tensor_end = tensor_begin + p->sizes[i];
        size_t a = tensor_begin > p->shard_offset + begin ? tensor_begin : p->shard_offset + begin;
        size_t e = tensor_end < p->shard_offset + end ? tensor_end : p->shard_offset + end;
        if (a < e) {
            size_t local = a - p->shard_offset;
            adamw_host_update(p->host_params + local, p->master_weights + local, p->host_grads + local,
                              p->m_memory + local, p->v_memory + local, e - a, opt->learning_rate, opt->beta1,
                              opt->beta2, beta1_correction, beta2_correction, opt->eps,
                              p->decays[i] ? opt->weight_decay : 0.0f, grad_scale, seed + p->seed_ids[i],
                              p->flush_subnormals, (unsigned int)(a - tensor_begin));
        }
        tensor_begin = tensor_end;
    }
}

// ZeRO-Offload: waits for piece k of the gradient shard on the host; at stages 0 and 1 widens it to fp32 (exact) into
// host_grads
static void sharded_parameters_host_piece(ShardedParameters* p, int k) {
    cudaCheck(cudaEventSynchronize(p->piece_copied[k]));
    if (p->zero_stage >= 2) return;
    size_t begin = p->piece_begin[k], end = p->piece_end[k];
#pragma omp parallel for schedule(static)
    for (size_t i = begin; i < end; i++) p->host_grads[i] = (float)p->host_params[i];
}

// -oo 2: the early update of step t, run by the trainer right after queuing the last micro-step's backward pass, before
// the gradient norm. Each piece of the gradient shard is updated as soon as its copy is on the host, while the device
// goes on with the layers below: the update a step without clipping makes (grad_scale 1 / loss_scale, times
// grad_multiplier), with the settings and seed the update will be given (sharded_parameters_apply_update checks them).
// m, v and the master weights are kept in backup_* first.
static void sharded_parameters_early_update(ShardedParameters* p, const AdamWConfig* opt, float loss_scale,
                                            unsigned int seed, int t) {
    if (p->offload != 2) return;
    float grad_scale = 1.0f / loss_scale * p->grad_multiplier;
    for (int k = 0; k < p->num_pieces; k++) {
        sharded_parameters_host_piece(p, k);
        size_t begin = p->piece_begin[k], n = p->piece_end[k] - begin;
        memcpy(p->backup_m + begin, p->m_memory + begin, n * sizeof(float));
        memcpy(p->backup_v + begin, p->v_memory + begin, n * sizeof(float));
        memcpy(p->backup_master + begin, p->master_weights + begin, n * sizeof(float));
        sharded_parameters_host_adamw(p, opt, grad_scale, seed, t, begin, begin + n);
    }
    p->early_done = 1;
    p->early_opt = *opt;
    p->early_loss_scale = loss_scale;
    p->early_seed = seed;
    p->early_t = t;
}

// -oo 2: a step that is not taken after all (a skipped update) puts m, v and the master weights back
static void sharded_parameters_discard_early_update(ShardedParameters* p) {
    if (!p->early_done) return;
    for (int k = 0; k < p->num_pieces; k++) {
        size_t begin = p->piece_begin[k], n = p->piece_end[k] - begin;
        memcpy(p->m_memory + begin, p->backup_m + begin, n * sizeof(float));
        memcpy(p->v_memory + begin, p->backup_v + begin, n * sizeof(float));
        memcpy(p->master_weights + begin, p->backup_master + begin, n * sizeof(float));
    }
    p->early_done = 0;
}

// ZeRO-Offload's update on the host: the gradient pieces (which must cover the shard's parameters: the trainer
// reduced every tensor on the last micro-step) then AdamW over the shard, unless the early update made exactly this
// update already (no clipping, the same settings), in which case it is kept.
static void sharded_parameters_host_update(ShardedParameters* p, const AdamWConfig* opt, float grad_scale,
                                           float loss_scale, unsigned int seed, int t, cudaStream_t stream) {
    cudaCheck(cudaStreamSynchronize(stream));  // sharded_parameters_norm_squared made it wait for the copies
    size_t last = p->num_parameters < p->shard_offset + p->shard_size ? p->num_parameters : p->shard_offset + p->shard_size;
    size_t real = last > p->shard_offset ? last - p->shard_offset : 0, covered = 0;
    for (int k = 0; k < p->num_pieces; k++) covered += p->piece_end[k] - p->piece_begin[k];
    if (covered != real) {
        fprintf(stderr, "sharded_parameters_host_update: the gradient pieces on the host cover %zu of the shard's %zu "
                "parameters (was every tensor reduced on the last micro-step?)\n", covered, real);
        exit(EXIT_FAILURE);
    }
    int same = p->early_done && grad_scale == 1.0f / loss_scale * p->grad_multiplier &&
               memcmp(&p->early_opt, opt, sizeof(*opt)) == 0 && p->early_loss_scale == loss_scale &&
               p->early_seed == seed && p->early_t == t;
    if (same) {
        p->early_done = 0;
        p->early_adopted++;
        return;
    }
    // an early update widened the pieces already (and wrote parameters over the floatX gradient in host_params)
    int widened = p->early_done;
    sharded_parameters_discard_early_update(p);
    for (int k = 0; k < p->num_pieces && !widened; k++) sharded_parameters_host_piece(p, k);
    sharded_parameters_host_adamw(p, opt, grad_scale, seed, t, 0, real);
}

// The update of step t (from 1) for a finite gradient norm `norm` (the norm of the step's whole gradient, all
// sets together, with the loss scale undone): AdamW over this process's shard, one call per tensor piece (weight
// decay on the matrices only; with offload on the host, sharded_parameters_host_update), then the all-gather of the
// parameters under ZeRO-1/2. The stored gradient is
// divided by loss_scale and multiplied by grad_multiplier; `seed` drives bf16 stochastic rounding.
static void sharded_parameters_apply_update(ShardedParameters* p, const AdamWConfig* opt, float norm, float loss_scale,
                                            unsigned int seed, int t, const MultiGpuConfig* mg, int zero_stage,
                                            cudaStream_t stream) {
    if (p->frozen) return;
    float grad_scale = sharded_parameters_clip_scale(norm, opt->grad_clip) / loss_scale * p->grad_multiplier;
    float beta1_correction = 1.0f - powf(opt->beta1, (float)t);
    float beta2_correction = 1.0f - powf(opt->beta2, (float)t);
    size_t shard_begin = p->shard_offset, shard_end = p->shard_offset + p->shard_size;
    if (p->offload) sharded_parameters_host_update(p, opt, grad_scale, loss_scale, seed, t, stream);
    size_t tensor_begin = 0;
    for (int i = 0; i < p->num_tensors && !p->offload; i++) {
        size_t tensor_end = tensor_begin + p->sizes[i];
        size_t begin = tensor_begin > shard_begin ? tensor_begin : shard_begin;
        size_t end = tensor_end < shard_end ? tensor_end : shard_end;
        // the rounding noise is indexed from the tensor's start, so the bits do not depend on where shards split it
        unsigned int noise_index = (unsigned int)(begin - tensor_begin);
        if (begin < end && p->zero_stage >= 2) {
            size_t local = begin - shard_begin;
            adamw_update(p->params_memory + (begin - p->params_first), p->master_weights ? p->master_weights + local : nullptr,
                         p->shard_grads + local, p->m_memory + local, p->v_memory + local, end - begin,
                         opt->learning_rate, opt->beta1, opt->beta2, beta1_correction, beta2_correction, opt->eps,
                         p->decays[i] ? opt->weight_decay : 0.0f, grad_scale, seed + p->seed_ids[i], stream,
                         noise_index);
        } else if (begin < end) {
            size_t local = begin - shard_begin;
            adamw_update(p->params_memory + (begin - p->params_first), p->master_weights ? p->master_weights + local : nullptr,
                         p->grads_memory + begin, p->m_memory + local, p->v_memory + local, end - begin,
                         opt->learning_rate, opt->beta1, opt->beta2, beta1_correction, beta2_correction, opt->eps,
                         p->decays[i] ? opt->weight_decay : 0.0f, grad_scale, seed + p->seed_ids[i], stream,
                         noise_index);
        }
        tensor_begin = tensor_end;
    }
    if (p->offload) {
        // the padding past the last tensor (in the last shard) keeps its zeros: only the tensors' parameters return
        size_t last = p->num_parameters < shard_end ? p->num_parameters : shard_end;
        if (last > shard_begin)
            cudaCheck(cudaMemcpyAsync(p->params_memory + (shard_begin - p->params_first), p->host_params, (last - shard_begin) * sizeof(floatX),
                                      cudaMemcpyHostToDevice, stream));
    }
    for (int b = 0; b < p->num_gathers; b++) p->gathers[b].group = GATHER_NONE;  // ZeRO-3: what they hold is old
    if (zero_stage >= 1 && zero_stage < 3 && mg->num_processes > 1) {
        cudaCheck(cudaEventRecord(mg->compute_done, stream));
        cudaCheck(cudaStreamWaitEvent(mg->nccl_stream, mg->compute_done, 0));
        ncclCheck(ncclAllGather(p->params_memory + p->shard_offset, p->params_memory, p->shard_size, nccl_floatX(),
                                mg->nccl_comm, mg->nccl_stream));
        cudaCheck(cudaEventRecord(mg->compute_done, mg->nccl_stream));
        cudaCheck(cudaStreamWaitEvent(stream, mg->compute_done, 0));
    }
}

// The optimizer state of this process's shard in a checkpoint: m, v, then the master weights if has_master (the same
// layout with or without offload; an offloaded fp32 run's host master weights are the parameters themselves).
static void sharded_parameters_write_state(const ShardedParameters* p, FILE* f, const char* path) {
    float* host = (float*)malloc_check(p->shard_size * sizeof(float));
    float* buffers[3] = {p->m_memory, p->v_memory, p->master_weights};
    for (int i = 0; i < (p->has_master ? 3 : 2); i++) {
        if (p->offload) {
            fwrite_check(buffers[i], sizeof(float), p->shard_size, f, path);
            continue;
        }
        cudaCheck(cudaMemcpy(host, buffers[i], p->shard_size * sizeof(float), cudaMemcpyDeviceToHost));
        fwrite_check(host, sizeof(float), p->shard_size, f, path);
    }
    free(host);
}

static void sharded_parameters_read_state(ShardedParameters* p, FILE* f, const char* path) {
    float* host = (float*)malloc_check(p->shard_size * sizeof(float));
    float* buffers[3] = {p->m_memory, p->v_memory, p->master_weights};
    for (int i = 0; i < (p->has_master ? 3 : 2); i++) {
        if (p->offload) {
            fread_check(buffers[i], sizeof(float), p->shard_size, f, path);
            continue;
        }
        fread_check(host, sizeof(float), p->shard_size, f, path);
        cudaCheck(cudaMemcpy(buffers[i], host, p->shard_size * sizeof(float), cudaMemcpyHostToDevice));
    }
    free(host);
}

// The optimizer state of the whole set (all shards) into `full` (device, num_parameters_padded floats): buffer 0 =
// m, 1 = v, 2 = master weights (which must exist). Collective over mg under ZeRO-1 (an all-gather of the shards).
static void sharded_parameters_gather_state(const ShardedParameters* p, int buffer, float* full,
                                            const MultiGpuConfig* mg, int zero_stage, cudaStream_t stream) {
    const float* device_buffers[3] = {p->m_memory, p->v_memory, p->master_weights};
    if (p->offload) {  // this shard into its place in `full`, then the others' beside it (an in-place all-gather)
        cudaCheck(cudaMemcpyAsync(full + p->shard_offset, device_buffers[buffer], p->shard_size * sizeof(float),
                                  cudaMemcpyHostToDevice, stream));
        if (zero_stage >= 1 && mg->num_processes > 1)
            ncclCheck(ncclAllGather(full + p->shard_offset, full, p->shard_size, ncclFloat, mg->nccl_comm, stream));
    } else if (zero_stage >= 1 && mg->num_processes > 1) {
        ncclCheck(ncclAllGather(device_buffers[buffer], full, p->shard_size, ncclFloat, mg->nccl_comm, stream));
    } else {
        cudaCheck(cudaMemcpyAsync(full, device_buffers[buffer], p->shard_size * sizeof(float), cudaMemcpyDeviceToDevice,
                                  stream));
    }
    cudaCheck(cudaStreamSynchronize(stream));
}

// The inverse: this process's shard of buffer 0/1/2 from the whole set's values (host, num_parameters_padded floats).
static void sharded_parameters_scatter_state(ShardedParameters* p, int buffer, const float* full_host) {
    float* device_buffers[3] = {p->m_memory, p->v_memory, p->master_weights};
    if (p->offload) {
        memcpy(device_buffers[buffer], full_host + p->shard_offset, p->shard_size * sizeof(float));
        return;
    }
    cudaCheck(cudaMemcpy(device_buffers[buffer], full_host + p->shard_offset, p->shard_size * sizeof(float),
                         cudaMemcpyHostToDevice));
}
