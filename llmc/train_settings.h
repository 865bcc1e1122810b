// llmc/train_settings.h: the trainer's settings: the flag table (TRAINER_FLAGS: name, type, member, default, help),
// the TrainerSettings it generates, their checks (one line naming the flag and what it expected), the descriptor's
// architecture from the flags, the agreement of the flags with a model file's header, and which checkpoint -y 1
// resumes. train_gpt.cu includes it before its loop; it needs the model's config (ModelConfig, config_set_family) and
// llmc/cli.h. doc/flags.md is generated from the table (--help-markdown). Tests: train-gpt-cli, train-moe-cli and
// flags-doc.
#pragma once

// The trainer's flags, each once (llmc/cli.h): X(name, type, TrainerSettings member, default, help line(s) ending
// with the default in words). TrainerSettings, its defaults, the parsed table, the usage text (-h) and doc/flags.md
// all come from it.
// -arch and the llama flags describe a descriptor; given with a model file, they must agree with its header.
#define TRAINER_FLAGS(X)                                                                                               \
    X("-i", STRING, train_pattern, "data/tinyshakespeare/tinyshakespeare_gpt2_train.bin",                              \
      "train data filename pattern (default = data/tinyshakespeare/tinyshakespeare_gpt2_train.bin)")                   \
    X("-j", STRING, val_pattern, "data/tinyshakespeare/tinyshakespeare_gpt2_val.bin",                                  \
      "val data filename pattern (default = data/tinyshakespeare/tinyshakespeare_gpt2_val.bin)")                       \
    X("-e", STRING, model_source, "gpt2_124M_bf16.bin",                                                                \
      "input model file or descriptor dN (default = gpt2_124M_bf16.bin)")                                              \
    X("-ev", INT, descriptor_vocab, 50257, "vocabulary size for a descriptor (default = 50257)")                       \
    X("-et", INT, descriptor_maxT, 1024, "max sequence length for a descriptor (default = 1024)")                      \
    X("-sd", INT, descriptor_seed, 42, "seed of a descriptor's initialisation (default = 42)")                         \
    X("-arch", STRING, arch, "gpt2",                                                                                   \
      "architecture of a descriptor: gpt2, or llama (RMSNorm, RoPE, grouped-query attention,\n"                        \
      "SwiGLU, no biases: doc/kernels.md) (default = gpt2)")                                                           \
    X("-kv", INT, kv_heads, 0, "llama: key/value heads, dividing NH (default = NH)")                                   \
    X("-rt", FLOAT, rope_theta, 10000.0f, "llama: RoPE theta (default = 10000)")                                       \
    X("-fh", INT, ffn_hidden, 0, "llama: SwiGLU hidden size H (default = 8C/3 rounded up to a multiple of 64)")        \
    X("-eps", FLOAT, norm_eps, 1e-5f, "llama: RMSNorm eps (default = 1e-5)")                                           \
    X("-tie", INT, tie_embeddings, 0, "llama: 1 = the output embedding is wte, 0 = its own lm_head (default = 0)")     \
    X("-ft", STRING, fine_tune, "",                                                                                    \
      "fine-tune the model file with a method that trains new parameters only, the model's own\n"                    \
      "frozen (doc/training.md, \"Fine-tuning\"): lora, adapter (bottleneck MLPs after the attention and\n"           \
      "the FFN), prompt (virtual tokens before every sequence), prefix (learned keys and values in every\n"           \
      "attention) or llama_adapter (a gated prompt in the top -fl layers' attention) (default = none: train\n"       \
      "every parameter)")                                                                                              \
    X("-fr", INT, ft_rank, 8,                                                                                          \
      "-ft: lora's rank r or the adapter's bottleneck width (a multiple of 8), or the rows P of prompt,\n"            \
      "prefix or llama_adapter (default = 8)")                                                                         \
    X("-fl", INT, ft_layers, 0, "-ft llama_adapter: the top K layers adapted (default = 0: every layer)")              \
    X("-fs", FLOAT, ft_alpha, 16.0f, "-ft lora: alpha: the layer is W x + (alpha/r) B A x (default = 16)")             \
    X("-fw", STRING, ft_targets, "qkv,proj",                                                                           \
      "-ft lora: the Linear layers adapted, any of qkv, proj (every layer's), fc, fc_proj (every dense MLP's),\n"     \
      "lm_head, experts (fc and fc_proj of every expert of an MoE model; experts.fc or experts.fc_proj: one)\n"       \
      "(default = qkv,proj)")                                                                                          \
    X("-fi", STRING, ft_adapter, NULL, "-ft: start from this adapter file (default = none: a fresh adapter)")          \
    X("-fm", STRING, ft_merged, NULL,                                                                                  \
      "-ft lora: after the last step, write the model with the adapter merged into it to this model\n"                \
      "file (default = none)")                                                                                         \
    X("-o", STRING, output_dir, NULL, "output log dir and checkpoints (default = none)")                               \
    X("-tf", STRING, tokenizer_path, "data/tinyshakespeare/gpt2_tokenizer.bin",                                        \
      "tokenizer file for decoding samples (default = data/tinyshakespeare/gpt2_tokenizer.bin)")                       \
    X("-n", INT, checkpoint_every, 0, "write a checkpoint every how many steps (default 0 = never)")                   \
    X("-nk", INT, checkpoints_keep, 0, "keep the last how many checkpoints (default 0 = all)")                         \
    X("-y", INT, resume, 0, "resume from the latest complete checkpoint in -o (default 0)")                            \
    X("-b", INT, B, 4, "(per-GPU, micro) batch size B (default = 4)")                                                  \
    X("-t", INT, T, 1024, "sequence length T (default = 1024)")                                                        \
    X("-d", INT, total_batch_size, -1,                                                                                 \
      "total desired batch size in tokens (default = B*T*processes: no accumulation)")                                 \
    X("-x", INT, max_steps, -1, "max steps (default = -1 = one epoch)")                                                \
    X("-l", FLOAT, learning_rate, 3e-4f, "learning rate (default = 3e-4)")                                             \
    X("-u", INT, warmup_iterations, 0, "learning rate warmup iterations (default = 0)")                                \
    X("-q", FLOAT, final_lr_frac, 1.0f,                                                                                \
      "learning rate decay: final fraction, at end of training (default = 1.0 = no decay)")                            \
    X("-k", STRING, lr_scheduler_type, "cosine",                                                                       \
      "learning rate scheduler: cosine, linear, constant, wsd (default = cosine)")                                     \
    X("-c", FLOAT, weight_decay, 0.0f, "weight decay (default = 0.0)")                                                 \
    X("-v", INT, val_every, 20, "val loss every how many steps (default = 20, 0 = never)")                             \
    X("-m", INT, val_max_steps, 20, "val batches (default = 20)")                                                      \
    X("-s", INT, sample_every, 20, "sample every how many steps (default = 20, 0 = never)")                            \
    X("-g", INT, gen_tokens, 64, "generated tokens per sample (default = 64)")                                         \
    X("-a", INT, overfit_single_batch, 0, "overfit a single batch? 0/1 (default = 0)")                                 \
    X("-w", INT, use_master_weights, 1, "keep fp32 master weights? 0/1 (default = 1)")                                 \
    X("-pm", INT, plan_gib, 0,                                                                                         \
      "print the memory plan of a descriptor's model on a device of this many GiB, and exit (default = 0)")            \
    X("-oo", INT, offload_optimizer, 0,                                                                                \
      "ZeRO-Offload: m, v and master weights in host memory, AdamW on the host CPU? 0/1, or 2: AdamW on\n"             \
      "each gradient piece as it reaches the host, during the backward pass, kept unless the step clips\n"             \
      "(12 more bytes of host memory per parameter) (default = 0)")                                                    \
    X("-tp", INT, tensor_parallel, 1,                                                                                  \
      "tensor parallelism: every layer split over this many consecutive processes (Megatron-style:\n"                   \
      "heads, hidden units and vocabulary rows; doc/parallelism.md) (default = 1)")                                    \
    X("-sp", INT, sequence_parallel, 1,                                                                                \
      "with -tp N > 1, sequence parallelism: the norms and the residual stream on B*T/N tokens per\n"                  \
      "process? 0/1 (default = 1)")                                                                                    \
    X("-pp", INT, pipeline_stages, 1,                                                                                  \
      "pipeline parallelism: the layers cut into this many stages, each on P/N processes, the\n"                       \
      "micro-batches (-d) passed stage to stage (doc/parallelism.md) (default = 1)")                                   \
    X("-ppl", STRING, pipeline_layers, NULL,                                                                           \
      "-pp: the layers of each stage, e.g. 5,7 (default: the cut that balances the stages' compute)")                 \
    X("-pps", STRING, pipeline_schedule, "1f1b",                                                                       \
      "-pp: the schedule, gpipe, 1f1b, interleaved (-ppv chunks per stage) or zb (ZB-H1: the weight\n"                \
      "gradients deferred into the bubbles) (default = 1f1b)")                                                         \
    X("-ppv", INT, pipeline_chunks, 1,                                                                                 \
      "-pps interleaved: model chunks per stage, 2 or more (the layers in pp*v equal chunks, chunk j on\n"             \
      "stage j % pp) (default = 1)")                                                                                   \
    X("-ppt", STRING, pipeline_trace, NULL,                                                                            \
      "-pp: write each step's passes, every process's begin and end, to this file (scripts/plot_pipeline.py\n"         \
      "draws it) (default = none)")                                                                                    \
    X("-z", INT, zero_stage, 0,                                                                                        \
      "ZeRO stage: 0 (all-reduce), 1 (sharded optimizer state), 2 (and sharded gradients), 3 (and sharded\n"           \
      "parameters, gathered layer by layer) (default = 0)")                                                            \
    X("-r", INT, recompute, 1, "recompute: 0 none, 1 GELU, 2 GELU and LayerNorms (default = 1)")                       \
    X("-ge", INT, gelu_fusion, 1,                                                                                      \
      "GELU fusion into cuBLASLt epilogues: 0 off, 1 forward (only with -r 0: a recomputed GELU is\n"                  \
      "llmc/gelu.cuh's in the forward too), 2 forward and backward (default = 1)")                                     \
    X("-fa", INT, flash_attention, -1,                                                                                 \
      "attention: 1 flash attention (llmc/flash_attention.cuh), 0 cuBLAS GEMMs around a softmax, or\n"                 \
      "cuDNN in a USE_CUDNN=1 build (default: flash attention when the build has no cuDNN and the head\n"              \
      "size is 16, 32, 64 or 128, else the other)")                                                                    \
    X("-sl", FLOAT, skip_update_lossz, 0.0f,                                                                           \
      "skip the update when the loss z-score exceeds this (default = 0 = off)")                                        \
    X("-gc", FLOAT, grad_clip, 1.0f, "clip the gradient to this global norm (default = 1.0, 0 = no clipping)")         \
    X("-sg", FLOAT, skip_update_gradz, 0.0f,                                                                           \
      "skip the update when the gradient-norm z-score exceeds this (default = 0 = off)")                               \
    X("-wt", INT, watchdog_s, 600,                                                                                     \
      "collective watchdog: end the job when processes wait on each other this many seconds\n"                         \
      "(default = 600, 0 = off)")                                                                                      \
    X("-ns", INT, divergence_steps, 3,                                                                                 \
      "stop when the loss or gradient norm is not finite for this many steps in a row (default = 3)")                  \
    X("-pi", STRING, init_method, "mpi", "process init: mpi, tcp or fs (default = mpi)")                               \
    X("-pf", STRING, fs_path, "", "shared directory for -pi fs")                                                       \
    X("-ps", STRING, server_ip, "", "server ip for -pi tcp")                                                           \
    X("-pn", INT, num_processes, 1,                                                                                    \
      "number of processes (-pi tcp/fs); with -pm, the processes the plan is for (default = 1)")                      \
    X("-pr", INT, process_rank, 0, "this process's rank (-pi tcp/fs)")                                                 \
    X("-pg", INT, gpus_per_node, 8, "GPUs per node (-pi tcp/fs, default = 8)")

