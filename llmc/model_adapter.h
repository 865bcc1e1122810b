// llmc/model_adapter.h: fine-tuning train_gpt.cu's model (-ft, doc/training.md "Fine-tuning"): the model frozen
// (llmc/optimizer.cuh's frozen set: no gradients, no optimizer state, no reductions) and the trainable parameters of
// a method beside it, the adapter:
//   lora     beside each targeted Linear layer a pair A (r, C), B (OC, r) adding its low-rank update (llmc/lora.cuh);
//   adapter  after the attention's and the FFN's output of every layer a bottleneck MLP (llmc/bottleneck.cuh);
//   prompt   P learned input embeddings before every sequence (llmc/prompt.cuh): the model runs on P + T positions;
//   prefix   P learned keys and values in every layer, which every query attends to in one softmax with the causal
//            keys (llmc/prefix_attention.cuh, joint);
//   llama_adapter  P learned prompt rows in each of the top K layers, projected by the layer's frozen k and v, and
//            attended to in a softmax of their own whose output, times a zero-initialised gate per layer, adds to the
//            attention's (llmc/prefix_attention.cuh, gated).
// The adapter is a parameter set of its own, averaged and sharded over the data-parallel processes like the model's.
// The adapter file (doc/formats.md "Adapter file") holds it alone, tied to the base model file by its checksum; -fm
// merges LoRA's into an ordinary model file. train_gpt.cu includes this after its Model and its parameter tables.
// Tests (dev/test/run_tests.sh NAME, patterns work): *-lora*, *-adapter*, *-prompt*, *-prefix*, *-lladapter*,
// fine-tuning-cli.
#pragma once
#include "lora.cuh"
#include "bottleneck.cuh"
#include "prompt.cuh"
#include "prefix_attention.cuh"
#include "checkpoint.h"

#define ADAPTER_FILE_MAGIC 20261207
#define ADAPTER_FILE_VERSION 1
// the methods (-ft NAME), numbered as the adapter file's word 2 and the debug state's word 40
#define FT_METHOD_LORA 1
#define FT_METHOD_BOTTLENECK 2
#define FT_METHOD_PROMPT 3
#define FT_METHOD_PREFIX 4
#define FT_METHOD_LLAMA_ADAPTER 5
static const char* const ft_method_names[] = {"", "lora", "adapter", "prompt", "prefix", "llama_adapter"};
static int ft_method_number(const char* name) {
    for (int m = 1; m < (int)(sizeof(ft_method_names) / sizeof(ft_method_names[0])); m++)
        if (!strcmp(name, ft_method_names[m])) return m;
    return 0;
}
#define ADAPTER_MAX_TENSORS 14

// The Linear layers an adapter may target (-fw), each with a bit in the adapter file's word 4: X(id, name). qkv and
// proj are in every layer, fc and fc_proj in every dense MLP, lm_head (the classifier, against wte or lm_head) once,
// and the experts' pair (an extension's, FfnExtension.expert_linears) in every expert of every MoE layer. -fw experts
// names both of the experts' targets.
#define LORA_TARGETS(X)                   \
    X(QKV, "qkv")                         \
    X(PROJ, "proj")                       \
    X(FC, "fc")                           \
    X(FC_PROJ, "fc_proj")                 \
    X(LM_HEAD, "lm_head")                 \
    X(EXPERTS_FC, "experts.fc")           \
    X(EXPERTS_FC_PROJ, "experts.fc_proj")
#define LORA_TARGET_INDEX(id, name) LORA_##id,
enum { LORA_TARGETS(LORA_TARGET_INDEX) LORA_NUM_TARGETS };
#define LORA_TARGET_NAME(id, name) name,
static const char* const lora_target_names[LORA_NUM_TARGETS] = {LORA_TARGETS(LORA_TARGET_NAME)};
#define LORA_EXPERTS_TARGETS ((1u << LORA_EXPERTS_FC) | (1u << LORA_EXPERTS_FC_PROJ))
#define LORA_TARGETS_ALLOWED "any of qkv, proj, fc, fc_proj, lm_head, experts (= experts.fc,experts.fc_proj)"
static int lora_is_expert_target(int t) { return t == LORA_EXPERTS_FC || t == LORA_EXPERTS_FC_PROJ; }

// The bottleneck adapter's sites, each with a bit in the adapter file's word 4 (always both), and each site's tensors
// (stacked over the layers): down (L, r, C), its bias (L, r), up (L, C, r), its bias (L, C)
#define BOTTLENECK_ATTENTION 0
#define BOTTLENECK_FFN 1
#define BOTTLENECK_SITES 2
#define BOTTLENECK_SITE_TENSORS 4
static const char* const bottleneck_tensor_names[BOTTLENECK_SITES * BOTTLENECK_SITE_TENSORS] = {
    "attention.down", "attention.down_bias", "attention.up", "attention.up_bias",
    "ffn.down",       "ffn.down_bias",       "ffn.up",       "ffn.up_bias"};

