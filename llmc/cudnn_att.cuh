// llmc/cudnn_att.cuh: causal multi-head self-attention on cuDNN's fused flash-attention engines, the path that
// `make train_gpt USE_CUDNN=1` builds (it passes -DENABLE_CUDNN and links -lcudnn). GPU only, bf16 or fp16 only.
// Written against the cuDNN 9 C backend API (cudnn_graph.h), without the C++ frontend: each pass is an operation
// graph of matmul, pointwise, reduction and reshape nodes laid out the way cuDNN's SDPA engines recognise them,
// finalized once per shape into an execution plan that is cached, then run with a variant pack that names the
// device buffers. The forward pass keeps only the softmax statistics (B, NH, T) that the backward pass needs to
// recompute attention tile by tile; no (B, NH, T, T) activation is stored.
// Determinism (doc/cudnn.md): by default (cudnn_attention_deterministic = 1) the backward pass is built in the form
// cuDNN runs deterministically, which it does on Hopper (sm_90) only; elsewhere it stops with one error line. With
// cudnn_attention_deterministic = 0 it takes the faster form, whose dQ is summed with float atomics: dQ, and with
// it the whole run, then differs in its last bits from run to run.
// Shapes: a forward pass whose T is not a multiple of 64 runs padded to the next multiple (causal: the padding
// changes no output row), so that sampling, which calls it with T = 1, 2, 3, ..., builds one plan per 64 positions.
// Use: set cudnn_attention_deterministic if wanted, cudnn_attention_setup() once (after the CUDA device is chosen),
// then attention_forward_cudnn() and attention_backward_cudnn() (all on one stream at a time: they share one
// workspace), cudnn_attention_teardown() at exit.
// Build: nvcc -std=c++17 -DENABLE_CUDNN -I llmc ... -lcudnn (cuDNN 9.x; the library lives under the CUDA lib dir).
#pragma once
#include <cudnn.h>
#include <float.h>
#include <math.h>

#include "common.cuh"

#if defined(ENABLE_FP32)
#error "llmc/cudnn_att.cuh: cuDNN flash attention is bf16/fp16 only: use PRECISION=BF16 or FP16, or drop USE_CUDNN"
#endif
#if CUDNN_MAJOR < 9
#error "llmc/cudnn_att.cuh: needs cuDNN 9 (the backend graph API with fused flash attention)"
#endif

#if defined(ENABLE_FP16)
#define CUDNN_FLOATX CUDNN_DATA_HALF
#else
#define CUDNN_FLOATX CUDNN_DATA_BFLOAT16
#endif

// ----------------------------------------------------------------------------------------------------
// Error check: file:line, the status string and cuDNN's own explanation of the last failure, on one line.

// cuDNN's message for the last failure in this thread, flattened to one line
static void cudnn_error_detail(char* detail, size_t size) {
    cudnnGetLastErrorString(detail, size);
    for (char* c = detail; *c != '\0'; c++)
        if (*c == '\n' || *c == '\r') *c = ' ';
}

static void cudnn_check(cudnnStatus_t status, const char* file, int line) {
    if (status == CUDNN_STATUS_SUCCESS) return;
    char detail[1024];
    cudnn_error_detail(detail, sizeof(detail));
    fprintf(stderr, "[cuDNN ERROR] at %s:%d: %s (%s)\n", file, line, cudnnGetErrorString(status), detail);
    exit(EXIT_FAILURE);
}
#define cudnnCheck(status) (cudnn_check((status), __FILE__, __LINE__))

// ----------------------------------------------------------------------------------------------------
// Tensor naming. Every tensor of a graph has a unique id; the variant pack binds ids of the non-virtual ones
// to memory. Virtual tensors (intermediates that live only inside the fused kernel) get ids from
// ATTENTION_FIRST_VIRTUAL_UID up, in creation order.
enum AttentionTensorUid {
    UID_Q = 1,
    UID_K,  // K viewed as K^T (B, NH, HS, T): the matmul Q @ K^T takes it as its B operand
    UID_V,  // forward: V (B, NH, T, HS); backward: V^T (B, NH, HS, T) for dO @ V^T
    UID_O,
    UID_STATS,       // (B, NH, T, 1) fp32: max + log(sum of exp) of each scaled, masked score row
    UID_ATTN_SCALE,  // by value: 1 / sqrt(HS)
    UID_MASK_VALUE,  // by value: what masked scores become (-FLT_MAX: exp() of it is 0)
    UID_DO,
    UID_DQ,
    UID_DK,
    UID_DV,
    UID_ONE,          // by value: 1.0, the (absent) dropout rescale the backward pattern expects
    UID_SOFTMAX_SUM,  // (B, NH, T, 1) fp32 in the workspace: rowsum(dO * O)
    UID_DQ_ACCUM,     // (B, NH, T, HS) fp32 in the workspace: dQ accumulated across key tiles (non-deterministic form)
};
#define ATTENTION_FIRST_VIRTUAL_UID 1000

typedef struct {
    int64_t dims[4];
    int64_t strides[4];
} TensorLayout;

static TensorLayout tensor_layout(int64_t d0, int64_t d1, int64_t d2, int64_t d3, int64_t s0, int64_t s1, int64_t s2,
                                  int64_t s3) {
    TensorLayout layout = {{d0, d1, d2, d3}, {s0, s1, s2, s3}};
    return layout;
}

// ----------------------------------------------------------------------------------------------------
// A graph under construction, and after finalization the owner of every descriptor behind its plan: they are
// kept alive as long as the plan (the plan's engine config refers to the operation graph, which refers to the
// operations and tensors) and destroyed together, newest first.
#define ATTENTION_GRAPH_MAX_DESCRIPTORS 192
#define ATTENTION_GRAPH_MAX_OPERATIONS 32
typedef struct {
    cudnnBackendDescriptor_t owned[ATTENTION_GRAPH_MAX_DESCRIPTORS];
    int num_owned;
    cudnnBackendDescriptor_t operations[ATTENTION_GRAPH_MAX_OPERATIONS];  // in data-flow order
    int num_operations;
    int64_t next_virtual_uid;
} AttentionGraph;

static cudnnHandle_t cudnn_handle;
static void* cudnn_workspace = NULL;
static size_t cudnn_workspace_bytes = 0;

