// test_moe.cu: the MoE trainer against the PyTorch reference (train_moe.py): for one model and batch written by
//   /usr/bin/python3 train_moe.py --write-reference PREFIX ...
// the logits, the cross-entropy, the aux and z losses, the routing (choices per expert, drops), every
// parameter gradient (router and experts included) and the losses of 10 AdamW steps on that batch; with -ep N under
// mpirun, also expert parallelism against degree 1; with -z 2 (and -oo), ZeRO-2 against ZeRO-1 bit for bit (one
// micro-batch only). A reference written with --micro-batches K (header[10]) runs each step as K micro-steps of B/K
// sequences, as train_moe's step does (test_gpt.cu's test_step): the losses are means over them, the routing counts
// and drops sums, the gradients the accumulated ones.
//   make test_moe_cpu; ./test_moe_cpu PREFIX [-r 0|1|2] [-w 0|1] [-ge 0|1|2] [-fa 0|1] [-ep N] [-z 0|1|2|3]
//   [-oo 0|1|2] [-tp N [-sp 0|1] [-etp 1|N]]
// with -tp N under mpirun, tensor parallelism against PyTorch and -tp 1 (test_gpt.cu's "tp1" check): folded (-etp 1)
// each member routes its own micro-batch of the reference's (written with --micro-batches a multiple of N), with
// -etp N every member routes each micro-batch whole.
// with -rg 1 on several processes, also the global-batch loss against a hand computation (check_global_aux).
// The MoE settings are the reference's: the debug state's words 20..32 (doc/formats.md) give the capacity factor, the
// loss coefficients, the jitter, the balancing bias's step, the global-batch loss and the device limit, as the
// optimizer's come from words 12..17 (test_gpt.cu). Their flags (-cf, -ra, -rz, -rj, -rni, -rnl, -rb, -rsl, -rg, -dl)
// are accepted when they agree and refused when they do not. A device limit's groups are the expert-parallel members,
// so a reference written with --device-limit M --ep-groups G runs at -ep G only. A BF16 (or FP16) test routes the
// reference batch by the bf16 reference's expert choices (teacher-forced routing, ForcedRouting below), FP32 by its
// own router, whose every choice must be the reference's. The model is train_moe.cu's and the test test_gpt.cu's
// (both included without their main), with the MoE checks below plugged in as its TestExtension; test_gpt.cu states
// the tolerances.
#define OMIT_TRAIN_MOE_MAIN
#include "train_moe.cu"
#define OMIT_TEST_GPT_MAIN
#include "test_gpt.cu"

// The debug state's MoE settings (doc/formats.md, "Debug state"): the capacity factor an fp64 in words 20 (low) and
// 21, the coefficients fp32 bits, the global-batch loss and the device limit M and its groups G integers
enum {
    STATE_CF_WORD = 20, STATE_AUX_WORD = 22, STATE_Z_WORD, STATE_JITTER_WORD, STATE_IMPORTANCE_WORD, STATE_LOAD_WORD,
    STATE_INIT_SCALE_WORD, STATE_GAMMA_WORD, STATE_SEQ_WORD, STATE_GLOBAL_WORD, STATE_LIMIT_WORD, STATE_GROUPS_WORD,
    STATE_CHOICE_PASSES_WORD
};

// Teacher-forced routing (doc/moe.md, "Teacher-forced routing"). The router of a BF16 (or FP16) test reads a rounded
// LayerNorm output, so a choice within rounding of a tie can go to another expert than the reference's, and that
// token's output, and every gradient it reaches, moves past any tolerance. A bf16 reference holds its expert choices
// of every pass (word 33), and while the test's models run the reference batch they route as those say: after each
// MoE layer's top-k the hook below writes the reference's choices and computes their gates from the C router's own
// scores at those experts (so the router's gradient is still the C side's); the slots and drops, the dispatch, the
// balance losses and loads, noisy gating's thresholds (the k-th is the last forced pick) and the expert-parallel
// exchange all read them after it. FP32 routes by itself, always: its routing must match exactly.
enum { FORCED_EVALUATION, FORCED_GRADIENT, FORCED_STEPS, FORCED_KINDS };
typedef struct {
    int passes;         // the file's passes of choices (word 33): K evaluation, K of the gradient, K of each step
    int on;             // the models route by them: a BF16 or FP16 test, while it runs the reference batch
    int K, Lm, N, k;    // N = (B/K)*T tokens of a micro-batch
    int* choices;       // device (passes, Lm, N, k)
    int steps_phase;    // 0: a training pass is the gradient check's; 1 (once it is checked): a step's
    int evaluations;    // evaluation passes so far: the logits' micro-batches, in order
    int block, kind;    // the current pass's, set at its first MoE layer
    int* differ;        // device (FORCED_KINDS): forced choices the C router had not picked
    long forced[FORCED_KINDS];
} ForcedRouting;
static ForcedRouting forcing;

// One thread per token: counts the forced experts the C router did not pick, then writes the forced choices and
// their gates as llmc/moe_router.cuh's router computes them from its scores (softmax's probs or the sigmoid affinities of
// the picks; k = 1 softmax the prob itself, else over their sum in pick order; times rsf).
__global__ void forced_routing_kernel(int* expert_index, float* gates, int* differ, const int* forced,
                                      const float* probs, const float* logits, int N, int E, int k, int score,
                                      float routed_scale) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= N) return;
    int* picks = expert_index + (size_t)t * k;
    const int* want = forced + (size_t)t * k;
    float picked[MOE_MAX_TOP_K];
    float sum = 0.0f;
    int elsewhere = 0;
    for (int j = 0; j < k; j++) {
        int own = 0;
        for (int i = 0; i < k; i++) own |= picks[i] == want[j];
        elsewhere += !own;
        const size_t at = (size_t)t * E + want[j];
        picked[j] = score == MOE_SCORE_SIGMOID ? moe_sigmoid(logits[at]) : probs[at];
        sum += picked[j];
    }
    for (int j = 0; j < k; j++) {
        picks[j] = want[j];
        const float gate = k == 1 && score == MOE_SCORE_SOFTMAX ? picked[j] : picked[j] / sum;
        gates[(size_t)t * k + j] = gate * routed_scale;
    }
    if (elsewhere > 0) atomicAdd(differ, elsewhere);
}

