// llmc/model_file.h: the model file (doc/formats.md, "GPT-2 model file" and "MoE model file") and the descriptors:
// building a model from a file (model_build_from_checkpoint), from a descriptor's shape and seeded initialisation
// (model_build_from_descriptor, -e dN), and writing its file (model_write_model_file, collective). train_gpt.cu includes
// it after the model's sizes, allocation and parameter copies (model_allocate_parameters, model_set_parameters,
// model_get_parameters, check_config_supported), which it uses; an extension's format comes through its
// ModelFileExtension (llmc/model_extension.h). Tests: train-gpt-cli and train-moe-cli (malformed files, resumes),
// and every gpt-*, llama-* and moe-* row, whose models are read from the reference's files.
#pragma once

// A model file's parameter that is not finite is refused, named by its tensor and index: one that no batch reaches (a
// wpe row past -t) would otherwise train on while every checkpoint's parameter check fails.
static void model_refuse_non_finite(const Model* model, const char* path, size_t at, float value) {
    size_t sizes[NUM_PARAMETER_TENSORS], first = 0;
    file_tensor_sizes(sizes, model);
    int i = 0;
    while (i < NUM_PARAMETER_TENSORS - 1 && at >= first + sizes[i]) first += sizes[i++];
    fprintf(stderr, "%s: parameter %s, element %zu (value %g; the file's parameter %zu), is not finite\n", path,
            parameter_name(model, i), at - first, value, at);
    exit(EXIT_FAILURE);
}

// Loads a model file, converted to floatX: a GPT-2 file in llm.c's format (version 3 fp32, 5 bf16; header word
// 16 = 1: the llama family), or with an extension its format (train_moe.cu: doc/formats.md).
static void model_build_from_checkpoint(Model* model, const char* path) {
    const ModelFileExtension* x = model->extension.file;
    FILE* f = fopen_check(path, "rb");
    int header[256];
    read_header_check(f, header, path, x->model_magic, x->model_name);
    // words 16..21 describe the model family (doc/formats.md): train_gpt.py and train_moe.py --arch llama write word
    // 16 = 1; another family's payload would otherwise fail the size check with a misleading message
    if (header[16] != FAMILY_GPT2 && header[16] != FAMILY_LLAMA) {
        fprintf(stderr, "%s: model family %d in header word 16 (1 = llama; doc/formats.md): this trainer reads only "
                "gpt2 (0) and llama (1) files\n", path, header[16]);
        exit(EXIT_FAILURE);
    }
    for (int i = 17; i <= 21 && header[16] == FAMILY_GPT2; i++) {
        if (header[i] != 0) {
            fprintf(stderr, "%s: header word %d = %d, but a GPT-2-family file has 0 in words 17 to 21 (doc/formats.md)\n",
                    path, i, header[i]);
            exit(EXIT_FAILURE);
        }
    }
    int version = header[1];
    int fp32_version = x->fp32_version, bf16_version = x->bf16_version;
    if (version != fp32_version && version != bf16_version) {
        fprintf(stderr, "%s: unsupported model file version %d (expected %d for fp32 or %d for bf16)\n", path, version,
                fp32_version, bf16_version);
        exit(EXIT_FAILURE);
    }
    ModelConfig* c = &model->config;
    c->max_seq_len = header[2];
    c->vocab_size = header[3];
    c->num_layers = header[4];
    c->num_heads = header[5];
    c->channels = header[6];
    c->padded_vocab_size = header[7];
    config_gpt2_family(c);
    if (header[16] == FAMILY_LLAMA) {
        config_set_family(c, FAMILY_LLAMA);
        c->num_kv_heads = header[17];
        memcpy(&c->rope_theta, &header[18], sizeof(float));  // fp32 bits
        c->ffn_hidden = header[19];
        memcpy(&c->norm_eps, &header[20], sizeof(float));
        c->tied = header[21];
    }
    if (x->read_header) x->read_header(model, header, path);
    check_config_supported(c, path, 1);
    if (model->extension.ffn->configure) model->extension.ffn->configure(model, path);
    // The header's sizes are checked against the file's length before anything is allocated for them: a corrupt
    // header must fail fast with "truncated", not ask for terabytes. In double first, where no product overflows.
    double HS = (double)c->channels / c->num_heads, embeddings = c->tied ? 1.0 : 2.0;
    double per_layer = (c->num_heads + 2.0 * c->num_kv_heads) * HS + c->channels +
                       (double)fc_channels(c) + c->ffn_hidden;  // qkvw, attprojw, fcw, fcprojw: GPT-2 12C
    double estimate = (double)c->padded_vocab_size * c->channels * embeddings +
                      (double)c->max_seq_len * c->channels + (double)c->num_layers * c->channels * per_layer;
    if (estimate > 1e15) {
        fprintf(stderr, "%s: its header describes a model of about %.3g parameters (L=%d C=%d V=%d maxT=%d): not a model "
                "file this trainer can load\n", path, estimate, c->num_layers, c->channels, c->vocab_size, c->max_seq_len);
        exit(EXIT_FAILURE);
    }
    size_t n = model_num_parameters(model);
    size_t file_elem = version == fp32_version ? sizeof(float) : sizeof(__nv_bfloat16);
    size_t tail_bytes = x->file_tail_bytes ? x->file_tail_bytes(model) : 0;
    size_t expected_bytes = 256 * sizeof(int) + n * file_elem + tail_bytes;
    if (fseek(f, 0, SEEK_END) != 0) {
        fprintf(stderr, "%s: cannot seek to the end to check its size\n", path);
        exit(EXIT_FAILURE);
    }
    size_t file_bytes = (size_t)ftell(f);
    if (file_bytes < expected_bytes) {
        fprintf(stderr, "%s is truncated: its header describes %zu parameters (%zu bytes with the header), the file has "
                "%zu bytes\n", path, n, expected_bytes, file_bytes);
        exit(EXIT_FAILURE);
    }
    if (file_bytes > expected_bytes) {  // a longer file is not the model its header describes
        fprintf(stderr, "%s: file is longer than its header's model (%zu parameters, %zu bytes with the header; the file "
                "has %zu)\n", path, n, expected_bytes, file_bytes);
        exit(EXIT_FAILURE);
    }
    if (fseek(f, 256 * sizeof(int), SEEK_SET) != 0) {
        fprintf(stderr, "%s: cannot seek to its parameters\n", path);
        exit(EXIT_FAILURE);
    }
    check_parameter_memory(model, path);
    model_allocate_parameters(model);
    void* raw = malloc_for(n * file_elem, "the parameters as stored", path);
    fread_check(raw, file_elem, n, f, path);
    if (x->read_file_tail) x->read_file_tail(model, f, path);
    fclose_check(f, path);
    floatX* host = (floatX*)malloc_for(n * sizeof(floatX), "the parameters", path);
    for (size_t i = 0; i < n; i++) {
        float v = version == fp32_version ? ((float*)raw)[i] : __bfloat162float(((__nv_bfloat16*)raw)[i]);
        if (!isfinite(v)) model_refuse_non_finite(model, path, i, v);
        host[i] = (floatX)v;
    }
    model_set_parameters(model, host);
    free(host);
    free(raw);
}