// 1 (default): the backward graph takes the form cuDNN runs deterministically, and no engine that declares itself
// non-deterministic is used for either pass; 0: the faster backward whose dQ is summed with float atomics.
// Read at every call: a change takes effect at the next one (with plans of the other form). doc/cudnn.md
static int cudnn_attention_deterministic = 1;

static void graph_own(AttentionGraph* graph, cudnnBackendDescriptor_t descriptor) {
    if (graph->num_owned == ATTENTION_GRAPH_MAX_DESCRIPTORS) {
        fprintf(stderr, "[cuDNN ERROR] at %s:%d: attention graph needs more than %d descriptors\n", __FILE__, __LINE__,
                ATTENTION_GRAPH_MAX_DESCRIPTORS);
        exit(EXIT_FAILURE);
    }
    graph->owned[graph->num_owned++] = descriptor;
}

static cudnnBackendDescriptor_t graph_descriptor(AttentionGraph* graph, cudnnBackendDescriptorType_t type) {
    cudnnBackendDescriptor_t descriptor;
    cudnnCheck(cudnnBackendCreateDescriptor(type, &descriptor));
    graph_own(graph, descriptor);
    return descriptor;
}

static void graph_release(AttentionGraph* graph) {
    for (int i = graph->num_owned - 1; i >= 0; i--) cudnnCheck(cudnnBackendDestroyDescriptor(graph->owned[i]));
    graph->num_owned = 0;
    graph->num_operations = 0;
}

static void set_descriptor_attribute(cudnnBackendDescriptor_t descriptor, cudnnBackendAttributeName_t name,
                                     cudnnBackendDescriptor_t value) {
    cudnnCheck(cudnnBackendSetAttribute(descriptor, name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &value));
}