// MoEModel.route_hook of the test's models: MoE layer m's choices of the pass it runs, the reference's
static void forced_routing_hook(Model* model, int m, int* expert_index, float* gates, const float* probs,
                                const float* logits, int N, cudaStream_t stream) {
    ForcedRouting* f = &forcing;
    if (!f->on) return;
    const MoEModel* moe = moe_of(model);
    if (m == 0) {  // a pass begins: which of the reference's it is (folded, this member's micro-batch of it)
        int groups = moe_routing_groups(model), member = groups > 1 ? model_tp_member(model) : 0;
        int pass = (int)model->pass_number * groups + member;
        f->kind = !moe->training ? FORCED_EVALUATION : f->steps_phase ? FORCED_STEPS : FORCED_GRADIENT;
        f->block = f->kind == FORCED_EVALUATION ? f->evaluations++ * groups + member
                   : f->kind == FORCED_GRADIENT ? f->K + pass
                                                : 2 * f->K + pass;
        int end = f->kind == FORCED_STEPS ? f->passes : (f->kind + 1) * f->K;
        if (f->block >= end || N != f->N) {
            fprintf(stderr, "teacher-forced routing: the reference has no choices for this pass (kind %d, pass %u, %d "
                    "tokens)\n", f->kind, model->pass_number, N);
            exit(EXIT_FAILURE);
        }
    }
    f->forced[f->kind] += (long)N * f->k;
    const int* forced = f->choices + ((size_t)f->block * f->Lm + m) * N * f->k;
    const MoEConfig* c = &moe->config;
    forced_routing_kernel<<<CEIL_DIV(N, 256), 256, 0, stream>>>(expert_index, gates, f->differ + f->kind, forced,
                                                               probs, logits, N, c->num_experts, f->k, c->score,
                                                               c->routed_scale);
    cudaCheck(cudaGetLastError());
}

// what forcing made equal by construction is not a check: how many of kind's forced choices the C router would have
// routed elsewhere (this process's; every process runs the reference batch), as information
static void print_forced(int kind, const char* passes) {
    int differ;
    cudaCheck(cudaMemcpy(&differ, forcing.differ + kind, sizeof(int), cudaMemcpyDeviceToHost));
    if (printing)
        printf("     %-10s teacher-forced in %s: the C router would have routed %d of the %ld choices elsewhere "
               "(information, not a check)\n", "routing", passes, differ, forcing.forced[kind]);
}
static void reset_forced(int kind) {
    cudaCheck(cudaMemset(forcing.differ + kind, 0, sizeof(int)));
    forcing.forced[kind] = 0;
}
// the next evaluation pass, on the reference batch's first micro-batch, routes as the logits' first did
static void moe_repeat_first_evaluation(void) { forcing.evaluations = 0; }

// The debug state's MoE part (after the loss): header[7] MoE layers, header[8] noisy gating; the aux and z losses
// summed over the MoE layers, noisy gating's importance and load losses, then per layer the dropped choices and
// the choices routed to each expert before dropping. With header[9] = 1 the sequence-wise loss (summed over the MoE
// layers) follows the other losses. With header[11] = 1 the balancing biases after each step
// close the file (after the step losses that test_gpt.cu reads). With word 33 = P > 0 (a bf16 reference) P passes of
// expert choices, each (Lm, (B/K)*T, k), follow the counts (ForcedRouting).
typedef struct {
    float aux_loss, z_loss;
    int noisy;
    float importance_loss, load_loss;
    int seq;             // header[9]: the sequence-wise loss is there
    float seq_loss;
    int* dropped;        // (Lm)
    int* expert_counts;  // (Lm, E)
    float* biases;       // (nsteps, Lm, E) after each step's update, with header[11] = 1; else NULL
    size_t step_biases;  // Lm * E
} MoEReference;

// The reference's expert choices (word 33's passes of (Lm, N, k)) to the device: each an expert, a token's k distinct
static void moe_read_choices(FILE* f, const char* path, const int* header, const Model* model) {
    ForcedRouting* r = &forcing;
    r->K = header[10] > 1 ? header[10] : 1;
    r->Lm = num_moe_layers(model);
    r->N = header[2] / r->K * (header[3] + model_adapter_sequence_extra(model));  // a prompt's virtual tokens routed too
    r->k = moe_of(model)->config.top_k;
    int E = moe_of(model)->config.num_experts;
    if (r->passes != r->K * (header[4] + 2)) {
        fprintf(stderr, "%s: word %d = %d passes of expert choices, expected K * (steps + 2) = %d\n", path,
                STATE_CHOICE_PASSES_WORD, r->passes, r->K * (header[4] + 2));
        exit(EXIT_FAILURE);
    }
    size_t n = (size_t)r->passes * r->Lm * r->N * r->k;
    int* host = (int*)malloc_check(n * sizeof(int));
    fread_check(host, sizeof(int), n, f, path);
    for (size_t token = 0; token < n / r->k; token++) {
        const int* picks = host + token * r->k;
        for (int j = 0; j < r->k; j++) {
            int repeated = 0;
            for (int i = 0; i < j; i++) repeated |= picks[i] == picks[j];
            if (picks[j] < 0 || picks[j] >= E || repeated) {
                fprintf(stderr, "%s: expert choice %zu is %d: expected one of the %d experts, each once per token\n",
                        path, token * r->k + j, picks[j], E);
                exit(EXIT_FAILURE);
            }
        }
    }
    cudaCheck(cudaMalloc(&r->choices, n * sizeof(int)));
    cudaCheck(cudaMemcpy(r->choices, host, n * sizeof(int), cudaMemcpyHostToDevice));
    cudaCheck(cudaMalloc(&r->differ, FORCED_KINDS * sizeof(int)));
    cudaCheck(cudaMemset(r->differ, 0, FORCED_KINDS * sizeof(int)));
    free(host);
}