struct Adapter {
    int method;          // FT_METHOD_*
    int rank;            // lora: r; adapter: the bottleneck width; prompt, prefix, llama_adapter: P, the rows
    float alpha, scale;  // lora: scale = alpha / rank; the others: 0
    // lora: bit t, target t has a pair; adapter: both sites; prompt, prefix: 1 (the input, every attention);
    // llama_adapter: K, the top layers adapted
    unsigned targets;
    // lora: A then B of each target in target order, stacked over the layers: A (L, r, C), B (L, OC, r) (the experts'
    // over every MoE layer's every expert, (Lm, E, r, C) and (Lm, E, OC, r), on every process: each computes its own
    // experts' gradients and leaves the others' zero, so the set's mean over the processes is each pair's); an absent
    // target's pair has size 0. adapter: each site's four tensors, site by site. prompt: the prompt (P, C). prefix:
    // the keys (L, P, NKV HS), then the values (L, P, NKV HS). llama_adapter: the prompts (K, P, C), then the gates
    // (K). ZeRO-1 at most: the set is a fraction of a percent of the model, so sharding its gradients (ZeRO-2) or its
    // parameters (ZeRO-3) would save nothing worth a second reduction pipeline.
    ShardedParameters store;
    int zero_stage;
    int tokens;  // B*T of the passes' buffers (prompt: T counts the virtual tokens)
    int* prompted_inputs;   // prompt: (B, T) host, the batch's tokens behind P virtual slots (token 0)
    int* prompted_targets;  // prompt: (B, T) host, its targets behind P masked ones (-1)
    floatX* u;   // (B, T, r) scratch of the passes (lora: x A^T, adapter: its pre-activation)
    floatX* g;   // (B, T, r)
    floatX* dz;  // adapter: (B, T, r)
    floatX* site_inputs;  // adapter: (L, 2, B, T, C) each site's input, kept by the forward pass for the backward
                          // (under -pp the micro-batch's in flight: its activation slot's part of the memory)
    floatX* site_inputs_memory;  // ... every activation slot's
    floatX* dh;           // adapter: (B, T, C) a site's input gradient
    // prefix, llama_adapter: the shared keys' backward scratch, ds and p (B T NH, P), and the gate's rows (B T NH)
    float *ds_rows, *p_rows, *gate_rows;
    floatX* prompt_kv;   // llama_adapter: (K, P, QKV) each adapted layer's projected prompt, kept for the backward
    floatX* dprompt_kv;  // llama_adapter: (P, QKV) its gradient, the q columns zero
    floatX* attention_out;  // llama_adapter: (B, T, C) the attention's output with the gated prompt's (proj's input)
    uint64_t base_size, base_hash;  // the base model file's size and checksum (checkpoint_checksum)
};

// "qkv,proj" -> the targets' bits; 0 and one line naming the flag when a name is unknown, repeated or missing
static unsigned lora_parse_targets(const char* list) {
    unsigned mask = 0;
    const char* at = list;
    while (*at) {
        size_t len = strcspn(at, ",");
        unsigned bits = 0;
        for (int t = 0; t < LORA_NUM_TARGETS; t++)
            if (strlen(lora_target_names[t]) == len && strncmp(at, lora_target_names[t], len) == 0) bits = 1u << t;
        if (len == strlen("experts") && strncmp(at, "experts", len) == 0) bits = LORA_EXPERTS_TARGETS;
        if (bits == 0 || (mask & bits)) {
            fprintf(stderr, "-fw %s: %s target '%.*s' (%s, each once)\n", list, bits == 0 ? "unknown" : "repeated",
                    (int)len, at, LORA_TARGETS_ALLOWED);
            return 0;
        }
        mask |= bits;
        at += len;
        if (*at == ',') at++;
    }
    if (mask == 0) fprintf(stderr, "-fw '%s': no target (%s)\n", list, LORA_TARGETS_ALLOWED);
    return mask;
}

// target t's Linear layer: C inputs, OC outputs (the classifier's: the Vp padded vocabulary rows); an expert target's
// also its model-file slot (slot: NULL when not wanted). Returns how many pairs target t has: one per layer, one per
// layer with a dense MLP (fc and fc_proj: an MoE model's MoE layers have none), one (lm_head), or one per expert of
// every MoE layer (0 without experts).
static size_t lora_target_shape(const Model* model, int t, int* C, int* OC, int* slot = NULL) {
    const ModelConfig* c = &model->config;
    if (lora_is_expert_target(t)) {
        int unused;
        const FfnExtension* x = model->extension.ffn;
        *C = *OC = 0;
        return x->expert_linears ? x->expert_linears(model, t == LORA_EXPERTS_FC_PROJ, C, OC, slot ? slot : &unused)
                                 : 0;
    }
    int channels = c->channels;
    int in[LORA_NUM_TARGETS] = {channels, channels, channels, c->ffn_hidden, channels};
    int out[LORA_NUM_TARGETS] = {(int)qkv_channels(c), channels, (int)fc_channels(c), channels, c->padded_vocab_size};
    *C = in[t];
    *OC = out[t];
    if (t == LORA_LM_HEAD) return 1;
    return t == LORA_FC || t == LORA_FC_PROJ ? model_dense_layers(model) : model->config.num_layers;
}
static size_t lora_target_layers(const Model* model, int t) {
    int C, OC;
    return lora_target_shape(model, t, &C, &OC);
}

