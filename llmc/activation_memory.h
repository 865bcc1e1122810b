// llmc/activation_memory.h: the activations' layout in one device allocation: each tensor of train_gpt.cu's
// ACTIVATION_TENSORS table sized from the model's kinds, the batch and the recompute level (the per-layer widths
// from the kinds, slices 64-element aligned, tensors 256-byte aligned), the allocation with an extension's own, and
// layer l's slices. train_gpt.cu includes it after the model's structs; llmc/memory_plan.h counts the same bytes
// (activation_bytes).
// Tests: train-gpt-cli (the memory plan's activation bytes against its own formula), and every trainer row.
#pragma once

// Per-layer slices start at multiples of 64 elements, so every slice is 16-byte aligned for vector
// loads whatever B and T are.
static size_t layer_stride(size_t n) { return CEIL_DIV(n, 64) * 64; }

// Per-layer strides (elements) of the activations whose width depends on the layer kinds or the split: qkvr, fch,
// ffn_act and atty (under tensor parallelism this process's slices' widths), the residual stream's tokens and the
// norms' statistics over them (with sequence parallelism B*T/N tokens; no means in RMSNorm)
typedef struct {
    size_t qkv, fc, hidden, attention, stream, stream_tokens, means;
} LayerStrides;
static LayerStrides layer_strides(const Model* model, size_t B, size_t T) {
    const ModelConfig* c = &model->config;
    size_t tokens = model_stream_tokens(model, (int)(B * T));
    LayerStrides s;
    s.qkv = layer_stride(B * T * local_qkv_channels(model));
    s.fc = layer_stride(B * T * local_fc_channels(model));
    s.hidden = layer_stride(B * T * local_hidden(model));
    s.attention = layer_stride(B * T * local_channels(model));
    s.stream = layer_stride(tokens * c->channels);
    s.stream_tokens = layer_stride(tokens);
    s.means = c->norm == NORM_LAYERNORM ? layer_stride(tokens) : 0;
    return s;
}

// The activation tensors' sizes in bytes, indexed by ACT_<name>.
static void fill_in_activation_sizes(size_t* s, const Model* model, size_t B, size_t T, int recompute) {
    const ModelConfig* c = &model->config;
    // under -pp this stage's layers, and the classifier's logits on the last stage only
    size_t C = c->channels, L = model_stage_layers(model), NH = local_heads(model);
    size_t Vp = model_last_stage(model) ? local_vocab(model) : 0;
    size_t ln_layers = recompute >= 2 ? 1 : L;
    size_t dense_layers = model_stage_dense_layers(model);
    size_t act_layers = recompute >= 1 ? (dense_layers ? 1 : 0) : dense_layers;
    size_t BTC = layer_stride(B * T * C), BT = layer_stride(B * T), ATT = layer_stride(B * NH * T * T);
    LayerStrides st = layer_strides(model, B, T);
    size_t QKV = st.qkv, FC = st.fc, HID = st.hidden, means = st.means;
    size_t ATY = st.attention, STC = st.stream, ST = st.stream_tokens;
    size_t BT4C = QKV > HID ? QKV : HID;  // the qkv and MLP gradients' scratch
    // flash attention and cuDNN keep softmax statistics, not probabilities, and read q, k, v in place
    int probabilities = model->attention == ATTENTION_MATMUL_SOFTMAX;
    size_t att_probs = probabilities ? ATT : 0, att_stats = probabilities ? 0 : layer_stride(B * NH * T);
    size_t ln_scratch = c->norm == NORM_RMSNORM ? rmsnorm_backward_scratch_floats((int)B, (int)T, (int)C)
                                                : layernorm_backward_scratch_floats((int)B, (int)T, (int)C);
    size_t FC_C = local_fc_channels(model), widest = Vp > FC_C ? Vp : FC_C;
    if (widest < C) widest = C;  // a row-parallel layer's bias gradient is C wide
    size_t bias_scratch = c->biases ? matmul_dbias_buffer_floats((int)widest) : 0;
    // tensor parallelism: the vocabulary-parallel classifier's row statistics; with sequence parallelism this
    // member's tokens of the residual stream (B*T/N rows of C) and the stream put together (B*T rows)
    int split = model_tp_degree(model) > 1, sp = model_sequence_parallel(model);
    size_t classifier_stats = split ? 4 * BT : 0;
    size_t member_tokens = sp ? layer_stride(model_stream_tokens(model, (int)(B * T)) * C) : 0;
    size_t gathered = sp ? BTC : 0;
#define ACTIVATION_BYTES(type, name, elements) s[ACT_##name] = (elements) * sizeof(type);
    ACTIVATION_TENSORS(ACTIVATION_BYTES)
#undef ACTIVATION_BYTES
}