static void* moe_read_reference(FILE* f, const char* path, const int* header, const Model* model) {
    MoEReference* r = (MoEReference*)calloc(1, sizeof(MoEReference));
    int Lm = num_moe_layers(model), E = moe_of(model)->config.num_experts;
    r->dropped = (int*)malloc_check((size_t)(Lm + 1) * sizeof(int));
    r->expert_counts = (int*)malloc_check((size_t)(Lm * E + 1) * sizeof(int));
    if (header[7] != Lm) {
        fprintf(stderr, "%s: %d MoE layers, the model has %d\n", path, header[7], Lm);
        exit(EXIT_FAILURE);
    }
    fread_check(&r->aux_loss, sizeof(float), 1, f, path);
    fread_check(&r->z_loss, sizeof(float), 1, f, path);
    r->noisy = header[8];
    if (r->noisy != moe_of(model)->config.noisy_gating) {
        fprintf(stderr, "%s: noisy gating %d, the model file says %d\n", path, r->noisy,
                moe_of(model)->config.noisy_gating);
        exit(EXIT_FAILURE);
    }
    if (r->noisy) {
        fread_check(&r->importance_loss, sizeof(float), 1, f, path);
        fread_check(&r->load_loss, sizeof(float), 1, f, path);
    }
    r->seq = header[9];
    float seq_alpha = moe_of(model)->settings.seq_alpha;
    if (r->seq != (seq_alpha > 0.0f)) {
        fprintf(stderr, "%s: word 9 = %d (the sequence-wise loss) disagrees with its coefficient %g in word %d\n", path,
                header[9], seq_alpha, STATE_SEQ_WORD);
        exit(EXIT_FAILURE);
    }
    if (r->seq) fread_check(&r->seq_loss, sizeof(float), 1, f, path);
    for (int m = 0; m < Lm; m++) {
        fread_check(&r->dropped[m], sizeof(int), 1, f, path);
        fread_check(r->expert_counts + (size_t)m * E, sizeof(int), E, f, path);
    }
    if (forcing.passes > 0) moe_read_choices(f, path, header, model);
    float gamma = moe_of(model)->settings.bias_gamma;
    int moving = gamma > 0.0f;
    if (header[11] != moving) {
        fprintf(stderr, "%s: word 11 = %d (balancing biases after each step) disagrees with the bias step %g in word "
                "%d\n", path, header[11], gamma, STATE_GAMMA_WORD);
        exit(EXIT_FAILURE);
    }
    if (moving) {  // the file's last nsteps * Lm * E floats
        size_t n = (size_t)header[4] * Lm * E;
        r->step_biases = (size_t)Lm * E;
        long here = ftell(f);
        r->biases = (float*)malloc_check((n + 1) * sizeof(float));
        if (fseek(f, -(long)(n * sizeof(float)), SEEK_END) != 0) {
            fprintf(stderr, "%s: too short for its %zu balancing biases\n", path, n);
            exit(EXIT_FAILURE);
        }
        fread_check(r->biases, sizeof(float), n, f, path);
        if (fseek(f, here, SEEK_SET) != 0) {
            fprintf(stderr, "%s: cannot seek back to its gradients\n", path);
            exit(EXIT_FAILURE);
        }
    }
    return r;
}

// The gradient pass's MoE statistics over its micro-steps (test_gradient's micro_step_done): the losses summed (the
// reference's are means over the micro-batches), the choices per expert before and after dropping summed (the
// reference's counts and drops are sums). With one micro-step these are that pass's.
typedef struct {
    double aux_loss, z_loss, importance_loss, load_loss, seq_loss;
    long* expert_counts;  // (Lm, E)
    long* kept_counts;    // (Lm, E)
    size_t n;
    int micro_steps;
} MoEPassSums;
static MoEPassSums pass_sums = {0.0, 0.0, 0.0, 0.0, 0.0, NULL, NULL, 0, 0};

static void moe_micro_step_sums(const Model* model, int micro) {
    const MoEModel* moe = moe_of(model);
    moe_statistics(model);
    size_t n = (size_t)num_moe_layers(model) * moe->config.num_experts;
    if (n > pass_sums.n) {
        pass_sums.expert_counts = (long*)realloc(pass_sums.expert_counts, n * sizeof(long));
        pass_sums.kept_counts = (long*)realloc(pass_sums.kept_counts, n * sizeof(long));
        if (pass_sums.expert_counts == NULL || pass_sums.kept_counts == NULL) {
            fprintf(stderr, "out of host memory for the pass's counts\n");
            exit(EXIT_FAILURE);
        }
    }
    pass_sums.n = n;
    if (micro == 0) {
        pass_sums.aux_loss = pass_sums.z_loss = pass_sums.importance_loss = pass_sums.load_loss = 0.0;
        pass_sums.seq_loss = 0.0;
        memset(pass_sums.expert_counts, 0, n * sizeof(long));
        memset(pass_sums.kept_counts, 0, n * sizeof(long));
        pass_sums.micro_steps = 0;
    }
    pass_sums.aux_loss += moe->aux_loss;
    pass_sums.z_loss += moe->z_loss;
    pass_sums.importance_loss += moe->importance_loss;
    pass_sums.load_loss += moe->load_loss;
    pass_sums.seq_loss += moe->seq_loss;
    for (size_t i = 0; i < n; i++) {
        pass_sums.expert_counts[i] += moe->slot->expert_counts_cpu[i];
        pass_sums.kept_counts[i] += moe->slot->kept_counts_cpu[i];
    }
    pass_sums.micro_steps++;
}