typedef struct {
    TRAINER_FLAGS(FLAG_FIELD)
} TrainerSettings;

static Flag flag(const char* name, FlagType type, void* value, const char* help) {
    Flag f = {name, type, value, help, 0};
    return f;
}

// The settings' defaults and the trainer's flags, which write into `s`; returns the number of flags.
#define MAX_TRAINER_FLAGS 72
static int trainer_flags(Flag* f, TrainerSettings* s) {
    const TrainerSettings defaults = {TRAINER_FLAGS(FLAG_DEFAULT_VALUE)};
    *s = defaults;
#define FLAG_TARGET (*s)
    const Flag rows[] = {TRAINER_FLAGS(FLAG_ROW)};
#undef FLAG_TARGET
    int n = 0;
    static_assert(sizeof(rows) / sizeof(rows[0]) + 2 <= MAX_TRAINER_FLAGS, "MAX_TRAINER_FLAGS: room for -cd and -h");
    for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++) f[n++] = rows[i];
#ifdef ENABLE_CUDNN
    f[n++] = flag("-cd", FLAG_INT, &cudnn_attention_deterministic,
                  "cuDNN attention backward: 1 deterministic (Hopper only), 0 faster, dQ summed with float\n"
                  "atomics (default = 1; doc/cudnn.md)");
