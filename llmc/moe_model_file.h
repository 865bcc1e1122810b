// llmc/moe_model_file.h: the MoE model file's own parts (doc/formats.md, "MoE model file"): its magic, the header
// words of the MoE shape and the routing options with every check a reader makes, the checks of a descriptor's MoE
// shape, and the tail of balancing biases after the parameters. train_moe.cu includes it after llmc/moe_ffn.h and
// fills train_gpt.cu's ModelFileExtension table with it (the parameters themselves are read and written through the
// FFN kind: moe_set_parameters, moe_get_parameters).
// Tests: train-moe-cli (malformed and truncated files, every refused header word), and every moe-* row, whose models
// are read from train_moe.py's files.
#pragma once

#define MOE_MODEL_MAGIC 20261129

// ----------------------------------------------------------------------------------------------------
// The header words and their checks

// The routing options' header words (doc/formats.md, "MoE model file"): 24 the revision, 25 and 26 the shared
// experts, 27 the score, 28 rsf's fp32 bits (0: 1.0), 29 the balancing biases (fp32, after the parameters:
// moe_read_file_tail); revision 2 adds 30 the dense layers first, 31 and 32 the expert groups and those kept.
// Every check of a reader is made.
#define MOE_REVISION_WORD 24
#define MOE_SHARED_WORD 25
#define MOE_SHARED_HIDDEN_WORD 26
#define MOE_SCORE_WORD 27
#define MOE_ROUTED_SCALE_WORD 28
#define MOE_BIAS_WORD 29
#define MOE_FIRST_DENSE_WORD 30
#define MOE_GROUPS_WORD 31
#define MOE_KEPT_GROUPS_WORD 32

static void moe_header_refuse(const char* path, int word, int value, const char* why) {
    fprintf(stderr, "%s: header word %d = %d: %s (doc/formats.md, \"MoE model file\")\n", path, word, value, why);
    exit(EXIT_FAILURE);
}

static void moe_read_header(Model* model, const int* header, const char* path) {
    MoEConfig* c = &moe_of(model)->config;
    moe_of(model)->config_from_file = 1;
    c->num_experts = header[8];
    c->top_k = header[9];
    c->moe_every = header[10];
    c->expert_hidden = header[11];
    c->noisy_gating = header[12];
    if (c->noisy_gating != 0 && c->noisy_gating != 1) {
        fprintf(stderr, "%s: header[12] = %d: expected 0, or 1 for a noisy-gating model with routernw\n", path,
                c->noisy_gating);
        exit(EXIT_FAILURE);
    }
    if (c->num_experts < 1) {
        fprintf(stderr, "%s: %d experts: an MoE model has at least 1\n", path, c->num_experts);
        exit(EXIT_FAILURE);
    }
    const int revision = header[MOE_REVISION_WORD];
    if (revision < 0 || revision > 2) moe_header_refuse(path, MOE_REVISION_WORD, revision, "expected 0, 1 or 2");
    for (int i = MOE_SHARED_WORD; i <= MOE_KEPT_GROUPS_WORD && revision < 2; i++) {
        if (header[i] != 0 && (revision == 0 || i > MOE_BIAS_WORD))
            moe_header_refuse(path, i, header[i], revision == 0 ? "words 25 to 32 must be 0 when word 24 is 0"
                                                                : "words 30 to 32 must be 0 when word 24 is 1");
    }
    const int shared = header[MOE_SHARED_WORD], shared_hidden = header[MOE_SHARED_HIDDEN_WORD];
    if ((shared > 0) != (shared_hidden > 0) || shared < 0 || shared_hidden < 0) {
        fprintf(stderr, "%s: header words 25 and 26 (shared experts %d, their hidden size %d) must be both positive or "
                "both 0 (doc/formats.md, \"MoE model file\")\n", path, shared, shared_hidden);
        exit(EXIT_FAILURE);
    }
    c->shared_experts = shared;
    c->shared_hidden = shared_hidden;
    c->score = header[MOE_SCORE_WORD];
    if (c->score != MOE_SCORE_SOFTMAX && c->score != MOE_SCORE_SIGMOID)
        moe_header_refuse(path, MOE_SCORE_WORD, c->score, "the score must be 0 (softmax) or 1 (sigmoid)");
    c->routed_scale = 1.0f;
    if (header[MOE_ROUTED_SCALE_WORD] != 0) memcpy(&c->routed_scale, &header[MOE_ROUTED_SCALE_WORD], sizeof(float));
    if (!(isfinite(c->routed_scale) && c->routed_scale > 0.0f))
        moe_header_refuse(path, MOE_ROUTED_SCALE_WORD, header[MOE_ROUTED_SCALE_WORD],
                          "the routed scale (fp32 bits) must be finite and positive");
    const int bias = header[MOE_BIAS_WORD];
    if (bias != 0 && bias != 1) moe_header_refuse(path, MOE_BIAS_WORD, bias, "expected 0 or 1");
    if (bias && c->score != MOE_SCORE_SIGMOID)
        moe_header_refuse(path, MOE_BIAS_WORD, bias, "balancing biases need sigmoid scores (word 27 = 1)");
    c->balance_bias = bias;
    moe_of(model)->file_has_bias = bias;
    if (c->noisy_gating && c->score != MOE_SCORE_SOFTMAX)
        moe_header_refuse(path, MOE_SCORE_WORD, c->score, "noisy top-k gating (word 12 = 1) needs softmax scores");
    c->first_dense = header[MOE_FIRST_DENSE_WORD];
    c->expert_groups = header[MOE_GROUPS_WORD];
    c->kept_groups = header[MOE_KEPT_GROUPS_WORD];
    if (c->first_dense < 0) moe_header_refuse(path, MOE_FIRST_DENSE_WORD, c->first_dense, "expected >= 0");
    // the groups' sizes against E, k and the scores: moe_check_expert_groups once the shape is known
    if (c->expert_groups < 0 || (c->expert_groups > 0) != (c->kept_groups > 0))
        moe_header_refuse(path, MOE_GROUPS_WORD, c->expert_groups,
                          "words 31 and 32 (expert groups, groups kept) must be both positive or both 0");
}