// Folded under tensor parallelism, each member routed its own micro-batches: the pass sums over the members (ints in
// floats below 2^24: exact), and K the micro-batches they are of
static void sum_over_members(const Model* model, double* K) {
    size_t n = 5 + 2 * pass_sums.n;
    float* host = (float*)malloc_check(n * sizeof(float));
    double* losses[5] = {&pass_sums.aux_loss, &pass_sums.z_loss, &pass_sums.importance_loss, &pass_sums.load_loss,
                         &pass_sums.seq_loss};
    for (int i = 0; i < 5; i++) host[i] = (float)*losses[i];
    for (size_t i = 0; i < pass_sums.n; i++) {
        host[5 + i] = (float)pass_sums.expert_counts[i];
        host[5 + pass_sums.n + i] = (float)pass_sums.kept_counts[i];
    }
    float* device;
    cudaCheck(cudaMalloc((void**)&device, n * sizeof(float)));
    cudaCheck(cudaMemcpy(device, host, n * sizeof(float), cudaMemcpyHostToDevice));
    tensor_parallel_all_reduce_float(model->tp, device, n, ncclSum, 0);
    cudaCheck(cudaMemcpy(host, device, n * sizeof(float), cudaMemcpyDeviceToHost));
    cudaCheck(cudaFree(device));
    for (int i = 0; i < 5; i++) *losses[i] = host[i];
    for (size_t i = 0; i < pass_sums.n; i++) {
        pass_sums.expert_counts[i] = (long)host[5 + i];
        pass_sums.kept_counts[i] = (long)host[5 + pass_sums.n + i];
    }
    free(host);
    *K *= moe_routing_groups(model);
}

// The losses and the routing of the gradient pass on the reference batch (over its micro-batches: mean losses,
// summed counts). Routing is discrete: in FP32 every count and drop must match. A BF16 or FP16 test routes by the
// reference's choices (ForcedRouting), which makes its counts and drops equal by construction: it says instead how
// many choices its own router would have put elsewhere, and from here on its training passes are the steps'.
static void moe_check_forward(const Model* model, const ReferenceState* reference) {
    const MoEModel* moe = moe_of(model);
    const MoEReference* ref = (const MoEReference*)reference->extension;
    double K = pass_sums.micro_steps;
    if (moe_routing_groups(model) > 1) sum_over_members(model, &K);
    float tol = PRECISION_MODE == PRECISION_FP32 ? 1e-5f : 2e-2f;
    compare_value("aux loss", (float)(pass_sums.aux_loss / K), ref->aux_loss, tol);
    compare_value("z loss", (float)(pass_sums.z_loss / K), ref->z_loss, tol);
    if (ref->noisy) {
        compare_value("imp loss", (float)(pass_sums.importance_loss / K), ref->importance_loss, tol);
        compare_value("load loss", (float)(pass_sums.load_loss / K), ref->load_loss, tol);
    }
    if (ref->seq) compare_value("seq loss", (float)(pass_sums.seq_loss / K), ref->seq_loss, tol);
    if (forcing.on) {
        print_forced(FORCED_EVALUATION, "the logits' passes");
        print_forced(FORCED_GRADIENT, "the gradient's passes");
        forcing.steps_phase = 1;
        return;
    }
    int Lm = num_moe_layers(model), E = moe->config.num_experts;
    long positions = (long)reference->T + model_adapter_sequence_extra(model);  // a prompt's virtual ones routed too
    long moved = 0, dropped_diff = 0, choices = (long)Lm * reference->B * positions * moe->config.top_k;
    for (int m = 0; m < Lm; m++) {
        long dropped = 0;
        for (int e = 0; e < E; e++) {
            moved += labs(pass_sums.expert_counts[m * E + e] - ref->expert_counts[m * E + e]);
            dropped += pass_sums.expert_counts[m * E + e] - pass_sums.kept_counts[m * E + e];
        }
        dropped_diff += labs(dropped - ref->dropped[m]);
    }
    int routing_ok = moved == 0 && dropped_diff == 0;
    count_check(routing_ok);
    if (printing)
        printf("%s %-10s %ld of %ld choices routed elsewhere, drops differ by %ld (allowed 0)\n",
               routing_ok ? "OK  " : "FAIL", "routing", moved, choices, dropped_diff);
}

// the experts' stored gradients times their set's multiplier are the step's (moe_allocate_parameters)
static float moe_gradient_multiplier(const Model* model, int i) {
    int slot = i - PARAM_EXTENSION;
    return moe_is_expert_slot(slot) ? moe_of(model)->expert_store.grad_multiplier : 1.0f;
}

// the MoE settings of every model the test builds: the reference's (moe_take_settings)
static MoESettings test_moe_settings;

// The flags of those settings: train_moe's names, each with its word. A flag may repeat the reference's value (the
// command lines that name them still run) but never change it: a test of other settings than the reference's would
// compare two different models.
typedef enum { SETTING_FP64, SETTING_FP32, SETTING_INT } SettingKind;
typedef struct {
    const char* flag;
    int word;
    SettingKind kind;
    const char* given;  // the flag's value on the command line, or NULL
} MoESettingFlag;
static MoESettingFlag moe_setting_flags[] = {
    {"-cf", STATE_CF_WORD, SETTING_FP64, NULL},          {"-ra", STATE_AUX_WORD, SETTING_FP32, NULL},
    {"-rz", STATE_Z_WORD, SETTING_FP32, NULL},           {"-rj", STATE_JITTER_WORD, SETTING_FP32, NULL},
    {"-rni", STATE_IMPORTANCE_WORD, SETTING_FP32, NULL}, {"-rnl", STATE_LOAD_WORD, SETTING_FP32, NULL},
    {"-rb", STATE_GAMMA_WORD, SETTING_FP32, NULL},       {"-rsl", STATE_SEQ_WORD, SETTING_FP32, NULL},
    {"-rg", STATE_GLOBAL_WORD, SETTING_INT, NULL},       {"-dl", STATE_LIMIT_WORD, SETTING_INT, NULL},
};
#define NUM_MOE_SETTING_FLAGS ((int)(sizeof(moe_setting_flags) / sizeof(moe_setting_flags[0])))

static double setting_in_file(const MoESettingFlag* f, const int* header) {
    if (f->kind == SETTING_FP32) return header_float(header, f->word);
    if (f->kind == SETTING_INT) return header[f->word];
    double value;
    memcpy(&value, header + f->word, sizeof(value));
    return value;
}