// the adapter's tensors for the model's adapter shape (model->adapter_method, _rank, _targets): their sizes and
// whether weight decay applies (the matrices); returns their number
static int adapter_tensor_sizes(const Model* model, size_t* sizes, int* decays) {
    size_t r = model->adapter_rank, L = model->config.num_layers, C = model->config.channels;
    if (model->adapter_method == FT_METHOD_PREFIX) {
        sizes[0] = sizes[1] = L * r * model->config.num_kv_heads * (C / model->config.num_heads);
        decays[0] = decays[1] = 1;
        return 2;
    }
    if (model->adapter_method == FT_METHOD_LLAMA_ADAPTER) {
        sizes[0] = (size_t)model->adapter_targets * r * C;
        sizes[1] = model->adapter_targets;
        decays[0] = 1, decays[1] = 0;  // the gates, as biases
        return 2;
    }
    if (model->adapter_method == FT_METHOD_PROMPT) {
        sizes[0] = r * C;
        decays[0] = 1;  // a matrix, as wte
        return 1;
    }
    if (model->adapter_method == FT_METHOD_BOTTLENECK) {
        for (int site = 0; site < BOTTLENECK_SITES; site++) {
            size_t* s = sizes + site * BOTTLENECK_SITE_TENSORS;
            s[0] = L * r * C, s[1] = L * r, s[2] = L * C * r, s[3] = L * C;
            for (int i = 0; i < BOTTLENECK_SITE_TENSORS; i++) decays[site * BOTTLENECK_SITE_TENSORS + i] = i % 2 == 0;
        }
        return BOTTLENECK_SITES * BOTTLENECK_SITE_TENSORS;
    }
    for (int t = 0; t < LORA_NUM_TARGETS; t++) {
        int in, out;
        size_t layers = lora_target_shape(model, t, &in, &out);
        int on = (model->adapter_targets >> t) & 1;
        sizes[2 * t] = on * layers * r * in;
        sizes[2 * t + 1] = on * layers * out * r;
        decays[2 * t] = decays[2 * t + 1] = 1;
    }
    return 2 * LORA_NUM_TARGETS;
}
static size_t adapter_parameter_count(const Model* model) {
    size_t sizes[ADAPTER_MAX_TENSORS], n = 0;
    int decays[ADAPTER_MAX_TENSORS];
    int count = adapter_tensor_sizes(model, sizes, decays);
    for (int i = 0; i < count; i++) n += sizes[i];
    return n;
}
static int shared_keys_on(const Model* model) {
    return model->adapter_method == FT_METHOD_PREFIX || model->adapter_method == FT_METHOD_LLAMA_ADAPTER;
}
// the shared keys' backward scratch, fp32: ds and p per row (b, t, h) and key, the gate's share per row
static size_t shared_keys_scratch_floats(const Model* model, int B, int T) {
    return shared_keys_on(model) ? (size_t)B * T * model->config.num_heads * (2 * (size_t)model->adapter_rank + 1) : 0;
}
// what the bottleneck adapter keeps for the backward pass (for each of `slots` micro-batches in flight) and its
// scratch, or llama_adapter's projected prompts (values), for B x T tokens; 0 for the other methods
static size_t adapter_activation_count(const Model* model, int B, int T, int slots) {
    if (model->adapter_method == FT_METHOD_LLAMA_ADAPTER)
        return ((size_t)model->adapter_targets + 1) * model->adapter_rank * qkv_channels(&model->config) +
               (size_t)B * T * model->config.channels;
    if (model->adapter_method != FT_METHOD_BOTTLENECK) return 0;
    size_t N = (size_t)B * T, C = model->config.channels;
    return ((size_t)slots * BOTTLENECK_SITES * model->config.num_layers + 1) * N * C;
}
// the adapter file's targets word of the methods without -fw: the bottleneck adapter's two sites, the prompt's input,
// the prefix's every attention (llama_adapter's, its layer count, comes with the model: adapter_set_layers)
static unsigned adapter_fixed_targets(int method) { return method == FT_METHOD_BOTTLENECK ? 3 : 1; }
// llama_adapter's targets once the model's layers are known: the top `layers` (-fl; 0: every layer). 0 and one line
// when there are fewer.
static int adapter_set_layers(Model* model, int layers) {
    if (!model->frozen || model->adapter_method != FT_METHOD_LLAMA_ADAPTER) return 1;
    if (layers > model->config.num_layers) {
        fprintf(stderr, "-fl %d: more layers than the model's %d\n", layers, model->config.num_layers);
        return 0;
    }
    model->adapter_targets = layers > 0 ? layers : model->config.num_layers;
    return 1;
}
// the positions the model runs on beyond a sequence's tokens: prompt tuning's virtual tokens
static int model_adapter_sequence_extra(const Model* model) {
    return model->frozen && model->adapter_method == FT_METHOD_PROMPT ? model->adapter_rank : 0;
}
// the tensor's name in the test's lines
static const char* adapter_tensor_name(const Model* model, int i, char* buf, size_t size) {
    if (model->adapter_method == FT_METHOD_PROMPT) return "prompt";
    if (model->adapter_method == FT_METHOD_PREFIX) return i == 0 ? "prefix.keys" : "prefix.values";
    if (model->adapter_method == FT_METHOD_LLAMA_ADAPTER) return i == 0 ? "adaption.prompts" : "adaption.gates";
    if (model->adapter_method == FT_METHOD_BOTTLENECK) return bottleneck_tensor_names[i];
    snprintf(buf, size, "%s.lora_%s", lora_target_names[i / 2], i % 2 ? "b" : "a");
    return buf;
}
// its set's ZeRO stage: 1 at most (Adapter)
static int adapter_zero_stage(const Model* model) { return model->zero_stage < 1 ? model->zero_stage : 1; }

