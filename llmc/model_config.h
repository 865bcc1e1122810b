// llmc/model_config.h: the model's configuration (doc/architecture.md): its sizes, its family and the layer kinds the
// family chooses (the norm, how attention sees positions, the dense FFN's activation, biases), the widths that
// follow from the kinds, and the checks a configuration passes before a model is built: each kernel header's size
// limits and a llama model's family values, named as a model file's header word or as the trainer's flag.
// train_gpt.cu includes it after the kernel headers, whose *_support checks it calls.
// Tests: train-gpt-cli (refused sizes and family values, from files and flags), and every gpt-* and llama-* row.
#pragma once

// The model family (header word 16, doc/formats.md): GPT-2, or the Llama-style model of doc/kernels.md. A family is
// a file format and a choice of layer kinds (config_set_family); the passes see only the kinds.
typedef enum { FAMILY_GPT2 = 0, FAMILY_LLAMA = 1 } ModelFamily;

// The kinds a layer is made of (doc/architecture.md): its norm, how its attention sees positions, and its dense FFN's
// activation (an extension's FFN, in the layers it replaces, is a kind of its own: FfnKind below).
typedef enum { NORM_LAYERNORM, NORM_RMSNORM } NormKind;          // LayerNorm keeps means and has a bias
typedef enum { POSITIONS_LEARNED, POSITIONS_ROPE } PositionKind;  // wpe added by the encoder, or q and k roped
typedef enum { ACTIVATION_GELU, ACTIVATION_SWIGLU } FfnActivation;  // SwiGLU: fc holds [gate | up], 2H rows

typedef struct {
    int max_seq_len;        // maxT
    int vocab_size;         // V
    int padded_vocab_size;  // Vp, V rounded up to a multiple of 128
    int num_layers;         // L
    int num_heads;          // NH
    int channels;           // C
    // the family and what it decides (header words 16..21 for llama; GPT-2's values are implied: NKV = NH, H = 4C,
    // tied, no RoPE, LayerNorm's eps)
    int family;             // ModelFamily
    int num_kv_heads;       // NKV: key/value heads, dividing NH
    float rope_theta;       // RoPE: its base
    int ffn_hidden;         // H: the MLP's hidden size (GPT-2 4C; llama the SwiGLU's, fc has 2H outputs)
    float norm_eps;         // RMSNorm: its eps
    int tied;               // the output embedding is wte (GPT-2 always; llama 0: lm_head)
    // the layer kinds, from the family
    NormKind norm;
    PositionKind positions;
    FfnActivation activation;
    int biases;             // the linear layers and the norms have biases (GPT-2)
} ModelConfig;

static void config_set_family(ModelConfig* c, ModelFamily family) {
    c->family = family;
    int llama = family == FAMILY_LLAMA;
    c->norm = llama ? NORM_RMSNORM : NORM_LAYERNORM;
    c->positions = llama ? POSITIONS_ROPE : POSITIONS_LEARNED;
    c->activation = llama ? ACTIVATION_SWIGLU : ACTIVATION_GELU;
    c->biases = !llama;
}
static const char* family_name(int family) { return family == FAMILY_LLAMA ? "llama" : "gpt2"; }
// the packed qkv's channels, (NH + 2 NKV) HS (3C for GPT-2), and fc's outputs ([gate | up] for SwiGLU)
static size_t qkv_channels(const ModelConfig* c) {
    return (size_t)(c->num_heads + 2 * c->num_kv_heads) * (c->channels / c->num_heads);
}
static size_t fc_channels(const ModelConfig* c) {
    return (size_t)(c->activation == ACTIVATION_SWIGLU ? 2 : 1) * c->ffn_hidden;
}
// Llama's SwiGLU hidden size when not given (train_gpt.py's default_ffn_hidden): floor(8C/3) rounded up to 64
static int llama_default_ffn_hidden(int C) { return (8 * C / 3 + 63) / 64 * 64; }
// GPT-2's values of the family words, once its sizes are known (a GPT-2 file leaves words 16..21 zero)
static void config_gpt2_family(ModelConfig* c) {
    config_set_family(c, FAMILY_GPT2);
    c->num_kv_heads = c->num_heads;
    c->rope_theta = 0.0f;
    c->ffn_hidden = 4 * c->channels;
    c->norm_eps = 0.0f;
    c->tied = 1;
}