// the flag's value as the setting holds it (an fp32 setting rounded as the file's was); a value that is not a number
// of the setting's kind is refused
static double setting_given(const MoESettingFlag* f) {
    char* end;
    double value = f->kind == SETTING_INT ? (double)strtol(f->given, &end, 10) : strtod(f->given, &end);
    if (end == f->given || *end != '\0') {
        fprintf(stderr, "%s %s: expected %s\n", f->flag, f->given, f->kind == SETTING_INT ? "an integer" : "a number");
        exit(EXIT_FAILURE);
    }
    return f->kind == SETTING_FP32 ? (double)(float)value : value;
}

// a setting's value in text: %g when that reads back as the same value, else every digit
static void setting_text(char* text, size_t size, const MoESettingFlag* f, double value) {
    snprintf(text, size, "%g", value);
    double back = strtod(text, NULL);
    if ((f->kind == SETTING_FP32 ? (double)(float)back : back) != value)
        snprintf(text, size, f->kind == SETTING_FP32 ? "%.9g" : "%.17g", value);
}

// -etp: the MoE layers under -tp N, folded (1) or with each expert's hidden units split over the members (N)
static int test_expert_tp = 1;

static int moe_parse_test_flag(ModelTest* t, const char* flag, const char* value) {
    if (!strcmp(flag, "-ep")) {
        t->ep_degree = atoi(value);
        return 1;
    }
    if (!strcmp(flag, "-etp")) {
        test_expert_tp = atoi(value);
        return 1;
    }
    for (int i = 0; i < NUM_MOE_SETTING_FLAGS; i++) {
        if (strcmp(flag, moe_setting_flags[i].flag) != 0) continue;
        moe_setting_flags[i].given = value;
        return 1;
    }
    return 0;
}

// The reference's MoE settings from its debug state's header (words 20..32), each flag given checked against its
// word, and a device limit's groups against -ep. Every process checks; process 0 says why it stops.
static void moe_take_settings(ModelTest* t, const int* header, const char* path) {
    MoESettings* s = &test_moe_settings;
    memset(s, 0, sizeof(*s));
    memcpy(&s->capacity_factor, header + STATE_CF_WORD, sizeof(double));
    s->capacity_factor_eval = s->capacity_factor;  // the reference's one factor in every pass
    s->aux_alpha = header_float(header, STATE_AUX_WORD);
    s->z_coef = header_float(header, STATE_Z_WORD);
    s->jitter = header_float(header, STATE_JITTER_WORD);
    s->importance_coef = header_float(header, STATE_IMPORTANCE_WORD);
    s->load_coef = header_float(header, STATE_LOAD_WORD);
    s->init_scale = header_float(header, STATE_INIT_SCALE_WORD);
    s->bias_gamma = header_float(header, STATE_GAMMA_WORD);
    s->seq_alpha = header_float(header, STATE_SEQ_WORD);
    s->global_aux = header[STATE_GLOBAL_WORD];
    s->device_limit = header[STATE_LIMIT_WORD];
    int groups = header[STATE_GROUPS_WORD];
    forcing.passes = header[STATE_CHOICE_PASSES_WORD];
    forcing.on = PRECISION_MODE != PRECISION_FP32;
    if (forcing.on && forcing.passes <= 0) {
        if (printing)
            fprintf(stderr, "%s: word %d = %d: a %s test routes by the reference's expert choices, which a bf16 "
                    "reference holds (--dtype bfloat16)\n", path, STATE_CHOICE_PASSES_WORD, forcing.passes,
                    PRECISION_NAME);
        exit(EXIT_FAILURE);
    }
    if (s->global_aux != 0 && s->global_aux != 1) {
        if (printing) fprintf(stderr, "%s: word %d = %d: expected 0 or 1\n", path, STATE_GLOBAL_WORD, s->global_aux);
        exit(EXIT_FAILURE);
    }
    if (s->device_limit < 0 || groups < 0 || (s->device_limit > 0) != (groups > 0)) {
        if (printing)
            fprintf(stderr, "%s: words %d and %d (device limit %d, groups %d): expected both positive or both 0\n",
                    path, STATE_LIMIT_WORD, STATE_GROUPS_WORD, s->device_limit, groups);
        exit(EXIT_FAILURE);
    }
    for (int i = 0; i < NUM_MOE_SETTING_FLAGS; i++) {
        const MoESettingFlag* f = &moe_setting_flags[i];
        if (f->given == NULL) continue;
        double want = setting_in_file(f, header);
        if (setting_given(f) == want) continue;
        char text[64];
        setting_text(text, sizeof(text), f, want);
        if (printing)
            fprintf(stderr, "%s %s: %s was written with %s %s (word %d): leave %s out, or give the reference's value\n",
                    f->flag, f->given, path, f->flag, text, f->word, f->flag);
        exit(EXIT_FAILURE);
    }
    if (s->device_limit > 0 && t->ep_degree != groups) {
        if (printing)
            fprintf(stderr, "-ep %d: %s routes within %d of %d expert groups (words %d, %d), the expert-parallel "
                    "members: run it at -ep %d\n", t->ep_degree, path, s->device_limit, groups, STATE_LIMIT_WORD,
                    STATE_GROUPS_WORD, groups);
        exit(EXIT_FAILURE);
    }
    if (printing) {
        printf("MoE settings: the reference's: cf %g, aux %g, z %g, jitter %g, importance %g, load %g, bias step %g, "
               "seq %g, global %d", s->capacity_factor, s->aux_alpha, s->z_coef, s->jitter, s->importance_coef,
               s->load_coef, s->bias_gamma, s->seq_alpha, s->global_aux);
        if (s->device_limit > 0) printf(", device limit %d of %d groups", s->device_limit, groups);
        printf("\n");
    }
}