// Before the model's optimizer is allocated, after its process layout and adapter shape are set: the adapter's
// parameter set (all zero) and its scratch for batches of B x T tokens.
// alpha: lora's (0 for the other methods); B x T: the positions of the model's activations
static Adapter* adapter_allocate(Model* model, float alpha, int B, int T) {
    Adapter* a = (Adapter*)malloc_check(sizeof(Adapter));
    memset(a, 0, sizeof(*a));
    int rank = model->adapter_rank;
    a->method = model->adapter_method;
    a->rank = rank;
    a->alpha = a->method == FT_METHOD_LORA ? alpha : 0.0f;
    a->scale = a->alpha / (float)rank;
    a->targets = model->adapter_targets;
    a->zero_stage = adapter_zero_stage(model);
    a->tokens = B * T;
    size_t sizes[ADAPTER_MAX_TENSORS];
    int decays[ADAPTER_MAX_TENSORS];
    int count = adapter_tensor_sizes(model, sizes, decays);
    sharded_parameters_allocate(&a->store, count, sizes, decays, model->process_rank, model->num_processes,
                                a->zero_stage);
    size_t N = (size_t)B * T;
    floatX** scratch[3] = {&a->u, &a->g, &a->dz};
    for (int i = 0; i < 3; i++) cudaCheck(cudaMalloc((void**)scratch[i], N * rank * sizeof(floatX)));
    if (a->method == FT_METHOD_BOTTLENECK) {
        size_t C = model->config.channels, kept = (size_t)BOTTLENECK_SITES * model->config.num_layers * N * C;
        int slots = model->num_slots > 0 ? model->num_slots : 1;
        cudaCheck(cudaMalloc((void**)&a->site_inputs_memory, slots * kept * sizeof(floatX)));
        a->site_inputs = a->site_inputs_memory;
        for (int k = 0; k < model->num_slots; k++) model->slots[k].adapter_kept = a->site_inputs_memory + k * kept;
        cudaCheck(cudaMalloc((void**)&a->dh, N * C * sizeof(floatX)));
    }
    if (a->method == FT_METHOD_PROMPT) {
        a->prompted_inputs = (int*)malloc_check(N * sizeof(int));
        a->prompted_targets = (int*)malloc_check(N * sizeof(int));
    }
    if (shared_keys_on(model)) {
        size_t rows = N * model->config.num_heads;
        cudaCheck(cudaMalloc((void**)&a->ds_rows, shared_keys_scratch_floats(model, B, T) * sizeof(float)));
        a->p_rows = a->ds_rows + rows * rank;
        a->gate_rows = a->p_rows + rows * rank;
    }
    if (a->method == FT_METHOD_LLAMA_ADAPTER) {
        size_t QKV = qkv_channels(&model->config);
        cudaCheck(cudaMalloc((void**)&a->prompt_kv, (size_t)a->targets * rank * QKV * sizeof(floatX)));
        cudaCheck(cudaMalloc((void**)&a->dprompt_kv, (size_t)rank * QKV * sizeof(floatX)));
        cudaCheck(cudaMalloc((void**)&a->attention_out, N * model->config.channels * sizeof(floatX)));
    }
    return a;
}

static void adapter_free(Adapter* a) {
    if (!a) return;
    sharded_parameters_free(&a->store);
    void* buffers[9] = {a->u,       a->g,         a->dz,         a->site_inputs_memory, a->dh, a->ds_rows,
                        a->prompt_kv, a->dprompt_kv, a->attention_out};
    for (int i = 0; i < 9; i++) cudaCheck(cudaFree(buffers[i]));
    free(a->prompted_inputs);
    free(a->prompted_targets);
    free(a);
}

static int lora_has(const Model* model, int t) {
    return model->adapter && model->adapter->method == FT_METHOD_LORA && ((model->adapter->targets >> t) & 1);
}

// target t's pair `index` (of lora_target_layers) in a buffer laid out as the set (its parameters or gradients)
static void lora_pair(const Model* model, floatX* set, int t, size_t index, floatX** A, floatX** B) {
    const ShardedParameters* p = &model->adapter->store;
    size_t L = lora_target_layers(model, t);
    *A = set + sharded_parameters_offset(p, 2 * t) + index * (p->sizes[2 * t] / L);
    *B = set + sharded_parameters_offset(p, 2 * t + 1) + index * (p->sizes[2 * t + 1] / L);
}
// layer l's pair: the MLP's targets are stacked over the dense layers only
static void lora_layer_pair(const Model* model, floatX* set, int t, int l, floatX** A, floatX** B) {
    size_t index = t == LORA_FC || t == LORA_FC_PROJ ? (size_t)model_dense_index(model, l) : (size_t)l;
    lora_pair(model, set, t, index, A, B);
}