// "d12" etc.: GPT-2 sizes (d12 = 124M, d24 = 350M, d36 = 774M, d48 = 1558M), or dN for C = 64N with
// N heads of 64; vocabulary and maxT from -ev and -et. GPT-2 initialisation, seeded. `arch` gives the family and
// its values (family, num_kv_heads, rope_theta, ffn_hidden, norm_eps, tied; NKV 0: NH, H 0: llama's default),
// NULL: GPT-2.
// The GPT-2 of descriptor dN: GPT-2's own sizes at depths 12, 24, 36 and 48 (124M, 350M, 774M, 1558M), else C = 64 N
// with N heads of 64
static void model_descriptor_shape(ModelConfig* c, int depth, int vocab_size, int max_seq_len) {
    c->num_layers = depth;
    if (depth == 12) { c->channels = 768; c->num_heads = 12; }
    else if (depth == 24) { c->channels = 1024; c->num_heads = 16; }
    else if (depth == 36) { c->channels = 1280; c->num_heads = 20; }
    else if (depth == 48) { c->channels = 1600; c->num_heads = 25; }
    else { c->channels = 64 * depth; c->num_heads = depth; }
    c->vocab_size = vocab_size;
    c->padded_vocab_size = CEIL_DIV(vocab_size, 128) * 128;
    c->max_seq_len = max_seq_len;
    config_gpt2_family(c);
}