#endif
    f[n++] = flag("-h", FLAG_INT, NULL, "this help");
    return n;
}

// The fine-tuning flags (llmc/model_adapter.h): 0 and one line naming the flag
static int trainer_check_fine_tuning(const TrainerSettings* s, const Flag* flags, int num_flags) {
    const char* ft_only[] = {"-fr", "-fs", "-fw", "-fi", "-fm", "-fl"};
    if (!s->fine_tune[0]) {
        for (int i = 0; i < 6; i++) {
            if (flag_find(flags, num_flags, ft_only[i])->given) {
                fprintf(stderr, "%s applies to fine-tuning only (-ft lora)\n", ft_only[i]);
                return 0;
            }
        }
        return 1;
    }
    int method = ft_method_number(s->fine_tune);
    if (method == 0) {
        fprintf(stderr, "-ft %s: unknown fine-tuning method (expected lora, adapter, prompt, prefix or llama_adapter)\n",
                s->fine_tune);
        return 0;
    }
    int rows = method != FT_METHOD_LORA && method != FT_METHOD_BOTTLENECK;
    if (rows && s->ft_rank < 1) {
        fprintf(stderr, "-fr %d: -ft %s needs at least 1 row\n", s->ft_rank, s->fine_tune);
        return 0;
    }
    if (!rows && (s->ft_rank < 1 || s->ft_rank % 8 != 0)) {
        fprintf(stderr, "-fr %d: the %s must be a positive multiple of 8 (the GEMM kernels move 16-byte vectors of a "
                "row)\n", s->ft_rank, method == FT_METHOD_LORA ? "rank" : "bottleneck width");
        return 0;
    }
    if (method != FT_METHOD_LORA) {
        const char* lora_only[] = {"-fs", "-fw", "-fm"};
        for (int i = 0; i < 3; i++) {
            if (flag_find(flags, num_flags, lora_only[i])->given) {
                fprintf(stderr, "%s applies to -ft lora (-ft %s has no scale, no targets and no merged form)\n",
                        lora_only[i], s->fine_tune);
                return 0;
            }
        }
    }
    if (flag_find(flags, num_flags, "-fl")->given && (method != FT_METHOD_LLAMA_ADAPTER || s->ft_layers < 1)) {
        fprintf(stderr, "-fl %d: %s\n", s->ft_layers,
                method != FT_METHOD_LLAMA_ADAPTER ? "applies to -ft llama_adapter only" : "expected at least 1 layer");
        return 0;
    }
    if (!(s->ft_alpha > 0.0f) || !isfinite(s->ft_alpha)) {
        fprintf(stderr, "-fs %g: expected a finite alpha > 0\n", s->ft_alpha);
        return 0;
    }
    if (lora_parse_targets(s->ft_targets) == 0) return 0;
    if (s->tensor_parallel > 1) {
        fprintf(stderr, "-ft %s -tp %d: the adapters are not split over tensor-parallel processes: fine-tune with "
                "data parallelism and ZeRO (-tp 1)\n", s->fine_tune, s->tensor_parallel);
        return 0;
    }
    return 1;
}