// The bottleneck adapter at site `site` (BOTTLENECK_*) of layer l: its four tensors in a buffer laid out as the set
// (its parameters or gradients)
static void bottleneck_site_tensors(const Model* model, floatX* set, int site, int l, floatX** tensors) {
    const ShardedParameters* p = &model->adapter->store;
    size_t L = model->config.num_layers;
    for (int i = 0; i < BOTTLENECK_SITE_TENSORS; i++) {
        int k = site * BOTTLENECK_SITE_TENSORS + i;
        tensors[i] = set + sharded_parameters_offset(p, k) + (size_t)l * (p->sizes[k] / L);
    }
}
static int bottleneck_on(const Model* model) {
    return model->adapter && model->adapter->method == FT_METHOD_BOTTLENECK;
}
// A block's output h (N tokens, C) of layer l through its site's bottleneck adapter, in place; keep: the forward pass
// of training (its input kept for the backward pass), not the samples' engine. Nothing without the bottleneck adapter.
static void model_adapter_site_forward(Model* model, int site, int l, floatX* h, int N, int keep, cudaStream_t stream) {
    if (!bottleneck_on(model)) return;
    Adapter* a = model->adapter;
    int C = model->config.channels;
    if (N > a->tokens) {
        fprintf(stderr, "model_adapter_site_forward: %d tokens, the adapter's buffers hold %d\n", N, a->tokens);
        exit(EXIT_FAILURE);
    }
    if (keep) {
        floatX* kept = a->site_inputs + ((size_t)l * BOTTLENECK_SITES + site) * a->tokens * C;
        cudaCheck(cudaMemcpyAsync(kept, h, (size_t)N * C * sizeof(floatX), cudaMemcpyDeviceToDevice, stream));
    }
    floatX* w[BOTTLENECK_SITE_TENSORS];
    bottleneck_site_tensors(model, a->store.params_memory, site, l, w);
    bottleneck_forward(h, w[0], w[1], w[2], w[3], a->u, a->g, N, C, a->rank, stream);
}
// Its transpose: from dout, the gradient of the adapted output, the gradient of the block's output (the adapter's
// buffer; dout itself without the bottleneck adapter), the adapter's gradients +=. bias_scratch: the model's.
static const floatX* model_adapter_site_backward(Model* model, int site, int l, const floatX* dout, int N,
                                                 float* bias_scratch, cudaStream_t stream) {
    if (!bottleneck_on(model)) return dout;
    Adapter* a = model->adapter;
    int C = model->config.channels;
    const floatX* kept = a->site_inputs + ((size_t)l * BOTTLENECK_SITES + site) * a->tokens * C;
    floatX *w[BOTTLENECK_SITE_TENSORS], *dw[BOTTLENECK_SITE_TENSORS];
    bottleneck_site_tensors(model, a->store.params_memory, site, l, w);
    bottleneck_site_tensors(model, a->store.grads_memory, site, l, dw);
    bottleneck_backward(a->dh, dw[0], dw[1], dw[2], dw[3], dout, kept, w[0], w[1], w[2], a->u, a->g, a->dz,
                        bias_scratch, N, C, a->rank, stream);
    return a->dh;
}

// Prompt tuning's batch: the B sequences of T tokens (host) behind the P virtual slots, inputs (token 0 there: the
// prompt replaces their embeddings) and targets (-1 there: no loss); *T becomes P + T. Without prompt tuning the
// batch as it is.
static void model_adapter_prompt_batch(Model* model, const int** inputs, const int** targets, int B, int* T) {
    if (!model->adapter || model->adapter->method != FT_METHOD_PROMPT) return;
    Adapter* a = model->adapter;
    int P = a->rank, Tr = *T, Tp = P + Tr;
    if ((size_t)B * Tp > (size_t)a->tokens) {
        fprintf(stderr, "model_adapter_prompt_batch: %d x %d positions, the adapter's buffers hold %d\n", B, Tp,
                a->tokens);
        exit(EXIT_FAILURE);
    }
    for (int b = 0; b < B; b++) {
        int* in = a->prompted_inputs + (size_t)b * Tp;
        memset(in, 0, P * sizeof(int));
        memcpy(in + P, *inputs + (size_t)b * Tr, Tr * sizeof(int));
        if (*targets) {
            int* tg = a->prompted_targets + (size_t)b * Tp;
            for (int t = 0; t < P; t++) tg[t] = -1;
            memcpy(tg + P, *targets + (size_t)b * Tr, Tr * sizeof(int));
        }
    }
    *inputs = a->prompted_inputs;
    if (*targets) *targets = a->prompted_targets;
    *T = Tp;
}
// After the encoder embedded the prompted batch (B, T) into `encoded`: the prompt into the virtual slots (with the
// position embeddings wpe when learned, else NULL), and in the backward pass its gradient from the embeddings'
static void model_adapter_embed_forward(Model* model, floatX* encoded, const floatX* wpe, int B, int T,
                                        cudaStream_t stream) {
    if (!model->adapter || model->adapter->method != FT_METHOD_PROMPT) return;
    Adapter* a = model->adapter;
    prompt_embed_forward(encoded, a->store.params_memory, wpe, B, T, a->rank, model->config.channels, stream);
}
static void model_adapter_embed_backward(Model* model, const floatX* dencoded, int B, int T, cudaStream_t stream) {
    if (!model->adapter || model->adapter->method != FT_METHOD_PROMPT) return;
    Adapter* a = model->adapter;
    prompt_embed_backward(a->store.grads_memory, dencoded, B, T, a->rank, model->config.channels, stream);
}

// The shared keys of layer l's attention (prefix, llama_adapter; llmc/prefix_attention.cuh): 0 when the layer has
// none. Its keys and values at the kernels' layout, in a buffer laid out as the set (its parameters or gradients)
// for the prefix, in the projected prompt's (P, QKV) rows for llama_adapter (kv: that buffer), and the gate.
static int shared_keys_layer(const Model* model, int l, PrefixShape* shape) {
    const Adapter* a = model->adapter;
    if (!a || (a->method != FT_METHOD_PREFIX && a->method != FT_METHOD_LLAMA_ADAPTER)) return 0;
    if (a->method == FT_METHOD_LLAMA_ADAPTER && l < model->config.num_layers - (int)a->targets) return 0;
    const ModelConfig* c = &model->config;
    int HS = c->channels / c->num_heads;
    shape->NH = c->num_heads, shape->NKV = c->num_kv_heads, shape->HS = HS, shape->P = a->rank;
    shape->kv_stride = a->method == FT_METHOD_PREFIX ? c->num_kv_heads * HS : (int)qkv_channels(c);
    return 1;
}
static void shared_keys_tensors(const Model* model, floatX* set, const floatX* kv, int l, floatX** keys,
                                floatX** values, floatX** gate) {
    const Adapter* a = model->adapter;
    const ModelConfig* c = &model->config;
    if (a->method == FT_METHOD_PREFIX) {
        size_t layer = a->store.sizes[0] / c->num_layers;
        *keys = set + (size_t)l * layer;
        *values = set + sharded_parameters_offset(&a->store, 1) + (size_t)l * layer;
        *gate = NULL;
        return;
    }
    int k = l - (c->num_layers - (int)a->targets), HS = c->channels / c->num_heads;
    *keys = (floatX*)kv + (size_t)c->num_heads * HS;
    *values = *keys + (size_t)c->num_kv_heads * HS;
    *gate = set + sharded_parameters_offset(&a->store, 1) + k;
}
// llama_adapter: layer l's prompt (P, C) in a buffer laid out as the set, and its projection's rows (P, QKV)
static floatX* llama_adapter_prompt(const Model* model, floatX* set, int l) {
    const Adapter* a = model->adapter;
    int k = l - (model->config.num_layers - (int)a->targets);
    return set + (size_t)k * a->rank * model->config.channels;
}
static floatX* llama_adapter_kv(const Model* model, int l) {
    const Adapter* a = model->adapter;
    int k = l - (model->config.num_layers - (int)a->targets);
    return a->prompt_kv + (size_t)k * a->rank * qkv_channels(&model->config);
}