// the model file brings the shape; the settings are the test's; the experts shared out over `degree` processes
static void moe_attach(Model* model, const ModelTest* t, const MultiGpuConfig* mg, int degree) {
    MoEModel* moe = (MoEModel*)malloc_check(sizeof(MoEModel));
    MoEConfig none = {};  // the model file's header fills it in
    none.score = MOE_SCORE_SOFTMAX;
    none.routed_scale = 1.0f;
    moe_model_init(moe, &none, &test_moe_settings);
    moe->route_hook = forcing.on ? forced_routing_hook : NULL;
    // folded under tensor parallelism the -ep groups span the members: formed over every process; at -etp N over the
    // data-parallel group, mg (a model without tensor parallelism: -etp 1)
    int tp = t->tp != NULL ? t->tp->degree : 1;
    moe->expert_tp = tp > 1 ? test_expert_tp : 1;
    if (moe->expert_tp != 1 && moe->expert_tp != tp) {
        fprintf(stderr, "-etp %d: expected 1 or -tp's %d\n", moe->expert_tp, tp);
        exit(EXIT_FAILURE);
    }
    expert_parallel_init(&moe->ep, tp > 1 && moe->expert_tp == 1 ? t->world : mg, degree);
    model->extension = model_extension(&moe_extension);
    model->extension_state = moe;
}

// The reference's steps on (x, y) for a fresh model with t's settings, expert-parallel degree `degree`: their losses,
// and (when `params` is not NULL) the parameters after them in model-file order as the trainer writes its model file,
// in a new buffer of *count values; with `biases` (not NULL) the balancing biases after each step (nsteps, Lm, E)
static void moe_run_steps(const ModelTest* t, int degree, const int* x, const int* y, const ReferenceState* ref,
                          const MultiGpuConfig* mg, float* losses, floatX** params, size_t* count, float* biases,
                          cudaStream_t stream) {
    Model model;
    build_test_model(&model, t, mg, degree);
    int passes = test_passes(&model, ref, t->extension);
    if (passes == 0) exit(EXIT_FAILURE);
    model_allocate_activations(&model, ref->B / passes, ref->T + model_adapter_sequence_extra(&model));
    attach_test_adapter(&model, t);
    model_allocate_optimizer(&model, t->zero_stage);
    size_t n_bias = (size_t)num_moe_layers(&model) * moe_of(&model)->config.num_experts;
    for (int step = 0; step < ref->nsteps; step++) {
        losses[step] = test_step(&model, x, y, ref->B, ref->T, passes, step, mg, t->zero_stage,
                                 &t->opt, stream);
        if (biases)
            cudaCheck(cudaMemcpy(biases + step * n_bias, moe_of(&model)->balance_bias, n_bias * sizeof(float),
                                 cudaMemcpyDeviceToHost));
    }
    if (params) {  // the model's, or under fine-tuning the adapter's
        *count = test_trained_parameters(&model);
        *params = (floatX*)malloc_check(*count * sizeof(floatX));
        test_trained_values(&model, *params, stream);
    }
    free_test_model(&model);
}

// The balancing biases after each step against another run's. Each moves by +-gamma per step on integer loads, one
// fp32 addition as the reference makes it, so where the routing is the same they are bit-identical: FP32 must match
// exactly, and so does BF16 against the reference, whose choices it routes by (ForcedRouting; measured: 0 of 160 and
// of 320 values differ, Makefile MOE_REF_*_bias_* and MOE_REF_ds). A BF16 run against -ep 1 on other batches routes by
// itself: its parameters drift by rounding over the steps, a load near its layer's mean can land on the other side of
// it, and that bias then moves the other way (2 gamma apart from there on): measured 20 of 160 values, by 2 gamma;
// without forcing, against the reference, 25 of 160 by 2 gamma and, with 16 experts and 3 micro-batches of 23 tokens
// (loads near the mean are common), 36 of 320 by 4 gamma. Allowed: a quarter of the values, by at most 4 gamma (two
// such steps); a reversed sign, a missing update or a wrong gamma are off by up to 20 gamma in most values.
static void compare_biases(const char* label, const char* whose, const float* got, const float* want, size_t n,
                           float gamma) {
    size_t differ = 0;
    double worst = 0.0;
    for (size_t i = 0; i < n; i++) {
        differ += got[i] != want[i];
        worst = fmax(worst, fabs((double)got[i] - want[i]));
    }
    int fp32 = PRECISION_MODE == PRECISION_FP32;
    size_t allowed = fp32 ? 0 : n / 4;
    double allowed_diff = fp32 ? 0.0 : 4.0 * gamma * (1.0 + 1e-3);  // 1e-3: the fp32 roundings of the sums
    int ok = n > 0 && differ <= allowed && worst <= allowed_diff;
    count_check(ok);
    if (printing)
        printf("%s %-10s %zu balancing biases after the steps, %zu differ from %s (allowed %zu), max abs diff %.2e "
               "(allowed %.2e)\n", ok ? "OK  " : "FAIL", label, n, differ, whose, allowed, worst, allowed_diff);
}