// Today's Switch model keeps words 24..29 at 0 (a file an older reader loads); any routing option writes
// revision 1 with every word.
static void moe_write_header(const Model* model, int* header) {
    const MoEConfig* c = &moe_of(model)->config;
    header[8] = c->num_experts;
    header[9] = c->top_k;
    header[10] = c->moe_every;
    header[11] = c->expert_hidden;
    header[12] = c->noisy_gating;
    const int revision2 = c->first_dense > 0 || c->expert_groups > 0;
    if (revision2) {
        header[MOE_FIRST_DENSE_WORD] = c->first_dense;
        header[MOE_GROUPS_WORD] = c->expert_groups;
        header[MOE_KEPT_GROUPS_WORD] = c->kept_groups;
    }
    if (revision2 || c->shared_experts > 0 || c->score != MOE_SCORE_SOFTMAX || c->routed_scale != 1.0f) {
        header[MOE_REVISION_WORD] = revision2 ? 2 : 1;
        header[MOE_SHARED_WORD] = c->shared_experts;
        header[MOE_SHARED_HIDDEN_WORD] = c->shared_hidden;
        header[MOE_SCORE_WORD] = c->score;
        memcpy(&header[MOE_ROUTED_SCALE_WORD], &c->routed_scale, sizeof(float));
        header[MOE_BIAS_WORD] = c->balance_bias;  // implies sigmoid scores, so revision 1
    }
}

// The model's expert groups (doc/moe.md, "Routing options" 11): G dividing E in groups of at least 2 (a
// group's score sums its two largest), M <= G groups holding at least k experts, sigmoid scores (the sum is of
// affinities), and not beside -dl's groups.
static void moe_check_expert_groups(const MoEModel* moe, const char* source) {
    const MoEConfig* c = &moe->config;
    const int G = c->expert_groups, M = c->kept_groups, E = c->num_experts;
    if (G == 0) return;
    const char* why = NULL;
    char text[160];
    if (E % G != 0 || E / G < 2) {
        snprintf(text, sizeof(text), "must divide the %d experts into groups of at least 2", E);
        why = text;
    } else if (M > G) why = "keep more groups than there are";
    else if (M * (E / G) < c->top_k) {
        snprintf(text, sizeof(text), "keep groups of %d experts holding fewer than the top-k %d", E / G, c->top_k);
        why = text;
    } else if (c->score != MOE_SCORE_SIGMOID) why = "need sigmoid scores (a group's score sums two affinities)";
    else if (moe->settings.device_limit > 0)
        why = "are the model's: device-limited routing (-dl) would be a second grouping";
    if (why != NULL) {
        fprintf(stderr, "%s: %d expert groups, %d kept (-eg, -egk; header words 31, 32): they %s\n", source, G, M, why);
        exit(EXIT_FAILURE);
    }
}