// After flash attention's forward of layer l wrote out (B, T, C) and stats from qkv (B, T, QKV): the attention's
// output with the shared keys, the output projection's input: out itself (the prefix's joined in place; no shared
// keys), or llama_adapter's buffer, its prompt first projected through the layer's frozen qkv weights (and bias: its
// q columns unused).
static const floatX* model_adapter_attention_forward(Model* model, int l, const floatX* qkvw, const floatX* qkvb,
                                                     floatX* out, float* stats, const floatX* qkv, int B, int T,
                                                     cudaStream_t stream) {
    PrefixShape s;
    if (!shared_keys_layer(model, l, &s)) return out;
    Adapter* a = model->adapter;
    s.B = B, s.T = T;
    floatX* kv = NULL;
    if (a->method == FT_METHOD_LLAMA_ADAPTER) {
        kv = llama_adapter_kv(model, l);
        matmul_forward(kv, llama_adapter_prompt(model, a->store.params_memory, l), qkvw, qkvb, 1, s.P,
                       model->config.channels, s.kv_stride, stream);
    }
    floatX *keys, *values, *gate;
    shared_keys_tensors(model, a->store.params_memory, kv, l, &keys, &values, &gate);
    if ((size_t)B * T > (size_t)a->tokens) {
        fprintf(stderr, "model_adapter_attention_forward: %d x %d tokens, the adapter's buffers hold %d\n", B, T,
                a->tokens);
        exit(EXIT_FAILURE);
    }
    floatX* joined = gate ? a->attention_out : out;
    prefix_attention_forward(joined, stats, out, qkv, keys, values, gate, s, stream);
    return joined;
}
// After flash attention's backward of layer l wrote dqkv from dout (the gradient of the projection's input) and the
// forward's out and stats: the shared keys' part of dq, and their gradients
// into the adapter's (llama_adapter's through the frozen projection into its prompt's, and its gate's)
static void model_adapter_attention_backward(Model* model, int l, const floatX* qkvw, floatX* dqkv, const floatX* dout,
                                             const floatX* qkv, const floatX* out, const float* stats, int B, int T,
                                             cudaStream_t stream) {
    PrefixShape s;
    if (!shared_keys_layer(model, l, &s)) return;
    Adapter* a = model->adapter;
    s.B = B, s.T = T;
    int llama = a->method == FT_METHOD_LLAMA_ADAPTER;
    const floatX* kv = llama ? llama_adapter_kv(model, l) : NULL;
    floatX *keys, *values, *gate, *dkeys, *dvalues, *dgate;
    shared_keys_tensors(model, a->store.params_memory, kv, l, &keys, &values, &gate);
    shared_keys_tensors(model, a->store.grads_memory, a->dprompt_kv, l, &dkeys, &dvalues, &dgate);
    if (llama) cudaCheck(cudaMemsetAsync(a->dprompt_kv, 0, (size_t)s.P * s.kv_stride * sizeof(floatX), stream));
    prefix_attention_backward(dqkv, dkeys, dvalues, dgate, a->ds_rows, a->p_rows, a->gate_rows, dout, qkv, out, stats,
                              keys, values, gate, s, !llama, stream);
    if (llama)  // dprompt (P, C) += dkv (P, QKV) W (QKV, C)
        matmul_cublaslt(llama_adapter_prompt(model, a->store.grads_memory, l), qkvw, a->dprompt_kv, nullptr,
                        model->config.channels, s.P, s.kv_stride, stream, false, false, true, nullptr, false);
}