// Values that no run can use are refused before anything starts: 0 and one line naming the flag.
static int trainer_check_settings(const TrainerSettings* s, const Flag* flags, int num_flags) {
    if (s->B < 1) { fprintf(stderr, "-b %d: the micro-batch must be at least 1\n", s->B); return 0; }
    if (s->T < 1) { fprintf(stderr, "-t %d: the sequence length must be at least 1\n", s->T); return 0; }
    if (s->recompute < 0 || s->recompute > 2) { fprintf(stderr, "-r %d: expected 0, 1 or 2\n", s->recompute); return 0; }
    if (s->zero_stage < 0 || s->zero_stage > 3) {
        fprintf(stderr, "-z %d: expected 0, 1, 2 or 3\n", s->zero_stage);
        return 0;
    }
    if (s->use_master_weights != 0 && s->use_master_weights != 1) {
        fprintf(stderr, "-w %d: expected 0 or 1\n", s->use_master_weights);
        return 0;
    }
    if (s->plan_gib < 0) { fprintf(stderr, "-pm %d: expected a device size in GiB, or 0\n", s->plan_gib); return 0; }
    if (!(s->grad_clip >= 0.0f) || !isfinite(s->grad_clip)) {
        fprintf(stderr, "-gc %g: expected a finite norm >= 0 (0: no clipping)\n", s->grad_clip);
        return 0;
    }
    if (s->offload_optimizer < 0 || s->offload_optimizer > 2) {
        fprintf(stderr, "-oo %d: expected 0, 1 or 2\n", s->offload_optimizer);
        return 0;
    }
    if (s->offload_optimizer && !s->use_master_weights && PRECISION_MODE != PRECISION_FP32) {
        fprintf(stderr, "-oo 1 updates fp32 master weights on the host: it needs -w 1 in %s\n", PRECISION_NAME);
        return 0;
    }
    if (s->overfit_single_batch != 0 && s->overfit_single_batch != 1) {
        fprintf(stderr, "-a %d: expected 0 or 1\n", s->overfit_single_batch);
        return 0;
    }
    if (s->flash_attention != -1 && s->flash_attention != 0 && s->flash_attention != 1) {
        fprintf(stderr, "-fa %d: expected 0 or 1\n", s->flash_attention);
        return 0;
    }
    if (s->gelu_fusion < 0 || s->gelu_fusion > 2) { fprintf(stderr, "-ge %d: expected 0, 1 or 2\n", s->gelu_fusion); return 0; }
#ifdef ENABLE_CUDNN
    if (cudnn_attention_deterministic != 0 && cudnn_attention_deterministic != 1) {
        fprintf(stderr, "-cd %d: expected 0 or 1\n", cudnn_attention_deterministic);
        return 0;
    }
#endif
    if (s->resume && !s->output_dir) { fprintf(stderr, "-y 1 needs -o, the directory to resume from\n"); return 0; }
    if (s->checkpoint_every > 0 && !s->output_dir) {
        fprintf(stderr, "-n %d needs -o, the directory for checkpoints\n", s->checkpoint_every);
        return 0;
    }
    // -d: default (absent) is B*T*processes; an explicit value must be a positive token count
    if (flag_find(flags, num_flags, "-d")->given && s->total_batch_size < 1) {
        fprintf(stderr, "-d %d: expected a positive number of tokens per step\n", s->total_batch_size);
        return 0;
    }
    if (s->watchdog_s < 0) { fprintf(stderr, "-wt %d: expected seconds, or 0 for no watchdog\n", s->watchdog_s); return 0; }
    if (s->divergence_steps < 1) { fprintf(stderr, "-ns %d: expected at least 1 step\n", s->divergence_steps); return 0; }
    if (s->max_steps == 0 || s->max_steps < -1) {
        fprintf(stderr, "-x %d: expected a positive number of steps, or -1 for one epoch\n", s->max_steps);
        return 0;
    }
    const char* names[] = {"-n", "-v", "-m", "-g", "-s"};
    int values[] = {s->checkpoint_every, s->val_every, s->val_max_steps, s->gen_tokens, s->sample_every};
    for (int i = 0; i < 5; i++) {
        if (values[i] < 0) { fprintf(stderr, "%s %d: expected 0 or a positive number\n", names[i], values[i]); return 0; }
    }
    if (s->learning_rate < 0.0f || s->final_lr_frac < 0.0f || s->weight_decay < 0.0f || s->warmup_iterations < 0 ||
        s->checkpoints_keep < 0) {
        fprintf(stderr, "-l, -q, -c, -u and -nk must not be negative\n");
        return 0;
    }
    // the architecture flags (both trainers'); the values a model needs are checked with its sizes
    // (check_config_supported), the flag's own range here
    int llama = !strcmp(s->arch, "llama");
    if (!llama && strcmp(s->arch, "gpt2") != 0) {
        fprintf(stderr, "-arch %s: expected gpt2 or llama\n", s->arch);
        return 0;
    }
    const char* llama_only[] = {"-kv", "-rt", "-fh", "-eps", "-tie"};
    for (int i = 0; i < 5; i++) {
        if (!llama && flag_find(flags, num_flags, llama_only[i])->given) {
            fprintf(stderr, "%s applies to -arch llama only\n", llama_only[i]);
            return 0;
        }
    }
    if (llama && s->flash_attention == 0) {
        fprintf(stderr, "-fa 0: -arch llama runs on flash attention only (the cuBLAS-and-softmax and cuDNN paths "
                "have no grouped-query attention or RoPE)\n");
        return 0;
    }
    if (flag_find(flags, num_flags, "-kv")->given && s->kv_heads < 1) {
        fprintf(stderr, "-kv %d: expected a positive number of key/value heads\n", s->kv_heads);
        return 0;
    }
    if (flag_find(flags, num_flags, "-fh")->given && s->ffn_hidden < 1) {
        fprintf(stderr, "-fh %d: expected a positive hidden size\n", s->ffn_hidden);
        return 0;
    }
    if (s->tensor_parallel < 1) { fprintf(stderr, "-tp %d: expected 1 or more processes\n", s->tensor_parallel); return 0; }
    if (s->sequence_parallel != 0 && s->sequence_parallel != 1) {
        fprintf(stderr, "-sp %d: expected 0 or 1\n", s->sequence_parallel);
        return 0;
    }
    if (s->tensor_parallel == 1 && flag_find(flags, num_flags, "-sp")->given) {
        fprintf(stderr, "-sp %d: sequence parallelism cuts the tokens between tensor-parallel processes: it needs -tp 2 "
                "or more\n", s->sequence_parallel);
        return 0;
    }
    if (s->pipeline_stages < 1) { fprintf(stderr, "-pp %d: expected 1 or more stages\n", s->pipeline_stages); return 0; }
    if (pipeline_schedule_number(s->pipeline_schedule) < 0) {
        fprintf(stderr, "-pps %s: expected gpipe, 1f1b, interleaved or zb\n", s->pipeline_schedule);
        return 0;
    }
    const char* pipeline_only[] = {"-ppl", "-pps", "-ppt", "-ppv"};
    for (int i = 0; i < 4; i++) {
        if (s->pipeline_stages == 1 && flag_find(flags, num_flags, pipeline_only[i])->given) {
            fprintf(stderr, "%s: applies to a pipeline of 2 or more stages (-pp)\n", pipeline_only[i]);
            return 0;
        }
    }
    int interleaved = pipeline_schedule_number(s->pipeline_schedule) == SCHEDULE_INTERLEAVED;
    if (s->pipeline_stages > 1 && (interleaved ? s->pipeline_chunks < 2 : s->pipeline_chunks != 1)) {
        fprintf(stderr, "-ppv %d: %s\n", s->pipeline_chunks, interleaved ? "-pps interleaved runs 2 or more chunks per stage"
                : "model chunks per stage are -pps interleaved's");
        return 0;
    }
    if (interleaved && s->pipeline_layers) {
        fprintf(stderr, "-ppl %s: -pps interleaved cuts the layers into equal chunks\n", s->pipeline_layers);
        return 0;
    }
    if (s->tie_embeddings != 0 && s->tie_embeddings != 1) {
        fprintf(stderr, "-tie %d: expected 0 or 1\n", s->tie_embeddings);
        return 0;
    }
    return trainer_check_fine_tuning(s, flags, num_flags);
}