// A llama model's family values (doc/formats.md: what a reader refuses; the kernels' own limits on top): 0 and `why`
// naming the value, as a model file's header word (from_file) or as the trainer's flag.
static int llama_config_check(const ModelConfig* c, int from_file, char* why, size_t size) {
    const char* kv = from_file ? "header word 17 (NKV)" : "-kv";
    const char* theta = from_file ? "header word 18 (RoPE theta)" : "-rt";
    const char* hidden = from_file ? "header word 19 (H)" : "-fh";
    const char* eps = from_file ? "header word 20 (RMSNorm eps)" : "-eps";
    const char* tied = from_file ? "header word 21 (tied)" : "-tie";
    char kernel[200];
    if (c->num_kv_heads < 1 || c->num_heads % c->num_kv_heads != 0)
        snprintf(why, size, "%s %d: the key/value heads must divide the %d heads", kv, c->num_kv_heads, c->num_heads);
    else if ((c->channels / c->num_heads) % 2 != 0)
        snprintf(why, size, "-arch llama: RoPE needs an even head size (C=%d / NH=%d = %d)", c->channels, c->num_heads,
                 c->channels / c->num_heads);
    else if (!flash_attention_support(c->channels, c->num_heads, c->num_kv_heads, kernel, sizeof(kernel)))
        snprintf(why, size, "-arch llama runs on flash attention: %s", kernel);  // its head sizes suit RoPE's kernels
    else if (!isfinite(c->rope_theta) || !(c->rope_theta > 1.0f))  // a base <= 1 would not decay with i
        snprintf(why, size, "%s %g: RoPE theta must be finite and greater than 1", theta, c->rope_theta);
    else if (!swiglu_support(c->ffn_hidden, kernel, sizeof(kernel)))
        snprintf(why, size, "%s %d: %s", hidden, c->ffn_hidden, kernel);
    else if (!rmsnorm_support(c->channels, c->norm_eps, kernel, sizeof(kernel)))
        snprintf(why, size, "%s %g: %s", eps, c->norm_eps, kernel);
    else if (c->tied != 0 && c->tied != 1)
        snprintf(why, size, "%s %d: expected 0 (own lm_head) or 1 (tied to wte)", tied, c->tied);
    else
        return 1;
    return 0;
}

static void check_config_supported(const ModelConfig* c, const char* source, int from_file) {
    char why[256];
    if (c->channels <= 0 || c->num_layers <= 0 || c->num_heads <= 0 || c->vocab_size <= 0 || c->max_seq_len <= 0 ||
        c->padded_vocab_size < c->vocab_size) {
        fprintf(stderr, "%s: invalid model sizes (L=%d NH=%d C=%d V=%d Vp=%d maxT=%d)\n", source, c->num_layers,
                c->num_heads, c->channels, c->vocab_size, c->padded_vocab_size, c->max_seq_len);
        exit(EXIT_FAILURE);
    }
    if (c->channels % c->num_heads != 0) {
        fprintf(stderr, "%s: channels (%d) must be a multiple of the number of heads (%d)\n", source, c->channels,
                c->num_heads);
        exit(EXIT_FAILURE);
    }
    // each kernel header's own size check
    if (!encoder_support(c->channels, why, sizeof(why)) || !layernorm_support(c->channels, why, sizeof(why)) ||
        !fused_classifier_support(c->vocab_size, c->padded_vocab_size, why, sizeof(why)) ||
        !matmul_support(c->channels, why, sizeof(why))) {
        fprintf(stderr, "%s: unsupported model size: %s\n", source, why);
        exit(EXIT_FAILURE);
    }
    if (c->family == FAMILY_LLAMA && !llama_config_check(c, from_file, why, sizeof(why))) {
        fprintf(stderr, "%s: %s\n", source, why);
        exit(EXIT_FAILURE);
    }
}