// The global-batch loss (-rg 1) on P > 1 processes, each on its own batch: the Switch loss of a training pass
// against a double-precision loop over its inputs, sum_m alpha * E * sum_e f_e * P_e with f_e = (the choices
// routed to e on every process, the host's sum of each process's counts) / (P * N * k) and P_e the mean of this
// process's probs. With K micro-batches of N tokens the pass is the step's last, and f_e counts the choices of all
// K micro-batches on every process / (K * P * N * k) (doc/moe.md, "Routing options" 8). A loss that
// read this process's counts alone is off by the processes' difference in routing: measured 3.8e-4 relative at the
// start (moe_k2_global_cf0.5, rank 0; moe_k2_global_mb2: 2.2e-3), above FP32's tolerance (the reference comparison's,
// 1e-5) but within BF16's (2e-2), so this check tells the two apart in FP32 only.
static void check_global_aux(const ModelTest* t, const int* x, const int* y, int B, int T, int K,
                             const MultiGpuConfig* mg, cudaStream_t stream) {
    ModelTest unsharded = *t;
    unsharded.zero_stage = 0;
    unsharded.offload = 0;
    Model model;
    build_test_model(&model, &unsharded, mg, t->ep_degree);
    model_allocate_activations(&model, B / K, T + model_adapter_sequence_extra(&model));
    attach_test_adapter(&model, &unsharded);
    model_allocate_optimizer(&model, 0);
    test_gradient(&model, x, y, B, T, K, mg, t->extension, stream);
    MoEModel* moe = moe_of(&model);
    int Lm = num_moe_layers(&model), E = moe->config.num_experts, k = moe->config.top_k, N = B / K * T;
    float* probs = (float*)malloc_check((size_t)N * E * sizeof(float));
    double want = 0.0, local = 0.0;  // local: the same with this process's counts alone
    for (int m = 0; m < Lm; m++) {
        cudaCheck(cudaMemcpy(probs, moe_layer_activations(&model, m, m, N).probs, (size_t)N * E * sizeof(float),
                             cudaMemcpyDeviceToHost));
        for (int e = 0; e < E; e++) {
            // the step's choices so far on every process (exact: < 2^24)
            double count = multi_gpu_cpu_float_sum((float)pass_sums.expert_counts[m * E + e], mg);
            double mean_prob = 0.0;
            for (int i = 0; i < N; i++) mean_prob += probs[(size_t)i * E + e];
            mean_prob /= N;
            want += (double)moe->settings.aux_alpha * E * count / ((double)K * mg->num_processes * N * k) * mean_prob;
            local += (double)moe->settings.aux_alpha * E * moe->slot->expert_counts_cpu[m * E + e] / ((double)N * k) *
                     mean_prob;
        }
    }
    free(probs);
    float tol = PRECISION_MODE == PRECISION_FP32 ? 1e-5f : 2e-2f;
    compare_value("global aux", moe->aux_loss, (float)want, tol);
    if (printing)
        printf("     global aux %.7f from the counts of all %d processes, %.7f from this process's alone\n", want,
               mg->num_processes, local);
    free_test_model(&model);
}