// The architecture of a descriptor from the flags (only the family fields of the config are set)
static ModelConfig trainer_descriptor_arch(const TrainerSettings* s) {
    ModelConfig arch;
    memset(&arch, 0, sizeof(arch));
    arch.family = !strcmp(s->arch, "llama") ? FAMILY_LLAMA : FAMILY_GPT2;
    arch.num_kv_heads = s->kv_heads;
    arch.rope_theta = s->rope_theta;
    arch.ffn_hidden = s->ffn_hidden;
    arch.norm_eps = s->norm_eps;
    arch.tied = s->tie_embeddings;
    return arch;
}

// A model file's header gives its architecture: an architecture flag given with one must say the same (a resumed
// run repeats its command line), else 0 and one line naming the flag.
static int trainer_check_arch_of_file(const TrainerSettings* s, const Flag* flags, int num_flags, const Model* model) {
    const ModelConfig* c = &model->config;
    ModelConfig want = trainer_descriptor_arch(s);
    if (flag_find(flags, num_flags, "-arch")->given && want.family != c->family) {
        fprintf(stderr, "-arch %s: %s is a %s model\n", s->arch, s->model_source, family_name(c->family));
        return 0;
    }
    const char* names[5] = {"-kv", "-fh", "-tie", "-rt", "-eps"};
    int given_int[3] = {want.num_kv_heads, want.ffn_hidden, want.tied}, file_int[3] = {c->num_kv_heads, c->ffn_hidden,
                                                                                     c->tied};
    float given_float[2] = {want.rope_theta, want.norm_eps}, file_float[2] = {c->rope_theta, c->norm_eps};
    for (int i = 0; i < 5; i++) {
        if (!flag_find(flags, num_flags, names[i])->given) continue;
        if (i < 3 && given_int[i] != file_int[i]) {
            fprintf(stderr, "%s %d: the model file %s has %d\n", names[i], given_int[i], s->model_source, file_int[i]);
            return 0;
        }
        if (i >= 3 && given_float[i - 3] != file_float[i - 3]) {
            fprintf(stderr, "%s %g: the model file %s has %g\n", names[i], given_float[i - 3], s->model_source,
                    file_float[i - 3]);
            return 0;
        }
    }
    return 1;
}