// Device-limited routing (doc/moe.md, "Routing options" 9 and 10): the groups are the expert-parallel
// members, G = -ep; refused without groups, with M > G, with fewer than k experts in M groups, with noisy gating.
static void moe_check_device_limit(const MoEModel* moe, const char* source) {
    const MoEConfig* c = &moe->config;
    int M = moe->settings.device_limit, G = moe->ep.degree;
    if (M == 0) return;
    const char* why = NULL;
    char text[160];
    if (G == 1) why = "needs expert groups: the groups are the expert-parallel members (-ep G > 1)";
    else if (M > G) why = "is more than the expert groups (-ep)";
    else if (M * (c->num_experts / G) < c->top_k) {
        snprintf(text, sizeof(text), "groups of %d experts hold fewer than the top-k %d", c->num_experts / G,
                 c->top_k);
        why = text;
    } else if (c->noisy_gating) why = "is not defined with noisy top-k gating (its threshold is over all E experts)";
    if (why != NULL) {
        fprintf(stderr, "-dl %d -ep %d (%s): device-limited routing %s\n", M, G, source, why);
        exit(EXIT_FAILURE);
    }
}

// Once the GPT-2 sizes are known: a descriptor's default expert hidden size (the dense MLP's), the checks of the MoE
// shape, and (for a file's header) a size the file could hold at all, in double where nothing overflows.
static void moe_configure(Model* model, const char* source) {
    MoEModel* moe = moe_of(model);
    MoEConfig* c = &moe->config;
    const ModelConfig* g = &model->config;
    char why[256];
    if (!moe->config_from_file && c->expert_hidden <= 0) c->expert_hidden = g->ffn_hidden;  // gpt2 4C
    if (!moe->config_from_file) c->shared_hidden = c->shared_experts > 0 && c->shared_hidden <= 0 ? c->expert_hidden
                                                                                                  : c->shared_hidden;
    if (c->first_dense < 0 || c->first_dense >= g->num_layers) {
        fprintf(stderr, "%s: %d dense layers first: expected 0..%d (at least one MoE layer of %d)\n", source,
                c->first_dense, g->num_layers - 1, g->num_layers);
        exit(EXIT_FAILURE);
    }
    if (c->moe_every < 1 || c->moe_every > g->num_layers - c->first_dense) {
        fprintf(stderr, "%s: MoE every %d layers after %d dense ones: expected 1..%d\n", source, c->moe_every,
                c->first_dense, g->num_layers - c->first_dense);
        exit(EXIT_FAILURE);
    }
    if (c->top_k < 1 || c->top_k > c->num_experts) {
        fprintf(stderr, "%s: top-k %d: expected 1..%d (the number of experts)\n", source, c->top_k, c->num_experts);
        exit(EXIT_FAILURE);
    }
    if (!moe_support(g->channels, c->num_experts, c->top_k, c->expert_hidden, why, sizeof(why))) {
        fprintf(stderr, "%s: unsupported MoE size: %s\n", source, why);
        exit(EXIT_FAILURE);
    }
    if (c->noisy_gating && c->top_k >= c->num_experts) {
        fprintf(stderr, "%s: noisy top-k gating needs top-k (%d) below the number of experts (%d): its load loss "
                "compares with the (k+1)-th logit\n", source, c->top_k, c->num_experts);
        exit(EXIT_FAILURE);
    }
    if (c->shared_experts > 0 && c->shared_hidden % 8 != 0) {
        fprintf(stderr, "%s: shared expert hidden size %d: their GEMMs need a positive multiple of 8\n", source,
                c->shared_hidden);
        exit(EXIT_FAILURE);
    }
    double per_hidden = g->activation == ACTIVATION_SWIGLU ? 3.0 : 2.0;  // fc, fcproj: SwiGLU's fc has 2H rows
    double experts = (double)g->num_layers * g->channels * (c->num_experts * (c->expert_hidden * per_hidden + 2.0) +
                                                            c->shared_experts * (c->shared_hidden * per_hidden + 2.0));
    if (experts > 1e15) {
        fprintf(stderr, "%s: its header describes experts of about %.3g parameters (L=%d E=%d C=%d H=%d S=%d H_s=%d): "
                "not a model file this trainer can load\n", source, experts, g->num_layers, c->num_experts,
                g->channels, c->expert_hidden, c->shared_experts, c->shared_hidden);
        exit(EXIT_FAILURE);
    }
    if (c->num_experts % moe->ep.degree != 0) {
        fprintf(stderr, "-ep %d: the %d experts per MoE layer must divide evenly over the expert-parallel degree\n",
                moe->ep.degree, c->num_experts);
        exit(EXIT_FAILURE);
    }
    moe->local_experts = c->num_experts / moe->ep.degree;
    if (moe->expert_tp > 1 && c->expert_hidden % (8 * moe->expert_tp) != 0) {
        fprintf(stderr, "-etp %d: %s: the experts' hidden size %d must be a multiple of %d (each member's %d-th "
                "of it a multiple of 8 for its GEMMs)\n", moe->expert_tp, source, c->expert_hidden, 8 * moe->expert_tp,
                moe->expert_tp);
        exit(EXIT_FAILURE);
    }
    if (moe->settings.bias_gamma > 0.0f && c->score != MOE_SCORE_SIGMOID) {
        fprintf(stderr, "-rb %g: aux-loss-free balancing needs sigmoid scores (-rs sigmoid; %s has softmax): the "
                "bias is added to the affinities, and softmax's top-k is defined on the logits\n",
                moe->settings.bias_gamma, source);
        exit(EXIT_FAILURE);
    }
    if (moe->settings.bias_gamma > 0.0f) c->balance_bias = 1;  // a model without biases starts them at 0
    moe_check_device_limit(moe, source);
    moe_check_expert_groups(moe, source);
}