// All tensors claim 16-byte alignment: the buffers come from cudaMalloc and every view starts a multiple of
// HS elements (HS % 8 == 0, which the engines require anyway) into them.
static cudnnBackendDescriptor_t graph_tensor(AttentionGraph* graph, int64_t uid, cudnnDataType_t type,
                                             TensorLayout layout, bool is_virtual, bool is_by_value) {
    cudnnBackendDescriptor_t tensor = graph_descriptor(graph, CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    const int64_t alignment = 16;
    cudnnCheck(cudnnBackendSetAttribute(tensor, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid));
    cudnnCheck(cudnnBackendSetAttribute(tensor, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type));
    cudnnCheck(cudnnBackendSetAttribute(tensor, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment));
    cudnnCheck(cudnnBackendSetAttribute(tensor, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, layout.dims));
    cudnnCheck(cudnnBackendSetAttribute(tensor, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, layout.strides));
    cudnnCheck(cudnnBackendSetAttribute(tensor, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual));
    if (is_by_value)
        cudnnCheck(
            cudnnBackendSetAttribute(tensor, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &is_by_value));
    cudnnCheck(cudnnBackendFinalize(tensor));
    return tensor;
}

// a tensor bound to memory through the variant pack
static cudnnBackendDescriptor_t graph_input(AttentionGraph* graph, int64_t uid, cudnnDataType_t type,
                                            TensorLayout layout) {
    return graph_tensor(graph, uid, type, layout, false, false);
}

static cudnnBackendDescriptor_t graph_virtual(AttentionGraph* graph, cudnnDataType_t type, TensorLayout layout) {
    return graph_tensor(graph, graph->next_virtual_uid++, type, layout, true, false);
}

// an fp32 scalar passed by value: the variant pack points at a host float
static cudnnBackendDescriptor_t graph_scalar(AttentionGraph* graph, int64_t uid) {
    return graph_tensor(graph, uid, CUDNN_DATA_FLOAT, tensor_layout(1, 1, 1, 1, 1, 1, 1, 1), false, true);
}

static void graph_add_operation(AttentionGraph* graph, cudnnBackendDescriptor_t operation) {
    if (graph->num_operations == ATTENTION_GRAPH_MAX_OPERATIONS) {
        fprintf(stderr, "[cuDNN ERROR] at %s:%d: attention graph needs more than %d operations\n", __FILE__, __LINE__,
                ATTENTION_GRAPH_MAX_OPERATIONS);
        exit(EXIT_FAILURE);
    }
    cudnnCheck(cudnnBackendFinalize(operation));
    graph->operations[graph->num_operations++] = operation;
}

// c = a @ b over the last two dimensions, batched over the first two, accumulated in fp32
static void graph_matmul(AttentionGraph* graph, cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b,
                         cudnnBackendDescriptor_t c) {
    cudnnBackendDescriptor_t matmul = graph_descriptor(graph, CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    const cudnnDataType_t compute_type = CUDNN_DATA_FLOAT;
    cudnnCheck(cudnnBackendSetAttribute(matmul, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute_type));
    cudnnCheck(cudnnBackendFinalize(matmul));
    cudnnBackendDescriptor_t operation = graph_descriptor(graph, CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    set_descriptor_attribute(operation, CUDNN_ATTR_OPERATION_MATMUL_ADESC, a);
    set_descriptor_attribute(operation, CUDNN_ATTR_OPERATION_MATMUL_BDESC, b);
    set_descriptor_attribute(operation, CUDNN_ATTR_OPERATION_MATMUL_CDESC, c);
    set_descriptor_attribute(operation, CUDNN_ATTR_OPERATION_MATMUL_DESC, matmul);
    graph_add_operation(graph, operation);
}

// y = mode(x), mode(x, b) or, for BINARY_SELECT, t ? x : b. Broadcasting follows the dimensions of size 1.
static void graph_pointwise(AttentionGraph* graph, cudnnPointwiseMode_t mode, cudnnDataType_t math_precision,
                            cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t t,
                            cudnnBackendDescriptor_t y) {
    cudnnBackendDescriptor_t pointwise = graph_descriptor(graph, CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    cudnnCheck(cudnnBackendSetAttribute(pointwise, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode));
    cudnnCheck(
        cudnnBackendSetAttribute(pointwise, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &math_precision));
    cudnnCheck(cudnnBackendFinalize(pointwise));
    cudnnBackendDescriptor_t operation = graph_descriptor(graph, CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    set_descriptor_attribute(operation, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pointwise);
    set_descriptor_attribute(operation, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x);
    if (b != NULL) set_descriptor_attribute(operation, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b);
    if (t != NULL) set_descriptor_attribute(operation, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t);
    set_descriptor_attribute(operation, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y);
    graph_add_operation(graph, operation);
}

// y[..., i, j] = the index along `axis` (2: row i, 3: column j) of each element of x, as int32
static void graph_gen_index(AttentionGraph* graph, int64_t axis, cudnnBackendDescriptor_t x,
                            cudnnBackendDescriptor_t y) {
    cudnnBackendDescriptor_t pointwise = graph_descriptor(graph, CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    const cudnnPointwiseMode_t mode = CUDNN_POINTWISE_GEN_INDEX;
    const cudnnDataType_t math_precision = CUDNN_DATA_INT32;
    cudnnCheck(cudnnBackendSetAttribute(pointwise, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode));
    cudnnCheck(
        cudnnBackendSetAttribute(pointwise, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &math_precision));
    cudnnCheck(cudnnBackendSetAttribute(pointwise, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis));
    cudnnCheck(cudnnBackendFinalize(pointwise));
    cudnnBackendDescriptor_t operation = graph_descriptor(graph, CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    set_descriptor_attribute(operation, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pointwise);
    set_descriptor_attribute(operation, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x);
    set_descriptor_attribute(operation, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y);
    graph_add_operation(graph, operation);
}

// y = reduction of x over the dimensions where y has size 1, in fp32
static void graph_reduction(AttentionGraph* graph, cudnnReduceTensorOp_t reduce_op, cudnnBackendDescriptor_t x,
                            cudnnBackendDescriptor_t y) {
    cudnnBackendDescriptor_t reduction = graph_descriptor(graph, CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    const cudnnDataType_t compute_type = CUDNN_DATA_FLOAT;
    cudnnCheck(cudnnBackendSetAttribute(reduction, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1,
                                        &reduce_op));
    cudnnCheck(
        cudnnBackendSetAttribute(reduction, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute_type));
    cudnnCheck(cudnnBackendFinalize(reduction));
    cudnnBackendDescriptor_t operation = graph_descriptor(graph, CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
    set_descriptor_attribute(operation, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x);
    set_descriptor_attribute(operation, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y);
    set_descriptor_attribute(operation, CUDNN_ATTR_OPERATION_REDUCTION_DESC, reduction);
    graph_add_operation(graph, operation);
}

// y = x seen with y's dimensions and strides: how the backward graph transposes a matrix
static void graph_reshape(AttentionGraph* graph, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    cudnnBackendDescriptor_t operation = graph_descriptor(graph, CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
    set_descriptor_attribute(operation, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x);
    set_descriptor_attribute(operation, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y);
    graph_add_operation(graph, operation);
}

// ----------------------------------------------------------------------------------------------------
// The graphs. Shapes are (B, NH, rows, cols); the packed activations are viewed in place through strides:
//   qkv (B, T, 3C), C = NH * HS, holds per position [q | k | v], heads contiguous within each, so
//     Q, V   (B, NH, T, HS)  strides (T*3C, HS, 3C, 1), K or V at offset C or 2C elements
//     K^T    (B, NH, HS, T)  strides (T*3C, HS, 1, 3C)
//   out / dout (B, T, C): O, dO (B, NH, T, HS) strides (T*C, HS, C, 1)
// Score-sized (B, NH, T, T) intermediates are virtual: they exist only in tiles inside the fused kernels.

// The causal mask on scores (B, NH, T, T): query row i sees key column j <= i; the rest become mask_value.
static cudnnBackendDescriptor_t graph_causal_mask(AttentionGraph* graph, cudnnBackendDescriptor_t scores,
                                                  cudnnBackendDescriptor_t mask_value, TensorLayout score_layout) {
    cudnnBackendDescriptor_t row = graph_virtual(graph, CUDNN_DATA_INT32, score_layout);
    cudnnBackendDescriptor_t column = graph_virtual(graph, CUDNN_DATA_INT32, score_layout);
    cudnnBackendDescriptor_t visible = graph_virtual(graph, CUDNN_DATA_BOOLEAN, score_layout);
    cudnnBackendDescriptor_t masked = graph_virtual(graph, CUDNN_DATA_FLOAT, score_layout);
    graph_gen_index(graph, 2, scores, row);
    graph_gen_index(graph, 3, scores, column);
    graph_pointwise(graph, CUDNN_POINTWISE_CMP_GE, CUDNN_DATA_BOOLEAN, row, column, NULL, visible);
    graph_pointwise(graph, CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, scores, mask_value, visible, masked);
    return masked;
}

// Forward: S = scale * Q @ K^T, causal mask, softmax with stats, O = P @ V.
//   Stats = max_j S + log(sum_j exp(S - max)), P = exp(S - max) / sum (cast to floatX: the engines take the
//   second matmul's A operand in the I/O type).
static void build_forward_graph(AttentionGraph* graph, int B, int T, int NH, int HS) {
    const int64_t C = (int64_t)NH * HS;
    const TensorLayout qv_layout = tensor_layout(B, NH, T, HS, T * 3 * C, HS, 3 * C, 1);
    const TensorLayout kt_layout = tensor_layout(B, NH, HS, T, T * 3 * C, HS, 1, 3 * C);
    const TensorLayout o_layout = tensor_layout(B, NH, T, HS, T * C, HS, C, 1);
    const TensorLayout score_layout = tensor_layout(B, NH, T, T, (int64_t)NH * T * T, (int64_t)T * T, T, 1);
    const TensorLayout row_layout = tensor_layout(B, NH, T, 1, (int64_t)NH * T, T, 1, 1);

    cudnnBackendDescriptor_t q = graph_input(graph, UID_Q, CUDNN_FLOATX, qv_layout);
    cudnnBackendDescriptor_t kt = graph_input(graph, UID_K, CUDNN_FLOATX, kt_layout);
    cudnnBackendDescriptor_t v = graph_input(graph, UID_V, CUDNN_FLOATX, qv_layout);
    cudnnBackendDescriptor_t o = graph_input(graph, UID_O, CUDNN_FLOATX, o_layout);
    cudnnBackendDescriptor_t stats = graph_input(graph, UID_STATS, CUDNN_DATA_FLOAT, row_layout);
    cudnnBackendDescriptor_t attn_scale = graph_scalar(graph, UID_ATTN_SCALE);
    cudnnBackendDescriptor_t mask_value = graph_scalar(graph, UID_MASK_VALUE);

    cudnnBackendDescriptor_t scores = graph_virtual(graph, CUDNN_DATA_FLOAT, score_layout);
    graph_matmul(graph, q, kt, scores);
    cudnnBackendDescriptor_t scaled = graph_virtual(graph, CUDNN_DATA_FLOAT, score_layout);
    graph_pointwise(graph, CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, scores, attn_scale, NULL, scaled);
    cudnnBackendDescriptor_t masked = graph_causal_mask(graph, scaled, mask_value, score_layout);

    cudnnBackendDescriptor_t row_max = graph_virtual(graph, CUDNN_DATA_FLOAT, row_layout);
    graph_reduction(graph, CUDNN_REDUCE_TENSOR_MAX, masked, row_max);
    cudnnBackendDescriptor_t shifted = graph_virtual(graph, CUDNN_DATA_FLOAT, score_layout);
    graph_pointwise(graph, CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, masked, row_max, NULL, shifted);
    cudnnBackendDescriptor_t exponent = graph_virtual(graph, CUDNN_DATA_FLOAT, score_layout);
    graph_pointwise(graph, CUDNN_POINTWISE_EXP, CUDNN_DATA_FLOAT, shifted, NULL, NULL, exponent);
    cudnnBackendDescriptor_t row_sum = graph_virtual(graph, CUDNN_DATA_FLOAT, row_layout);
    graph_reduction(graph, CUDNN_REDUCE_TENSOR_ADD, exponent, row_sum);
    cudnnBackendDescriptor_t log_sum = graph_virtual(graph, CUDNN_DATA_FLOAT, row_layout);
    graph_pointwise(graph, CUDNN_POINTWISE_LOG, CUDNN_DATA_FLOAT, row_sum, NULL, NULL, log_sum);
    graph_pointwise(graph, CUDNN_POINTWISE_ADD, CUDNN_DATA_FLOAT, row_max, log_sum, NULL, stats);
    cudnnBackendDescriptor_t probabilities = graph_virtual(graph, CUDNN_FLOATX, score_layout);
    graph_pointwise(graph, CUDNN_POINTWISE_DIV, CUDNN_DATA_FLOAT, exponent, row_sum, NULL, probabilities);

    graph_matmul(graph, probabilities, v, o);
}

// Backward, with P recomputed from the saved stats:
//   softmax_sum = rowsum(dO * O) * 1            (fp32, (B, NH, T, 1), in the workspace)
//   P  = exp(causal_mask(scale * Q @ K^T - Stats))
//   dV = P^T @ dO
//   dS = scale * P * (dO @ V^T - softmax_sum)
//   dK = dS^T @ Q
//   dQ = dS @ K
// The transposes P^T, dS^T and K (from K^T) are reshape nodes onto transposed strides.
// dQ takes one of the two forms cuDNN's engines recognise (cuDNN's frontend builds the same two):
//   deterministic: dQ = dS @ K written to dQ directly. The engine keeps the score gradient of every (query, key)
//     tile in its own workspace (the frontend sizes it B * NH * T * T * 2 bytes, T rounded up to 64; it is part
//     of the plan's workspace size) and forms dQ from it in a second pass, without atomics. The frontend builds
//     this form when determinism is asked for; NVIDIA's Transformer Engine counts it deterministic on sm_90 only
//     (its attention backend table), so only Hopper runs it here.
//   accumulated: dQ = identity(dQ_accum = dS @ K), dQ_accum fp32 (B, NH, T, HS) in the workspace. Each thread
//     block owns a key tile and adds its share of every dQ row into dQ_accum with float atomics, in whatever
//     order the blocks run: faster, with O(T) workspace, but dQ's last bits vary from run to run.
static void build_backward_graph(AttentionGraph* graph, int B, int T, int NH, int HS, int deterministic) {
    const int64_t C = (int64_t)NH * HS;
    const TensorLayout q_layout = tensor_layout(B, NH, T, HS, T * 3 * C, HS, 3 * C, 1);
    const TensorLayout kt_layout = tensor_layout(B, NH, HS, T, T * 3 * C, HS, 1, 3 * C);
    const TensorLayout o_layout = tensor_layout(B, NH, T, HS, T * C, HS, C, 1);
    const TensorLayout heads_layout = tensor_layout(B, NH, T, HS, (int64_t)NH * T * HS, (int64_t)T * HS, HS, 1);
    const TensorLayout score_layout = tensor_layout(B, NH, T, T, (int64_t)NH * T * T, (int64_t)T * T, T, 1);
    const TensorLayout score_transposed_layout = tensor_layout(B, NH, T, T, (int64_t)NH * T * T, (int64_t)T * T, 1, T);
    const TensorLayout row_layout = tensor_layout(B, NH, T, 1, (int64_t)NH * T, T, 1, 1);

    cudnnBackendDescriptor_t q = graph_input(graph, UID_Q, CUDNN_FLOATX, q_layout);
    cudnnBackendDescriptor_t kt = graph_input(graph, UID_K, CUDNN_FLOATX, kt_layout);
    cudnnBackendDescriptor_t vt = graph_input(graph, UID_V, CUDNN_FLOATX, kt_layout);
    cudnnBackendDescriptor_t o = graph_input(graph, UID_O, CUDNN_FLOATX, o_layout);
    cudnnBackendDescriptor_t d_o = graph_input(graph, UID_DO, CUDNN_FLOATX, o_layout);
    cudnnBackendDescriptor_t stats = graph_input(graph, UID_STATS, CUDNN_DATA_FLOAT, row_layout);
    cudnnBackendDescriptor_t dq = graph_input(graph, UID_DQ, CUDNN_FLOATX, q_layout);
    cudnnBackendDescriptor_t dk = graph_input(graph, UID_DK, CUDNN_FLOATX, q_layout);
    cudnnBackendDescriptor_t dv = graph_input(graph, UID_DV, CUDNN_FLOATX, q_layout);
    cudnnBackendDescriptor_t softmax_sum = graph_input(graph, UID_SOFTMAX_SUM, CUDNN_DATA_FLOAT, row_layout);
    cudnnBackendDescriptor_t attn_scale = graph_scalar(graph, UID_ATTN_SCALE);
    cudnnBackendDescriptor_t mask_value = graph_scalar(graph, UID_MASK_VALUE);
    cudnnBackendDescriptor_t one = graph_scalar(graph, UID_ONE);

    // softmax_sum: the row term of the softmax backward, dP - rowsum(P * dP) with rowsum(P * dP) = rowsum(dO * O)
    cudnnBackendDescriptor_t do_times_o = graph_virtual(graph, CUDNN_DATA_FLOAT, heads_layout);
    graph_pointwise(graph, CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, d_o, o, NULL, do_times_o);
    cudnnBackendDescriptor_t row_dot = graph_virtual(graph, CUDNN_DATA_FLOAT, row_layout);
    graph_reduction(graph, CUDNN_REDUCE_TENSOR_ADD, do_times_o, row_dot);
    graph_pointwise(graph, CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, row_dot, one, NULL, softmax_sum);

    // P, recomputed
    cudnnBackendDescriptor_t scores = graph_virtual(graph, CUDNN_DATA_FLOAT, score_layout);
    graph_matmul(graph, q, kt, scores);
    cudnnBackendDescriptor_t scaled = graph_virtual(graph, CUDNN_DATA_FLOAT, score_layout);
    graph_pointwise(graph, CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, scores, attn_scale, NULL, scaled);
    cudnnBackendDescriptor_t shifted = graph_virtual(graph, CUDNN_DATA_FLOAT, score_layout);
    graph_pointwise(graph, CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, scaled, stats, NULL, shifted);
    cudnnBackendDescriptor_t masked = graph_causal_mask(graph, shifted, mask_value, score_layout);
    cudnnBackendDescriptor_t probabilities = graph_virtual(graph, CUDNN_DATA_FLOAT, score_layout);
    graph_pointwise(graph, CUDNN_POINTWISE_EXP, CUDNN_DATA_FLOAT, masked, NULL, NULL, probabilities);

    // dV = P^T @ dO
    cudnnBackendDescriptor_t probabilities_t = graph_virtual(graph, CUDNN_FLOATX, score_transposed_layout);
    graph_reshape(graph, probabilities, probabilities_t);
    graph_matmul(graph, probabilities_t, d_o, dv);

    // dS = scale * P * (dO @ V^T - softmax_sum)
    cudnnBackendDescriptor_t dp = graph_virtual(graph, CUDNN_DATA_FLOAT, score_layout);
    graph_matmul(graph, d_o, vt, dp);
    cudnnBackendDescriptor_t dp_centered = graph_virtual(graph, CUDNN_DATA_FLOAT, score_layout);
    graph_pointwise(graph, CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, dp, softmax_sum, NULL, dp_centered);
    cudnnBackendDescriptor_t ds_unscaled = graph_virtual(graph, CUDNN_DATA_FLOAT, score_layout);
    graph_pointwise(graph, CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, dp_centered, probabilities, NULL, ds_unscaled);
    cudnnBackendDescriptor_t ds = graph_virtual(graph, CUDNN_DATA_FLOAT, score_layout);
    graph_pointwise(graph, CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, ds_unscaled, attn_scale, NULL, ds);

    // dK = dS^T @ Q
    cudnnBackendDescriptor_t ds_t = graph_virtual(graph, CUDNN_FLOATX, score_transposed_layout);
    graph_reshape(graph, ds, ds_t);
    graph_matmul(graph, ds_t, q, dk);

    // dQ = dS @ K
    cudnnBackendDescriptor_t k = graph_virtual(graph, CUDNN_DATA_FLOAT, q_layout);
    graph_reshape(graph, kt, k);
    if (deterministic) {
        graph_matmul(graph, ds, k, dq);
    } else {
        cudnnBackendDescriptor_t dq_accum = graph_input(graph, UID_DQ_ACCUM, CUDNN_DATA_FLOAT, heads_layout);
        graph_matmul(graph, ds, k, dq_accum);
        graph_pointwise(graph, CUDNN_POINTWISE_IDENTITY, CUDNN_DATA_FLOAT, dq_accum, NULL, NULL, dq);
    }
}

static void build_backward_graph_deterministic(AttentionGraph* graph, int B, int T, int NH, int HS) {
    build_backward_graph(graph, B, T, NH, HS, 1);
}

static void build_backward_graph_accumulated(AttentionGraph* graph, int B, int T, int NH, int HS) {
    build_backward_graph(graph, B, T, NH, HS, 0);
}

// ----------------------------------------------------------------------------------------------------
// From graph to plan: finalize the operation graph, ask the heuristics (mode A, then the fallback list) for
// engine configurations in order of preference, and keep the first one that finalizes into an execution plan.
#define ATTENTION_MAX_ENGINE_CONFIGS 16

// Fills configs with up to max_configs engine configurations and returns how many; 0 when this mode has none
// for the graph, with the reason left in *failure.
static int heuristic_engine_configs(cudnnBackendDescriptor_t operation_graph, cudnnBackendHeurMode_t mode,
                                    cudnnBackendDescriptor_t* configs, int max_configs, cudnnStatus_t* failure) {
    cudnnBackendDescriptor_t heuristics;
    cudnnCheck(cudnnBackendCreateDescriptor(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, &heuristics));
    set_descriptor_attribute(heuristics, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, operation_graph);
    cudnnCheck(cudnnBackendSetAttribute(heuristics, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode));
    int64_t available = 0;
    cudnnStatus_t status = cudnnBackendFinalize(heuristics);
    if (status == CUDNN_STATUS_SUCCESS) {
        // the results are written into engine-config descriptors the caller has created
        for (int i = 0; i < max_configs; i++)
            cudnnCheck(cudnnBackendCreateDescriptor(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, &configs[i]));
        status = cudnnBackendGetAttribute(heuristics, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                                          max_configs, &available, configs);
        if (status != CUDNN_STATUS_SUCCESS) available = 0;
        // `available` counts every result, also those beyond max_configs that were not written
        if (available > max_configs) available = max_configs;
        for (int i = (int)available; i < max_configs; i++) cudnnCheck(cudnnBackendDestroyDescriptor(configs[i]));
    }
    if (status != CUDNN_STATUS_SUCCESS) *failure = status;
    cudnnCheck(cudnnBackendDestroyDescriptor(heuristics));
    return (int)available;
}

// Whether the engine of an engine configuration carries the NONDETERMINISTIC numerical note: cuDNN's own mark
// for engines whose results may vary from run to run (the note cuDNN's frontend filters on to deselect them)
static bool engine_config_nondeterministic(cudnnBackendDescriptor_t config) {
    cudnnBackendDescriptor_t engine;
    cudnnCheck(cudnnBackendCreateDescriptor(CUDNN_BACKEND_ENGINE_DESCRIPTOR, &engine));
    int64_t count = 0;
    cudnnCheck(cudnnBackendGetAttribute(config, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &count,
                                        &engine));
    cudnnBackendNumericalNote_t notes[CUDNN_NUMERICAL_NOTE_TYPE_COUNT];
    cudnnCheck(cudnnBackendGetAttribute(engine, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE,
                                        CUDNN_NUMERICAL_NOTE_TYPE_COUNT, &count, notes));
    cudnnCheck(cudnnBackendDestroyDescriptor(engine));
    bool nondeterministic = false;
    for (int64_t i = 0; i < count && i < CUDNN_NUMERICAL_NOTE_TYPE_COUNT; i++)
        if (notes[i] == CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC) nondeterministic = true;
    return nondeterministic;
}

// Returns the plan (owned by graph) and its workspace size in bytes. With `deterministic`, configurations whose
// engine declares itself non-deterministic are passed over.
static cudnnBackendDescriptor_t graph_build_plan(AttentionGraph* graph, const char* pass, int B, int T, int NH, int HS,
                                                 int deterministic, int64_t* workspace_bytes) {
    cudnnBackendDescriptor_t operation_graph = graph_descriptor(graph, CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
    cudnnCheck(cudnnBackendSetAttribute(operation_graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                                        graph->num_operations, graph->operations));
    cudnnCheck(cudnnBackendSetAttribute(operation_graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1,
                                        &cudnn_handle));
    cudnnCheck(cudnnBackendFinalize(operation_graph));

    const cudnnBackendHeurMode_t modes[2] = {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK};
    cudnnStatus_t failure = CUDNN_STATUS_NOT_SUPPORTED;
    int passed_over = 0;  // configurations of non-deterministic engines
    for (int m = 0; m < 2; m++) {
        cudnnBackendDescriptor_t configs[ATTENTION_MAX_ENGINE_CONFIGS];
        const int num_configs =
            heuristic_engine_configs(operation_graph, modes[m], configs, ATTENTION_MAX_ENGINE_CONFIGS, &failure);
        cudnnBackendDescriptor_t plan = NULL;
        for (int i = 0; i < num_configs; i++) {
            if (plan == NULL && deterministic && engine_config_nondeterministic(configs[i])) passed_over++;
            else if (plan == NULL) {
                cudnnBackendDescriptor_t candidate;
                cudnnCheck(cudnnBackendCreateDescriptor(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, &candidate));
                cudnnCheck(cudnnBackendSetAttribute(candidate, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1,
                                                    &cudnn_handle));
                set_descriptor_attribute(candidate, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, configs[i]);
                // an engine may still turn the graph down here (e.g. too much shared memory for this device)
                const cudnnStatus_t status = cudnnBackendFinalize(candidate);
                if (status == CUDNN_STATUS_SUCCESS) {
                    graph_own(graph, configs[i]);
                    graph_own(graph, candidate);
                    plan = candidate;
                    continue;
                }
                failure = status;
                cudnnCheck(cudnnBackendDestroyDescriptor(candidate));
            }
            cudnnCheck(cudnnBackendDestroyDescriptor(configs[i]));
        }
        if (plan != NULL) {
            cudnnCheck(cudnnBackendGetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1,
                                                NULL, workspace_bytes));
            return plan;
        }
    }
    char detail[1024];
    cudnn_error_detail(detail, sizeof(detail));
    fprintf(stderr,
            "[cuDNN ERROR] at %s:%d: no engine runs the attention %s graph for B=%d T=%d NH=%d HS=%d "
            "(%d configurations passed over as non-deterministic): %s (%s)\n",
            __FILE__, __LINE__, pass, B, T, NH, HS, passed_over, cudnnGetErrorString(failure), detail);
    exit(EXIT_FAILURE);
}

// ----------------------------------------------------------------------------------------------------
// Plan cache: each pass keeps the plans of the shapes it has seen (training and evaluation: one shape; sampling:
// one per 64 positions of its length, see attention_forward_cudnn). When a cache is full, its oldest entry is
// replaced. A replaced plan's kernels may still be queued on the GPU, so it is retired, not destroyed: kept until
// the event recorded after its last launch has passed. Only with ATTENTION_RETIRED_PLANS plans already retired is
// the oldest one's event waited for (long passed, as a rule): no device-wide synchronisation while training.
#define ATTENTION_PLAN_CACHE_SIZE 32
#define ATTENTION_RETIRED_PLANS 8
typedef struct {
    int B, T, NH, HS, deterministic;
    cudnnBackendDescriptor_t plan;  // NULL: the slot is free
    int64_t plan_workspace_bytes;
    cudaEvent_t last_launch;  // recorded on the stream after every execution of the plan
    AttentionGraph graph;
} AttentionPlan;

typedef struct {
    AttentionPlan entries[ATTENTION_PLAN_CACHE_SIZE];
    int next_replaced;
} AttentionPlanCache;

static AttentionPlanCache forward_plans;
static AttentionPlanCache backward_plans;
static AttentionPlan retired_plans[ATTENTION_RETIRED_PLANS];  // oldest first
static int num_retired_plans = 0;

typedef void (*AttentionGraphBuilder)(AttentionGraph* graph, int B, int T, int NH, int HS);

// the caller makes sure that no queued work still runs the plan
static void release_plan(AttentionPlan* entry) {
    graph_release(&entry->graph);
    cudaCheck(cudaEventDestroy(entry->last_launch));
    entry->plan = NULL;
}

static void retire_plan(AttentionPlan* entry) {
    if (num_retired_plans == ATTENTION_RETIRED_PLANS) {
        cudaCheck(cudaEventSynchronize(retired_plans[0].last_launch));
        release_plan(&retired_plans[0]);
        memmove(&retired_plans[0], &retired_plans[1], (ATTENTION_RETIRED_PLANS - 1) * sizeof(AttentionPlan));
        num_retired_plans--;
    }
    retired_plans[num_retired_plans++] = *entry;
    entry->plan = NULL;
}

static AttentionPlan* attention_plan(AttentionPlanCache* cache, AttentionGraphBuilder build, const char* pass, int B,
                                     int T, int NH, int HS, int deterministic) {
    for (int i = 0; i < ATTENTION_PLAN_CACHE_SIZE; i++) {
        AttentionPlan* entry = &cache->entries[i];
        if (entry->plan != NULL && entry->B == B && entry->T == T && entry->NH == NH && entry->HS == HS &&
            entry->deterministic == deterministic)
            return entry;
    }
    AttentionPlan* entry = &cache->entries[cache->next_replaced];
    cache->next_replaced = (cache->next_replaced + 1) % ATTENTION_PLAN_CACHE_SIZE;
    if (entry->plan != NULL) retire_plan(entry);
    entry->graph.num_owned = 0;
    entry->graph.num_operations = 0;
    entry->graph.next_virtual_uid = ATTENTION_FIRST_VIRTUAL_UID;
    build(&entry->graph, B, T, NH, HS);
    entry->plan = graph_build_plan(&entry->graph, pass, B, T, NH, HS, deterministic, &entry->plan_workspace_bytes);
    cudaCheck(cudaEventCreateWithFlags(&entry->last_launch, cudaEventDisableTiming));
    entry->B = B;
    entry->T = T;
    entry->NH = NH;
    entry->HS = HS;
    entry->deterministic = deterministic;
    return entry;
}

// The shared workspace, grown to the largest request. cudaFree waits for the device, so no queued kernel still
// uses the old buffer when it goes.
static void* attention_workspace(size_t bytes) {
    if (bytes > cudnn_workspace_bytes) {
        if (cudnn_workspace != NULL) cudaCheck(cudaFree(cudnn_workspace));
        cudaCheck(cudaMalloc(&cudnn_workspace, bytes));
        cudnn_workspace_bytes = bytes;
    }
    return cudnn_workspace;
}

static void execute_plan(AttentionPlan* entry, int num_tensors, const int64_t* uids, void** pointers, void* workspace,
                         cudaStream_t stream) {
    cudnnBackendDescriptor_t variant_pack;
    cudnnCheck(cudnnBackendCreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &variant_pack));
    cudnnCheck(cudnnBackendSetAttribute(variant_pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, num_tensors,
                                        uids));
    cudnnCheck(cudnnBackendSetAttribute(variant_pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR,
                                        num_tensors, pointers));
    cudnnCheck(
        cudnnBackendSetAttribute(variant_pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace));
    cudnnCheck(cudnnBackendFinalize(variant_pack));
    cudnnCheck(cudnnSetStream(cudnn_handle, stream));
    cudnnCheck(cudnnBackendExecute(cudnn_handle, entry->plan, variant_pack));
    cudaCheck(cudaEventRecord(entry->last_launch, stream));
    // the launch has read the pack (by-value scalars included) by the time Execute returns
    cudnnCheck(cudnnBackendDestroyDescriptor(variant_pack));
}

static size_t round_up_256(size_t bytes) { return (bytes + 255) / 256 * 256; }

// ----------------------------------------------------------------------------------------------------
// The API the trainer calls

static int cudnn_device_sm = 0;  // the device's compute capability, major * 10 + minor

void cudnn_attention_setup(void) {
    int device, major, minor;
    cudaCheck(cudaGetDevice(&device));
    cudaCheck(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    cudaCheck(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    cudnn_device_sm = major * 10 + minor;
    cudnnCheck(cudnnCreate(&cudnn_handle));
}

void cudnn_attention_teardown(void) {
    // queued attention work may still be using the plans and the workspace
    cudaCheck(cudaDeviceSynchronize());
    AttentionPlanCache* caches[2] = {&forward_plans, &backward_plans};
    for (int c = 0; c < 2; c++) {
        for (int i = 0; i < ATTENTION_PLAN_CACHE_SIZE; i++)
            if (caches[c]->entries[i].plan != NULL) release_plan(&caches[c]->entries[i]);
        caches[c]->next_replaced = 0;
    }
    for (int i = 0; i < num_retired_plans; i++) release_plan(&retired_plans[i]);
    num_retired_plans = 0;
    if (cudnn_workspace != NULL) cudaCheck(cudaFree(cudnn_workspace));
    cudnn_workspace = NULL;
    cudnn_workspace_bytes = 0;
    cudnnCheck(cudnnDestroy(cudnn_handle));
}

// Forward passes run at T rounded up to a multiple of this, so that one plan serves 64 sequence lengths
#define ATTENTION_T_GRANULE 64

// out (B, T, C) = causal softmax(q k^T / sqrt(HS)) v per head, from inp (B, T, 3C) = [q | k | v];
// stats (B, NH, T) fp32 keeps what attention_backward_cudnn needs.
// A T that is not a multiple of ATTENTION_T_GRANULE runs on copies padded to the next multiple T_plan, in the
// workspace: inp's positions T..T_plan-1 are zeros there. Causal attention lets query position i see keys and
// values 0..i only, so rows 0..T-1 of out and stats come out as without padding, and only those are copied back.
// Costs, on that path only: B * T * 3C + B * T_plan * 3C + B * (T_plan + T) * C elements of floatX moved (the
// copies in and out), and attention over T_plan instead of T positions; training shapes are multiples of 64 as a
// rule and take no copy.
void attention_forward_cudnn(floatX* out, float* stats, const floatX* inp, int B, int T, int NH, int C,
                             cudaStream_t stream) {
    const int HS = C / NH;
    const int T_plan = (T + ATTENTION_T_GRANULE - 1) / ATTENTION_T_GRANULE * ATTENTION_T_GRANULE;
    AttentionPlan* plan = attention_plan(&forward_plans, build_forward_graph, "forward", B, T_plan, NH, HS,
                                         cudnn_attention_deterministic);
    const bool padded = T_plan != T;
    const size_t inp_row = 3 * (size_t)C * sizeof(floatX), out_row = (size_t)C * sizeof(floatX);  // one position
    const size_t padded_inp_bytes = padded ? round_up_256((size_t)B * T_plan * inp_row) : 0;
    const size_t padded_out_bytes = padded ? round_up_256((size_t)B * T_plan * out_row) : 0;
    const size_t padded_stats_bytes = padded ? round_up_256((size_t)B * NH * T_plan * sizeof(float)) : 0;
    const size_t padded_bytes = padded_inp_bytes + padded_out_bytes + padded_stats_bytes;
    char* workspace = (char*)attention_workspace(padded_bytes + (size_t)plan->plan_workspace_bytes);
    const floatX* plan_inp = inp;
    floatX* plan_out = out;
    float* plan_stats = stats;
    if (padded) {
        floatX* padded_inp = (floatX*)workspace;
        plan_out = (floatX*)(workspace + padded_inp_bytes);
        plan_stats = (float*)(workspace + padded_inp_bytes + padded_out_bytes);
        cudaCheck(cudaMemcpy2DAsync(padded_inp, T_plan * inp_row, inp, T * inp_row, T * inp_row, B,
                                    cudaMemcpyDeviceToDevice, stream));
        // zeros, not leftovers: a masked-out key or value is multiplied by a probability of 0, and 0 * NaN is NaN
        cudaCheck(cudaMemset2DAsync((char*)padded_inp + T * inp_row, T_plan * inp_row, 0, (T_plan - T) * inp_row, B,
                                    stream));
        plan_inp = padded_inp;
    }
    float attn_scale = 1.0f / sqrtf((float)HS);
    float mask_value = -FLT_MAX;
    int64_t uids[7] = {UID_Q, UID_K, UID_V, UID_O, UID_STATS, UID_ATTN_SCALE, UID_MASK_VALUE};
    void* pointers[7] = {(void*)plan_inp, (void*)(plan_inp + C), (void*)(plan_inp + 2 * C), plan_out, plan_stats,
                         &attn_scale,     &mask_value};
    execute_plan(plan, 7, uids, pointers, workspace + padded_bytes, stream);
    if (padded) {
        cudaCheck(cudaMemcpy2DAsync(out, T * out_row, plan_out, T_plan * out_row, T * out_row, B,
                                    cudaMemcpyDeviceToDevice, stream));
        cudaCheck(cudaMemcpy2DAsync(stats, T * sizeof(float), plan_stats, T_plan * sizeof(float), T * sizeof(float),
                                    (size_t)B * NH, cudaMemcpyDeviceToDevice, stream));
    }
}

// dinp (B, T, 3C) = [dq | dk | dv], overwritten, from dout (B, T, C) and the forward pass's inp, out and stats.
// Deterministic unless cudnn_attention_deterministic is 0 (see build_backward_graph).
void attention_backward_cudnn(floatX* dinp, const floatX* dout, const floatX* inp, const floatX* out,
                              const float* stats, int B, int T, int NH, int C, cudaStream_t stream) {
    const int HS = C / NH;
    const int deterministic = cudnn_attention_deterministic;
    if (deterministic && cudnn_device_sm / 10 != 9) {
        fprintf(stderr,
                "[cuDNN ERROR] at %s:%d: the deterministic cuDNN attention backward runs on Hopper (sm_90) only, not "
                "on sm_%d: -cd 0 (cudnn_attention_deterministic = 0) takes the non-deterministic one (doc/cudnn.md)\n",
                __FILE__, __LINE__, cudnn_device_sm);
        exit(EXIT_FAILURE);
    }
    // cuDNN before 9.16 needs a padding mask in the backward graph when T is not a multiple of 128 (cuDNN's
    // frontend adds one there); this graph has none, so such shapes are refused on those versions
    if (cudnnGetVersion() < 91600 && T % 128 != 0) {
        fprintf(stderr, "[cuDNN ERROR] at %s:%d: attention backward with cuDNN %zu needs T %% 128 == 0 (T=%d)\n",
                __FILE__, __LINE__, cudnnGetVersion(), T);
        exit(EXIT_FAILURE);
    }
    AttentionGraphBuilder build = deterministic ? build_backward_graph_deterministic : build_backward_graph_accumulated;
    AttentionPlan* plan = attention_plan(&backward_plans, build, "backward", B, T, NH, HS, deterministic);
    const size_t softmax_sum_bytes = round_up_256((size_t)B * NH * T * sizeof(float));
    const size_t dq_accum_bytes = deterministic ? 0 : round_up_256((size_t)B * NH * T * HS * sizeof(float));
    char* workspace =
        (char*)attention_workspace(softmax_sum_bytes + dq_accum_bytes + (size_t)plan->plan_workspace_bytes);
    void* softmax_sum = workspace;
    void* dq_accum = workspace + softmax_sum_bytes;
    void* plan_workspace = workspace + softmax_sum_bytes + dq_accum_bytes;
    // the engines add into dQ_accum; cuDNN 9.6 and later clear it themselves
    if (!deterministic && cudnnGetVersion() < 90600) cudaCheck(cudaMemsetAsync(dq_accum, 0, dq_accum_bytes, stream));
    float attn_scale = 1.0f / sqrtf((float)HS);
    float mask_value = -FLT_MAX;
    float one = 1.0f;
    // the accumulated form's dQ_accum last: the deterministic graph has no such tensor
    int64_t uids[14] = {UID_Q,  UID_K,  UID_V,           UID_O,          UID_DO,         UID_STATS, UID_DQ,
                        UID_DK, UID_DV, UID_SOFTMAX_SUM, UID_ATTN_SCALE, UID_MASK_VALUE, UID_ONE,   UID_DQ_ACCUM};
    void* pointers[14] = {
        (void*)inp, (void*)(inp + C), (void*)(inp + 2 * C), (void*)out,  (void*)dout, (void*)stats, dinp,
        dinp + C,   dinp + 2 * C,     softmax_sum,          &attn_scale, &mask_value, &one,         dq_accum};
    execute_plan(plan, deterministic ? 13 : 14, uids, pointers, plan_workspace, stream);
}