// The resume step: the latest complete checkpoint in the output directory that every process verifies, else the
// one before it, and so on; -1 to start from -e. Collective.
static int trainer_resume_step(const TrainerSettings* s, const MultiGpuConfig* mg) {
    int rank0 = mg->process_rank == 0;
    int step = find_latest_checkpoint(s->output_dir);
    int found_any = step >= 0;
    while (step >= 0) {
        char* why;
        int legacy = 0;
        int ok = verify_checkpoint(s->output_dir, step, mg->process_rank, mg->num_processes, &legacy, &why);
        if (!ok) fprintf(stderr, "-y 1: checkpoint step %d fails verification: %s\n", step, why);
        free(why);
        if (multi_gpu_cpu_float_sum(ok ? 0.0f : 1.0f, mg) == 0.0f) {
            if (legacy && rank0)
                printf("note: %s/DONE_%08d has no checksums (an older checkpoint): loaded unverified\n", s->output_dir,
                       step);
            return step;
        }
        step = find_checkpoint_before(s->output_dir, step);
        if (rank0 && step >= 0) printf("-y 1: trying the previous complete checkpoint, step %d\n", step);
    }
    if (found_any) {
        fprintf(stderr, "-y 1: no complete checkpoint in %s passes verification\n", s->output_dir);
        exit(EXIT_FAILURE);
    }
    if (rank0) printf("-y 1: no complete checkpoint in %s, starting from -e %s\n", s->output_dir, s->model_source);
    return -1;
}