// ----------------------------------------------------------------------------------------------------
// The tail after the parameters

// The model file's tail: the balancing biases, Lm * E fp32 values after the parameters whatever the payload's
// precision (doc/formats.md, "MoE model file"), when the file's header word 29 says so (reading) or the model has
// them (writing). Under -pp each stage reads its MoE layers' rows; the writer has every stage's (moe_get_parameters).
static size_t moe_file_tail_bytes(const Model* model) {
    const MoEModel* moe = moe_of(model);
    return moe->file_has_bias ? (size_t)num_moe_layers(model) * moe->config.num_experts * sizeof(float) : 0;
}
static void moe_read_file_tail(Model* model, FILE* f, const char* path) {
    MoEModel* moe = moe_of(model);
    if (!moe->file_has_bias) return;
    size_t n = (size_t)num_moe_layers(model) * moe->config.num_experts;
    float* host = (float*)malloc_check(n * sizeof(float));
    fread_check(host, sizeof(float), n, f, path);
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(host[i])) {
            fprintf(stderr, "%s: balancing bias %zu (MoE layer %zu, expert %zu) is not finite\n", path, i,
                    i / moe->config.num_experts, i % moe->config.num_experts);
            exit(EXIT_FAILURE);
        }
    }
    int Lmodel = num_moe_layers(model), E = moe->config.num_experts;
    int* model_index = (int*)malloc_check((size_t)Lmodel * sizeof(int));
    int Lm = moe_stage_model_indices(model, model_index);
    for (int m = 0; m < Lm; m++)
        cudaCheck(cudaMemcpy(moe->balance_bias + (size_t)m * E, host + (size_t)model_index[m] * E, E * sizeof(float),
                             cudaMemcpyHostToDevice));
    free(model_index);
    free(host);
}
static void moe_write_file_tail(const Model* model, FILE* f, const char* path) {
    const MoEModel* moe = moe_of(model);
    if (!moe->config.balance_bias) return;
    size_t n = (size_t)num_moe_layers(model) * moe->config.num_experts;
    if (model_pp_stages(model) > 1) {
        fwrite_check(moe->report.bias, sizeof(float), n, f, path);
        return;
    }
    float* host = (float*)malloc_check(n * sizeof(float));
    cudaCheck(cudaMemcpy(host, moe->balance_bias, n * sizeof(float), cudaMemcpyDeviceToHost));
    fwrite_check(host, sizeof(float), n, f, path);
    free(host);
}