// The checks of -ep and -z, each process with its own batch (the reference batch with its tokens shifted by
// 37 * rank, so that the processes route differently, a row that travels to the wrong process or comes back to the
// wrong token changes the results, and a gradient slice never reduced over the processes differs from one that is).
// Expert parallelism of degree N against degree 1 on the same processes: every tensor of the step's gradient
// (ZeRO-0) and 10 steps' losses (with ZeRO-`zero_stage`). Both runs sum the same fp32 terms in other orders (an
// owner's expert GEMM adds N processes' rows at once where degree 1 adds each process's rows, then averages over
// processes), so the tolerances are the PyTorch comparison's (FP32: 1e-5 of each tensor's scale, measured ~3e-7;
// BF16: an owner rounds the sum of N processes' expert gradients once where degree 1 rounds each, measured 6e-3
// against 3e-2); a gradient N times too large, or one never averaged over the replicas, is off by O(1). The parameters after the steps are not compared:
// AdamW turns the rounding noise of gradients that are zero in exact arithmetic (the attention's key bias) into
// updates of +-lr, which differ between any two summation orders.
// ZeRO-2/3 (with -oo as given) against ZeRO-1 at degree N: with one micro-step every piece of the routers' and
// experts' gradients is averaged as ZeRO-1 averages it and the fp32 shard holds that value exactly, and ZeRO-3's
// gathered parameters are copies (doc/zero.md), so the 10 steps' losses and the parameters after them (ZeRO-3's
// gathered for the model file) are bit-identical.
static void moe_extra_checks(const ModelTest* t, const ReferenceState* ref, const MultiGpuConfig* mg,
                             float tol_tensor, float tol_steps, cudaStream_t stream) {
    int ep_degree = t->ep_degree;
    int B = ref->B, T = ref->T, V = ref->V, tp = t->tp != NULL ? t->tp->degree : 1;
    int K = ref->micro_batches / (test_expert_tp == 1 ? tp : 1);  // the passes per step (folded, each member routes
                                                                   // its micro-batch of a pass)
    size_t BT = (size_t)B * T;
    const MoEReference* moe_ref = (const MoEReference*)ref->extension;
    float *biases_a = NULL, *biases_b = NULL;
    size_t n_biases = 0;
    // a device limit's groups are the -ep members: its reference is matched at -ep G, and -ep 1 has no groups
    int limited = test_moe_settings.device_limit > 0;
    if (forcing.on) {
        print_forced(FORCED_STEPS, "the steps");
        reset_forced(FORCED_STEPS);
    }
    if (moe_ref->biases != NULL) {
        n_biases = (size_t)ref->nsteps * moe_ref->step_biases;  // the steps run (-st): a prefix of the file's
        biases_a = (float*)malloc_check((n_biases + 1) * sizeof(float));
        biases_b = (float*)malloc_check((n_biases + 1) * sizeof(float));
        float* losses = (float*)malloc_check(((size_t)ref->nsteps + 1) * sizeof(float));
        moe_run_steps(t, limited ? ep_degree : 1, ref->x, ref->y, ref, mg, losses, NULL, NULL, biases_a, stream);
        compare_biases("bias steps", "the reference's", biases_a, moe_ref->biases, n_biases,
                       test_moe_settings.bias_gamma);
        if (forcing.on) print_forced(FORCED_STEPS, "these steps");
        free(losses);
    }
    forcing.on = 0;  // the checks below run other batches than the reference's: the C router routes them
    int* x = (int*)malloc_check(BT * sizeof(int));
    int* y = (int*)malloc_check(BT * sizeof(int));
    for (size_t i = 0; i < BT; i++) {
        x[i] = (ref->x[i] + 37 * mg->process_rank) % V;
        y[i] = (ref->y[i] + 37 * mg->process_rank) % V;
    }
    float* losses_a = (float*)malloc_check(((size_t)ref->nsteps + 1) * sizeof(float));
    float* losses_b = (float*)malloc_check(((size_t)ref->nsteps + 1) * sizeof(float));
    if (limited && printing)
        printf("device limit: -dl %d over the -ep %d groups, compared with the reference only (-ep 1 has no groups)\n",
               test_moe_settings.device_limit, ep_degree);
    if (test_moe_settings.global_aux && mg->num_processes > 1 && tp == 1)
        check_global_aux(t, x, y, B, T, K, mg, stream);
    if (ep_degree > 1 && !limited) {
        // the gradients read whole: ZeRO-0, no offload
        ModelTest unsharded = *t;
        unsharded.zero_stage = 0;
        unsharded.offload = 0;
        Model one, spread;
        build_test_model(&one, &unsharded, mg, 1);
        build_test_model(&spread, &unsharded, mg, ep_degree);
        Model* both[2] = {&one, &spread};
        for (int i = 0; i < 2; i++) {
            model_allocate_activations(both[i], B / K, T + model_adapter_sequence_extra(both[i]));
            attach_test_adapter(both[i], &unsharded);
            model_allocate_optimizer(both[i], 0);
        }
        if (printing)
            printf("expert parallelism: -ep %d against -ep 1 on %d processes, distinct batches, ZeRO-%d steps\n",
                   ep_degree, mg->num_processes, t->zero_stage);
        float loss_one = test_gradient(&one, x, y, B, T, K, mg, t->extension, stream);
        float loss_spread = test_gradient(&spread, x, y, B, T, K, mg, t->extension, stream);
        compare_value("ep loss", multi_gpu_cpu_float_sum(loss_spread, mg), multi_gpu_cpu_float_sum(loss_one, mg),
                      tol_steps);
        float* g_one = trained_gradients(&one, t->extension, stream);
        float* g_spread = trained_gradients(&spread, t->extension, stream);
        compare_trained_gradients("ep d", &one, g_spread, g_one, tol_tensor);
        free(g_one);
        free(g_spread);
        free_test_model(&spread);
        free_test_model(&one);
        moe_run_steps(t, 1, x, y, ref, mg, losses_a, NULL, NULL, biases_a, stream);
        moe_run_steps(t, ep_degree, x, y, ref, mg, losses_b, NULL, NULL, biases_b, stream);
        double worst = 0.0;
        for (int step = 0; step < ref->nsteps; step++) {
            worst = fmax(worst, fabs(losses_b[step] - losses_a[step]) / fabs(losses_a[step]));
            if (printing)
                printf("     step %2d: loss %.6f with -ep %d, %.6f with -ep 1\n", step, losses_b[step], ep_degree,
                       losses_a[step]);
        }
        int steps_ok = worst <= tol_steps && ref->nsteps > 0;
        count_check(steps_ok);
        if (printing)
            printf("%s %-10s %d step losses, max rel err %.2e (tol %.0e)\n", steps_ok ? "OK  " : "FAIL", "ep steps",
                   ref->nsteps, worst, tol_steps);
        if (biases_a != NULL) {
            compare_biases("ep bias", "-ep 1's", biases_b, biases_a, n_biases, test_moe_settings.bias_gamma);
            // the loads are summed over every process before the update, so every process (each on its own batch)
            // holds the same biases: a 16-bit hash of their bits, summed over the processes, is P times this one's
            unsigned int hash = 2166136261u;
            const unsigned char* bytes = (const unsigned char*)biases_b;
            for (size_t i = 0; i < n_biases * sizeof(float); i++) hash = (hash ^ bytes[i]) * 16777619u;
            float mine = (float)(hash & 0xffffu), sum = multi_gpu_cpu_float_sum(mine, mg);
            int same = sum == mine * (float)mg->num_processes;
            count_check(same);
            if (printing)
                printf("%s %-10s the balancing biases are the same on all %d processes\n", same ? "OK  " : "FAIL",
                       "ep bias", mg->num_processes);
        }
    }
    if (t->zero_stage >= 2 && K > 1 && printing)
        printf("zero: skipped with %d micro-batches (ZeRO-2 reduces each micro-step's gradient into its fp32 shard, "
               "ZeRO-1 the accumulated one: other roundings, not bit-identical)\n", K);
    if (t->zero_stage >= 2 && K == 1) {
        ModelTest zero1 = *t;
        zero1.zero_stage = 1;
        zero1.offload = 0;
        floatX *params_a, *params_b;
        size_t n, n_b;
        moe_run_steps(&zero1, ep_degree, x, y, ref, mg, losses_a, &params_a, &n, NULL, stream);
        moe_run_steps(t, ep_degree, x, y, ref, mg, losses_b, &params_b, &n_b, NULL, stream);
        int same = ref->nsteps > 0 && memcmp(losses_a, losses_b, (size_t)ref->nsteps * sizeof(float)) == 0;
        count_check(same);
        if (printing)
            printf("%s %-10s %d step losses with -ep %d -z %d -oo %d, distinct batches, bit-identical to -z 1 -oo 0's "
                   "(last %.7f, %.7f)\n", same ? "OK  " : "FAIL", "zero", ref->nsteps, ep_degree, t->zero_stage,
                   t->offload, losses_b[ref->nsteps - 1], losses_a[ref->nsteps - 1]);
        int same_params = n == n_b && memcmp(params_a, params_b, n * sizeof(floatX)) == 0;
        count_check(same_params);
        if (printing)
            printf("%s %-10s %zu parameters after them, bit-identical to -z 1's\n", same_params ? "OK  " : "FAIL",
                   "zero", n);
        free(params_a);
        free(params_b);
    }
    free(losses_a);
    free(losses_b);
    free(biases_a);
    free(biases_b);
    free(x);
    free(y);
}

static const TestExtension moe_test_extension = {
    "test_moe",
    " [-ep N] [-etp 1|N] [-cf CF] [-ra A] [-rz Z] [-rj EPS] [-rni W] [-rnl W] [-rb GAMMA] [-rsl A] [-rg 0|1] [-dl M] "
    "(the settings' flags must agree with the debug state)",
    moe_parse_test_flag, moe_take_settings, moe_attach, moe_read_reference, moe_micro_step_sums, moe_check_forward,
    moe_gradient_multiplier, moe_extra_checks, moe_routing_groups, moe_repeat_first_evaluation,
};

int main(int argc, char** argv) { return test_main(argc, argv, &moe_test_extension); }