// A fresh adapter, from torch's normal_ on seed `seed` (llmc/rand.h). LoRA, the bottleneck adapter and llama_adapter
// start as the base model: lora's every A drawn from N(0, 1/r²), every B zero; the bottleneck adapter's down
// projections from N(0, 0.02²), everything else zero (its up projections: the adapted block's output is the block's);
// llama_adapter's prompts from N(0, 1), the scale of the normed rows its projection reads, its gates zero. The prompt
// is drawn from N(0, 0.02²), as GPT-2 draws wte, and so are the prefix's keys and values (the prefix joins the
// softmax: no draw leaves the model as it was, and small keys start with no preference among the shared rows).
static void adapter_init(Model* model, unsigned int seed) {
    Adapter* a = model->adapter;
    size_t n = a->store.num_parameters;
    float* values = (float*)calloc(n > 0 ? n : 1, sizeof(float));
    floatX* rounded = (floatX*)malloc_check(n * sizeof(floatX));
    if (!values) {
        fprintf(stderr, "adapter_init: out of host memory for %zu values\n", n);
        exit(EXIT_FAILURE);
    }
    mt19937_state rng;
    manual_seed(&rng, seed);
    // the tensors drawn: every down, every A, the prompts, or every tensor (prompt, prefix)
    int stride = a->method == FT_METHOD_BOTTLENECK ? BOTTLENECK_SITE_TENSORS
                 : a->method == FT_METHOD_LORA || a->method == FT_METHOD_LLAMA_ADAPTER ? 2 : 1;
    float std = a->method == FT_METHOD_LORA ? 1.0f / (float)a->rank : a->method == FT_METHOD_LLAMA_ADAPTER ? 1.0f : 0.02f;
    for (int i = 0; i < a->store.num_tensors; i += stride)
        if (a->store.sizes[i] > 0)
            normal_(values + sharded_parameters_offset(&a->store, i), a->store.sizes[i], 0.0f, std, &rng);
    for (size_t i = 0; i < n; i++) rounded[i] = (floatX)values[i];
    sharded_parameters_set(&a->store, rounded);
    free(rounded);
    free(values);
}

// The adapter file's header for this model's adapter at `step` (doc/formats.md "Adapter file")
static void adapter_file_header(const Model* model, int step, int* header) {
    const Adapter* a = model->adapter;
    memset(header, 0, 256 * sizeof(int));
    header[0] = ADAPTER_FILE_MAGIC;
    header[1] = ADAPTER_FILE_VERSION;
    header[2] = a->method;
    header[3] = a->rank;
    header[4] = (int)a->targets;
    memcpy(&header[5], &a->alpha, sizeof(float));
    header[6] = (int)(uint32_t)a->base_hash;
    header[7] = (int)(uint32_t)(a->base_hash >> 32);
    header[8] = (int)(uint32_t)a->base_size;
    header[9] = (int)(uint32_t)(a->base_size >> 32);
    header[10] = step;
    header[11] = (int)a->store.num_parameters;
}

// Reads an adapter file into the model's adapter (its rank, targets and alpha must be the run's; its base checksum
// the base model file's). Returns the file's step. Bad input: one line naming the file, exit.
static int adapter_read_file(Model* model, const char* path) {
    Adapter* a = model->adapter;
    FILE* f = fopen_check(path, "rb");
    int header[256], want[256];
    read_versioned_header_check(f, header, path, ADAPTER_FILE_MAGIC, ADAPTER_FILE_VERSION, "adapter");
    adapter_file_header(model, header[10], want);
    const char* what[] = {NULL, NULL, "method (-ft: 1 lora, 2 adapter, 3 prompt, 4 prefix, 5 llama_adapter)", "rank (-fr)",
                          "targets (lora: -fw, a bit each; llama_adapter: -fl, the layers)",
                          "alpha (-fs)",
                          "base model checksum", "base model checksum", "base model size", "base model size", NULL,
                          "parameter count"};
    for (int i = 2; i <= 11; i++) {
        if (what[i] && header[i] != want[i]) {
            fprintf(stderr, "%s: header word %d (%s) is %d, this run's is %d%s\n", path, i, what[i], header[i], want[i],
                    i >= 6 && i <= 9 ? ": the adapter was trained on another base model file" : "");
            exit(EXIT_FAILURE);
        }
    }
    if (header[10] < 0) {
        fprintf(stderr, "%s: negative step %d in header word 10\n", path, header[10]);
        exit(EXIT_FAILURE);
    }
    size_t n = a->store.num_parameters;
    float* values = (float*)malloc_for(n * sizeof(float), "the adapter's parameters", path);
    fread_check(values, sizeof(float), n, f, path);
    fclose_check(f, path);
    floatX* rounded = (floatX*)malloc_check(n * sizeof(floatX));
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(values[i])) {
            fprintf(stderr, "%s: parameter %zu is not finite (%g)\n", path, i, values[i]);
            exit(EXIT_FAILURE);
        }
        rounded[i] = (floatX)values[i];
    }
    sharded_parameters_set(&a->store, rounded);
    free(rounded);
    free(values);
    return header[10];
}

// A buffer laid out as the adapter's set (its parameters or gradients) on the host, fp32. Its set is never ZeRO-3:
// every process holds all of it.
static float* adapter_host_values(const Model* model, const floatX* device) {
    const ShardedParameters* p = &model->adapter->store;
    floatX* device_values = (floatX*)malloc_check(p->num_parameters * sizeof(floatX));
    cudaCheck(cudaMemcpy(device_values, device, p->num_parameters * sizeof(floatX), cudaMemcpyDeviceToHost));
    float* values = (float*)malloc_check(p->num_parameters * sizeof(float));
    for (size_t i = 0; i < p->num_parameters; i++) values[i] = (float)device_values[i];
    free(device_values);
    return values;
}
static float* adapter_host_parameters(const Model* model) {
    return adapter_host_values(model, model->adapter->store.params_memory);
}