// the activations' bytes at (B, T) with recompute level `recompute`, an extension's included
static size_t activation_bytes(const Model* model, size_t B, size_t T, int recompute) {
    size_t sizes[NUM_ACTIVATION_TENSORS];
    fill_in_activation_sizes(sizes, model, B, T, recompute);
    size_t bytes = 0;
    for (int i = 0; i < NUM_ACTIVATION_TENSORS; i++) bytes += CEIL_DIV(sizes[i], 256) * 256;  // as allocated
    if (model->extension.ffn->activation_bytes) bytes += model->extension.ffn->activation_bytes(model, B, T, recompute);
    return bytes;
}

static void model_allocate_activations(Model* model, int B, int T) {
    size_t sizes[NUM_ACTIVATION_TENSORS], bytes = 0;
    fill_in_activation_sizes(sizes, model, B, T, model->recompute);
    for (int i = 0; i < NUM_ACTIVATION_TENSORS; i++) bytes += CEIL_DIV(sizes[i], 256) * 256;
    cudaCheck(cudaMalloc(&model->acts_memory, bytes));
    ActivationTensors* a = &model->acts;
    void** ptrs[NUM_ACTIVATION_TENSORS];
#define ACTIVATION_POINTER(type, name, elements) ptrs[ACT_##name] = (void**)&a->name;
    ACTIVATION_TENSORS(ACTIVATION_POINTER)
#undef ACTIVATION_POINTER
    char* p = (char*)model->acts_memory;
    for (int i = 0; i < NUM_ACTIVATION_TENSORS; i++) {
        *ptrs[i] = p;
        p += CEIL_DIV(sizes[i], 256) * 256;  // 256-byte alignment for vector loads and cuBLASLt
    }
    model->batch_size = B;
    model->seq_len = T;
    cudaCheck(cudaMalloc((void**)&model->inputs, (size_t)B * T * sizeof(int)));
    cudaCheck(cudaMalloc((void**)&model->targets, (size_t)B * T * sizeof(int)));
    model->inputs_cpu = (int*)malloc_check((size_t)B * T * sizeof(int));
    cudaCheck(cudaMallocHost((void**)&model->losses_cpu, (size_t)B * T * sizeof(float)));
    cudaCheck(cudaEventCreateWithFlags(&model->losses_copied, cudaEventDisableTiming));
    if (model->extension.ffn->allocate_activations) model->extension.ffn->allocate_activations(model, B, T);
}

// Layer l's slices of the activations of a (B, T) batch (B, T at most what they were sized for); under -pp l is one of
// this stage's layers
static LayerActivations model_layer_activations(const Model* model, int l, size_t B, size_t T) {
    const ActivationTensors* a = &model->acts;
    const ModelConfig* c = &model->config;
    size_t C = c->channels, NH = local_heads(model);
    size_t BTC = layer_stride(B * T * C), BT = layer_stride(B * T);
    LayerStrides st = layer_strides(model, B, T);
    size_t QKV = st.qkv, FC = st.fc, HID = st.hidden, means = st.means, STC = st.stream, ST = st.stream_tokens;
    LayerActivations la;
    // under -pp layer l's slices are its place among the stage's layers; a chunk's input is the residual3 of the local
    // layer before it (the previous chunk's output, sent on), or a.encoded for the first
    int global = l;
    l = model_local_layer(model, l);
    la.residual = l == 0 ? a->encoded : a->residual3 + (l - 1) * STC;
    la.ln1 = model->recompute >= 2 ? a->ln1 : a->ln1 + l * BTC;
    la.ln1_mean = a->ln1_mean + l * means;
    la.ln1_rstd = a->ln1_rstd + l * ST;
    la.atty = a->atty + l * st.attention;
    int probabilities = model->attention == ATTENTION_MATMUL_SOFTMAX;
    la.att = probabilities ? a->att + l * layer_stride(B * NH * T * T) : NULL;
    la.att_stats = probabilities ? NULL : a->att_stats + l * layer_stride(B * NH * T);
    la.qkvr = a->qkvr + l * QKV;
    la.residual2 = a->residual2 + l * STC;
    la.ln2 = model->recompute >= 2 ? a->ln2 : a->ln2 + l * BTC;
    la.ln2_mean = a->ln2_mean + l * means;
    la.ln2_rstd = a->ln2_rstd + l * ST;
    la.residual3 = a->residual3 + l * STC;
    la.fch = la.ffn_act = NULL;
    if (model_is_dense_layer(model, global)) {
        size_t d = model_stage_dense_index(model, global);
        la.fch = a->fch + d * FC;
        la.ffn_act = model->recompute >= 1 ? a->ffn_act : a->ffn_act + d * HID;
    }
    return la;
}