// x rounded into the model's precision as the cast (floatX)x rounds it: to nearest even, and for bf16 a NaN to
// __float2bfloat16's canonical one. Inline integer operations, where the cast is a call per number in the sanitized
// -O1 build: GPT-2 1.5B's initialisation rounds 1.5e9 of them.
UNINSTRUMENTED static floatX round_to_floatX(float x) {
#if defined(ENABLE_FP32) || defined(ENABLE_FP16)
    return (floatX)x;
#else
    uint32_t bits;
    memcpy(&bits, &x, sizeof(bits));
    __nv_bfloat16_raw r;
    r.x = (unsigned short)((bits & 0x7fffffffu) > 0x7f800000u ? 0x7fffu : (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
    return r;
#endif
}

// normal_chunked's take: values[0, count) rounded into the floatX tensor ctx at offset
UNINSTRUMENTED static void take_rounded(void* ctx, size_t offset, const float* values, size_t count) {
    floatX* out = (floatX*)ctx + offset;
    for (size_t j = 0; j < count; j++) out[j] = round_to_floatX(values[j]);
}

// A model's shape from descriptor dN (the llama family's fields from `arch`), checked, before anything is allocated.
// With `allocate`, its parameters too, initialised from `seed`.
static void model_build_from_descriptor(Model* model, const char* descriptor, int vocab_size, int max_seq_len,
                                       unsigned int seed, const ModelConfig* arch, int allocate = 1) {
    if (descriptor[0] != 'd' || !isdigit((unsigned char)descriptor[1])) {
        fprintf(stderr, "-e %s: expected a model file or a descriptor such as d12\n", descriptor);
        exit(EXIT_FAILURE);
    }
    char* end;
    long depth = strtol(descriptor + 1, &end, 10);
    if (*end != '\0' || depth <= 0 || depth > 200) {
        fprintf(stderr, "-e %s: bad descriptor (expected dN with N in 1..200)\n", descriptor);
        exit(EXIT_FAILURE);
    }
    ModelConfig* c = &model->config;
    model_descriptor_shape(c, (int)depth, vocab_size, max_seq_len);
    if (arch && arch->family == FAMILY_LLAMA) {
        config_set_family(c, FAMILY_LLAMA);
        c->num_kv_heads = arch->num_kv_heads > 0 ? arch->num_kv_heads : c->num_heads;
        c->rope_theta = arch->rope_theta;
        c->ffn_hidden = arch->ffn_hidden > 0 ? arch->ffn_hidden : llama_default_ffn_hidden(c->channels);
        c->norm_eps = arch->norm_eps;
        c->tied = arch->tied;
    }
    check_config_supported(c, descriptor, 0);
    if (model->extension.ffn->configure) model->extension.ffn->configure(model, descriptor);
    if (!allocate) return;
    check_parameter_memory(model, descriptor);
    model_allocate_parameters(model);
    // GPT-2 init: weights N(0, 0.02), residual projections N(0, 0.02/sqrt(2L)), biases 0, LayerNorm 1/0;
    // padded vocabulary rows stay zero. Llama the same (train_gpt.py's init_weights, without its test perturbation
    // of the norm weights): its matrices, lm_head among them, N(0, 0.02), attprojw and fcprojw scaled, RMSNorm 1. Drawn tensor by tensor from one seeded mt19937, in model-file order (with
    // an extension's tensors whole, as in the file, so that the weights do not depend on the process layout).
    // Each tensor is drawn in fp32 in pieces (normal_chunked) and rounded into the model's precision as it is drawn:
    // GPT-2 1.5B's largest tensor would take 2 GB of fp32 draws at once.
    size_t num_parameters = model_num_parameters(model), sizes[NUM_PARAMETER_TENSORS];
    file_tensor_sizes(sizes, model);
    floatX* hx = (floatX*)malloc_check(num_parameters * sizeof(floatX));
    const size_t chunk = 1 << 16;
    float* draw = (float*)malloc_check(chunk * sizeof(float));
    mt19937_state rng;
    manual_seed(&rng, seed);
    size_t offset = 0;
    float residual_scale = 1.0f / sqrtf(2.0f * c->num_layers);
    for (int i = 0; i < NUM_PARAMETER_TENSORS; i++) {
        size_t n = sizes[i], drawn = 0;  // hx[offset, offset + drawn) are set, the rest zeros
        int slot = i - PARAM_EXTENSION;
        if (i == PARAM_LN1W || i == PARAM_LN2W || i == PARAM_LNFW) {
            const floatX one = round_to_floatX(1.0f);
            for (size_t j = 0; j < n; j++) hx[offset + j] = one;
            drawn = n;
        } else if (parameter_decay(model, i)) {
            float std;
            if (slot >= 0 && slot < MLP_EXTENSION_SLOTS) std = model->extension.ffn->init_std(model, slot, residual_scale);
            else std = i == PARAM_ATTPROJW || i == PARAM_FCPROJW ? 0.02f * residual_scale : 0.02f;
            size_t rows_used = n;
            if ((i == PARAM_WTE || i == PARAM_LM_HEAD) && n > 0)  // the padded vocabulary rows stay zero
                rows_used = (size_t)c->vocab_size * c->channels;
            if (std > 0.0f && rows_used >= 16) {
                normal_chunked(rows_used, 0.0f, std, &rng, draw, chunk, take_rounded, hx + offset);
                drawn = rows_used;
            } else if (std > 0.0f) {  // torch's double-precision path for fewer than 16
                normal_(draw, rows_used, 0.0f, std, &rng);
                take_rounded(hx + offset, 0, draw, rows_used);
                drawn = rows_used;
            }
        }
        const floatX zero = round_to_floatX(0.0f);
        for (size_t j = drawn; j < n; j++) hx[offset + j] = zero;
        offset += n;
    }
    free(draw);
    model_set_parameters(model, hx);
    free(hx);
}

// The model file's header (256 words) as this build writes them: llm.c's format for GPT-2 (version 5 bf16 from a
// BF16 build, 3 fp32 otherwise) with a llama model's family in words 16..21, an extension's own otherwise.
static void model_file_header(const Model* model, int* header) {
    const ModelConfig* c = &model->config;
    const ModelFileExtension* x = model->extension.file;
    for (int i = 8; i < 256; i++) header[i] = 0;
    if (c->family == FAMILY_LLAMA) {
        header[16] = FAMILY_LLAMA;
        header[17] = c->num_kv_heads;
        memcpy(&header[18], &c->rope_theta, sizeof(float));
        header[19] = c->ffn_hidden;
        memcpy(&header[20], &c->norm_eps, sizeof(float));
        header[21] = c->tied;
    }
    header[0] = x->model_magic;
    header[1] = PRECISION_MODE == PRECISION_BF16 ? x->bf16_version : x->fp32_version;
    header[2] = c->max_seq_len;
    header[3] = c->vocab_size;
    header[4] = c->num_layers;
    header[5] = c->num_heads;
    header[6] = c->channels;
    header[7] = c->padded_vocab_size;
    if (x->write_header) x->write_header(model, header);
}

// Writes the model file. Process 0 writes, after an extension gathered its own part (collective over its groups;
// processes that take no part return at once).
// edit: NULL, or what changes the whole model's parameters (host, model-file order) before they are written
static void model_write_model_file_edited(Model* model, const char* path, cudaStream_t stream,
                                          void (*edit)(const Model* model, floatX* file_order)) {
    const FfnExtension* x = model->extension.ffn;
    if (x->gathers_model_file && !x->gathers_model_file(model)) return;
    int header[256] = {0};
    model_file_header(model, header);
    size_t n = model_num_parameters(model);
    floatX* host = (floatX*)malloc_check(n * sizeof(floatX));
    model_get_parameters(model, host, stream);
    // the first stage's first data-parallel group's first member
    if (model->process_rank != 0 || model_tp_member(model) != 0 || model_pp_stage(model) != 0) {
        free(host);
        return;
    }
    if (edit) edit(model, host);
    char* tmp;
    FILE* f = fopen_tmp_for(path, &tmp);
    fwrite_check(header, sizeof(int), 256, f, tmp);
    if (PRECISION_MODE == PRECISION_BF16) {
        fwrite_check(host, sizeof(floatX), n, f, tmp);
    } else {
        float* h32 = (float*)malloc_check(n * sizeof(float));
        for (size_t i = 0; i < n; i++) h32[i] = (float)host[i];
        fwrite_check(h32, sizeof(float), n, f, tmp);
        free(h32);
    }
    if (model->extension.file->write_file_tail) model->extension.file->write_file_tail(model, f, tmp);
    commit_tmp(f, tmp, path);
    free(tmp);
    free(host);
}
static void model_write_model_file(Model* model, const char* path, cudaStream_t stream) {
    model_write_model_file_edited(model, path, stream, NULL);
}