// A checkpoint's adapter file (collective over mg: under ZeRO-1 the optimizer state is gathered over the data-parallel
// processes, model->multi_gpu, which hold the set's shards; under -pp every stage's hold the same): the parameters of
// `step`, then the whole set's optimizer state, m and v (and the fp32 master weights when the run keeps them), so that
// a run resumes from it at any process count and ZeRO stage. Process 0 writes, under a temporary name, then renames.
static void adapter_write_checkpoint(const Model* model, const char* path, int step, const MultiGpuConfig* mg,
                                  cudaStream_t stream) {
    const ShardedParameters* p = &model->adapter->store;
    size_t n = p->num_parameters, padded = p->num_parameters_padded;
    int buffers = p->has_master ? 3 : 2;
    float* device_state;
    cudaCheck(cudaMalloc((void**)&device_state, padded * sizeof(float)));
    float* state = (float*)malloc_check((size_t)buffers * padded * sizeof(float));
    for (int b = 0; b < buffers; b++) {
        sharded_parameters_gather_state(p, b, device_state, model->multi_gpu, model->adapter->zero_stage, stream);
        cudaCheck(cudaMemcpy(state + (size_t)b * padded, device_state, padded * sizeof(float), cudaMemcpyDeviceToHost));
    }
    cudaCheck(cudaFree(device_state));
    if (mg->process_rank == 0) {
        int header[256];
        adapter_file_header(model, step, header);
        header[12] = 1;
        header[13] = p->has_master;
        float* values = adapter_host_parameters(model);
        char* tmp;
        FILE* f = fopen_tmp_for(path, &tmp);
        fwrite_check(header, sizeof(int), 256, f, tmp);
        fwrite_check(values, sizeof(float), n, f, tmp);
        for (int b = 0; b < buffers; b++) fwrite_check(state + (size_t)b * padded, sizeof(float), n, f, tmp);
        commit_tmp(f, tmp, path);
        free(tmp);
        free(values);
    }
    free(state);
}

// After the optimizer is allocated, from a checkpoint's adapter file (adapter_read_file read its parameters): this
// process's shard of m, v and the master weights. Its master weights must be the run's (-w, the precision).
static void adapter_read_optimizer_state(Model* model, const char* path) {
    ShardedParameters* p = &model->adapter->store;
    FILE* f = fopen_check(path, "rb");
    int header[256];
    read_versioned_header_check(f, header, path, ADAPTER_FILE_MAGIC, ADAPTER_FILE_VERSION, "adapter");
    if (header[12] != 1 || header[13] != p->has_master) {
        fprintf(stderr, "%s: %s; this run needs m and v%s (header words 12, 13: %d, %d)\n", path,
                header[12] != 1 ? "no optimizer state (not a checkpoint's adapter)" : "another run's master weights",
                p->has_master ? " and fp32 master weights" : " without master weights", header[12], header[13]);
        exit(EXIT_FAILURE);
    }
    size_t n = p->num_parameters;
    float* full = (float*)calloc(p->num_parameters_padded, sizeof(float));  // the padding stays zero
    if (!full) {
        fprintf(stderr, "%s: out of host memory for the optimizer state\n", path);
        exit(EXIT_FAILURE);
    }
    fseek_check(f, 256 * sizeof(int) + n * sizeof(float), path);
    for (int b = 0; b < (p->has_master ? 3 : 2); b++) {
        fread_check(full, sizeof(float), n, f, path);
        sharded_parameters_scatter_state(p, b, full);
    }
    if (fgetc(f) != EOF) {
        fprintf(stderr, "%s: file is longer than an adapter checkpoint\n", path);
        exit(EXIT_FAILURE);
    }
    fclose_check(f, path);
    free(full);
}

// The merged model: W += s B A for every targeted weight of the whole model in model-file order (host), each sum in
// fp32 over the r products, rounded once to floatX. A tied model's classifier is wte, which the encoder reads too:
// an adapter on its lm_head has no merged form (lora_can_merge).
static int lora_can_merge(const Model* model) {
    return !(model->config.tied && ((model->adapter_targets >> LORA_LM_HEAD) & 1));
}
static void lora_merge(const Model* model, floatX* file_order) {
    const Adapter* a = model->adapter;
    const int weight_tensor[LORA_NUM_TARGETS] = {PARAM_QKVW, PARAM_ATTPROJW, PARAM_FCW, PARAM_FCPROJW, PARAM_LM_HEAD,
                                                 PARAM_EXTENSION, PARAM_EXTENSION};
    size_t file_sizes[NUM_PARAMETER_TENSORS];
    file_tensor_sizes(file_sizes, model);
    float* values = adapter_host_parameters(model);
    int r = a->rank;
    for (int t = 0; t < LORA_NUM_TARGETS; t++) {
        if (!lora_has(model, t)) continue;
        int C, OC, slot = 0;
        size_t L = lora_target_shape(model, t, &C, &OC, &slot), w_offset = 0;
        int tensor = weight_tensor[t] + (lora_is_expert_target(t) ? slot : 0);
        for (int i = 0; i < tensor; i++) w_offset += file_sizes[i];
        for (size_t l = 0; l < L; l++) {
            floatX* W = file_order + w_offset + (size_t)l * OC * C;
            const float* A = values + sharded_parameters_offset(&a->store, 2 * t) + (size_t)l * r * C;
            const float* B = values + sharded_parameters_offset(&a->store, 2 * t + 1) + (size_t)l * OC * r;
            for (int o = 0; o < OC; o++)
                for (int c = 0; c < C; c++) {
                    float delta = 0.0f;
                    for (int k = 0; k < r; k++) delta += B[(size_t)o * r + k] * A[(size_t)k * C + c];
                    W[(size_t)o * C + c] = (floatX)((float)W[(size_t)o * C + c] + a->scale * delta);
                }
        }
    }
    free(values);
}

// -fm: the model file of the base model with the adapter merged (collective as model_write_model_file)
static void model_write_merged_model_file(Model* model, const char* path, cudaStream_t stream) {
    model_write_model_file_edited(model, path, stream, lora_merge);
}
