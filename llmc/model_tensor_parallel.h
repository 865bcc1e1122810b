// llmc/model_tensor_parallel.h: the model split over tensor-parallel processes (-tp N, doc/parallelism.md): its
// slices' widths, how each tensor of the model file is cut (model_tensor_split) and the members' slices put back
// together, the joins between the split blocks (Megatron's f and g, with sequence parallelism as reduce-scatter and
// all-gather), the vocabulary-parallel embedding and loss, the logits put together for sampling, and the checks of a
// layout. train_gpt.cu includes it after the Model struct; the groups and collectives are llmc/tensor_parallel.cuh's.
// Tests: gpt-*-tp*, llama-*-tp* and check-gpt-*-tp* (test_gpt.cu against PyTorch and against -tp 1),
// tensor-parallel-cli (dev/test/test_tensor_parallel.sh).
#pragma once

static void fill_in_parameter_sizes(const Model* model, size_t* in_file, size_t* in_set);
static TensorSplit model_stage_split(const Model* m, int i, int s, int c, const size_t* in_file, size_t* offset);
static int model_pp_stage(const Model* m);
static int model_pp_chunks(const Model* m);

// Tensor parallelism (llmc/tensor_parallel.cuh, doc/parallelism.md): the degree N, this process's member index, and
// the widths of its slices of the split layers: NH/N query heads, NKV/N key/value heads, C/N attention channels,
// H/N hidden units, Vp/N vocabulary rows. With sequence parallelism the residual stream holds B*T/N tokens.
static int model_tp_degree(const Model* m) { return m->tp ? m->tp->degree : 1; }
static int model_tp_member(const Model* m) { return m->tp ? m->tp->member : 0; }
static int model_sequence_parallel(const Model* m) { return m->tp && m->tp->degree > 1 && m->tp->sequence_parallel; }
static int local_heads(const Model* m) { return m->config.num_heads / model_tp_degree(m); }
static int local_kv_heads(const Model* m) { return m->config.num_kv_heads / model_tp_degree(m); }
static int local_channels(const Model* m) { return m->config.channels / model_tp_degree(m); }
static int local_hidden(const Model* m) { return m->config.ffn_hidden / model_tp_degree(m); }
static int local_vocab(const Model* m) { return m->config.padded_vocab_size / model_tp_degree(m); }
static size_t local_qkv_channels(const Model* m) { return qkv_channels(&m->config) / model_tp_degree(m); }
static size_t local_fc_channels(const Model* m) { return fc_channels(&m->config) / model_tp_degree(m); }
static int model_stream_tokens(const Model* m, int BT) { return model_sequence_parallel(m) ? BT / m->tp->degree : BT; }
// a row-parallel layer's bias: added by member 0 only, before the sum over the members
static const floatX* row_parallel_bias(const Model* m, const floatX* bias) {
    return model_tp_member(m) == 0 ? bias : nullptr;
}

// How tensor i (of in_file[i] values in the file) is cut over the tensor-parallel members (llmc/tensor_parallel.cuh):
// qkv column-parallel by head (each member NH/N query heads and NKV/N key/value heads), fc column-parallel (SwiGLU's
// gate and up halves alike), the attention's and the MLP's output projections row-parallel (their biases replicated,
// added by member 0), wte and lm_head by vocabulary rows; the norms and wpe replicated, and so are an extension's
// tensors in the replicated set (those in its own set are none of this set's: no rows).
// The cut is the same at every degree (at degree 1 the one slice is the whole tensor), so that a checkpoint's
// optimizer state is re-cut for another one.
static TensorSplit model_tensor_split(const Model* model, int i, const size_t* in_file) {
    const ModelConfig* c = &model->config;
    TensorSplit s = {SPLIT_NONE, 1, in_file[i], 1, 0, {0, 0, 0}};
    if (in_file[i] == 0) return s;
    const FfnExtension* x = model->extension.ffn;
    if (i >= PARAM_EXTENSION && i < PARAM_EXTENSION + MLP_EXTENSION_SLOTS && x->tensor_sizes) {
        size_t file[MLP_EXTENSION_SLOTS] = {0}, replicated[MLP_EXTENSION_SLOTS] = {0};
        x->tensor_sizes(model, file, replicated);
        if (replicated[i - PARAM_EXTENSION] == 0) s.rows = 0;
        return s;
    }
    size_t C = c->channels, HS = C / c->num_heads, L = c->num_layers, Ld = model_dense_layers(model);
    size_t q = c->num_heads * HS, kv = c->num_kv_heads * HS, H = c->ffn_hidden, Vp = c->padded_vocab_size;
    int swiglu = c->activation == ACTIVATION_SWIGLU;
    TensorSplit qkv = {SPLIT_ROWS, L, q + 2 * kv, C, 3, {q, kv, kv}};
    TensorSplit fc = {SPLIT_ROWS, Ld, (swiglu ? 2 : 1) * H, C, swiglu ? 2 : 1, {H, H, 0}};
    TensorSplit vocab = {SPLIT_ROWS, 1, Vp, C, 1, {Vp, 0, 0}};
    switch (i) {
    case PARAM_WTE: case PARAM_LM_HEAD: return vocab;
    case PARAM_QKVW: return qkv;
    case PARAM_QKVB: qkv.cols = 1; return qkv;
    case PARAM_FCW: return fc;
    case PARAM_FCB: fc.cols = 1; return fc;
    case PARAM_ATTPROJW: { TensorSplit w = {SPLIT_COLUMNS, L, C, C, 0, {0, 0, 0}}; return w; }
    case PARAM_FCPROJW: { TensorSplit w = {SPLIT_COLUMNS, Ld, C, H, 0, {0, 0, 0}}; return w; }
    default: return s;
    }
}
// Which tensors this member counts in the gradient norm: its slices of the split tensors, and the whole ones on member
// 0 only (every member holds them, with the same gradient)
static void model_norm_tensors(const Model* model, int* include) {
    size_t in_file[NUM_PARAMETER_TENSORS], in_set[NUM_PARAMETER_TENSORS];
    fill_in_parameter_sizes(model, in_file, in_set);
    for (int i = 0; i < NUM_PARAMETER_TENSORS; i++)
        include[i] = model_tensor_split(model, i, in_file).kind != SPLIT_NONE || model_tp_member(model) == 0;
}

// Under tensor parallelism, the members' sets put together (collective over the tensor-parallel group): each member's
// set (device memory, or host memory with `kind` cudaMemcpyHostToHost) goes to every member, and each member's slices
// go to their places in the whole tensors (a replicated tensor is every member's the same).
static void model_join_slices(const Model* model, floatX* file_order, const floatX* replicated, cudaMemcpyKind kind) {
    size_t in_file[NUM_PARAMETER_TENSORS], in_set[NUM_PARAMETER_TENSORS];
    fill_in_parameter_sizes(model, in_file, in_set);
    int N = model_tp_degree(model);
    size_t n = model->store.num_parameters;
    floatX *mine, *all;
    cudaCheck(cudaMalloc((void**)&mine, n * sizeof(floatX)));
    cudaCheck(cudaMalloc((void**)&all, N * n * sizeof(floatX)));
    cudaCheck(cudaMemcpy(mine, replicated, n * sizeof(floatX),
                         kind == cudaMemcpyHostToHost ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToDevice));
    cudaStream_t stream = model->tp->dp.nccl_stream;
    tensor_parallel_all_gather_bytes(model->tp, all, mine, n * sizeof(floatX), stream);
    floatX* host = (floatX*)malloc_check(N * n * sizeof(floatX));
    cudaCheck(cudaMemcpyAsync(host, all, N * n * sizeof(floatX), cudaMemcpyDeviceToHost, stream));
    cudaCheck(cudaStreamSynchronize(stream));
    for (int m = 0; m < N; m++) {
        size_t from = 0, to = 0;
        int chunks = model_pp_chunks(model);
        for (int i = 0; i < NUM_PARAMETER_TENSORS; i++) {
            for (int c = 0; c < chunks; c++) {  // this stage's blocks, chunk by chunk (llmc/model_pipeline.h)
                size_t offset;
                TensorSplit s = model_stage_split(model, i, model_pp_stage(model), c, in_file, &offset);
                tensor_split_copy(&s, m, N, file_order + to + offset, host + m * n + from, sizeof(floatX), 1);
                from += chunks == 1 ? in_set[i] : tensor_split_slice_size(&s, N);
            }
            to += in_file[i];
        }
    }
    free(host);
    cudaCheck(cudaFree(mine));
    cudaCheck(cudaFree(all));
}

// Under tensor parallelism the split layers' widths divide by N (doc/parallelism.md): the heads, the key/value heads,
// the FFN's hidden size and the padded vocabulary (in 16-byte rows); with sequence parallelism the sequence length T
// too (so that the B*T tokens divide at any B). 0 and one line naming `source` or the flag otherwise.
static int model_check_tensor_parallel(const Model* model, int T, const char* source) {
    const ModelConfig* c = &model->config;
    int N = model_tp_degree(model);
    char why[256];
    if (N == 1) return 1;
    const char* what[3] = {"heads", "key/value heads", "FFN hidden size"};
    int value[3] = {c->num_heads, c->num_kv_heads, c->ffn_hidden};
    for (int i = 0; i < 3; i++) {
        if (value[i] % N != 0) {
            fprintf(stderr, "-tp %d: %s: %d %s, which %d processes cannot share equally\n", N, source, value[i],
                    what[i], N);
            return 0;
        }
    }
    if (!vocab_parallel_classifier_support(c->vocab_size, c->padded_vocab_size, N, why, sizeof(why))) {
        fprintf(stderr, "-tp %d: %s: %s\n", N, source, why);
        return 0;
    }
    if (model_sequence_parallel(model) && T % N != 0) {
        fprintf(stderr, "-sp 1 with -tp %d: the sequence length -t %d must be a multiple of %d (each process takes B*T/%d "
                "tokens)\n", N, T, N, N);
        return 0;
    }
    return 1;
}

// ----------------------------------------------------------------------------------------------------
// The tensor-parallel split's joins (Megatron's f and g; llmc/tensor_parallel.cuh, doc/parallelism.md). Without tensor
// parallelism each is the identity; with it, the stream between the split blocks holds the whole batch on every member,
// or with sequence parallelism this member's B*T/N tokens.

// The sum over the members of a split block's part `partial` (B*T rows of C): a row-parallel block's output, or in the
// backward pass a column-parallel block's input gradient. In place (all-reduce), or with sequence parallelism onto this
// member's tokens in `member_rows` (reduce-scatter). Returns the summed rows the stream reads.
static const floatX* tp_sum_over_members(Model* model, floatX* partial, floatX* member_rows, int BT,
                                         cudaStream_t stream) {
    if (model_tp_degree(model) == 1) return partial;
    size_t C = model->config.channels;
    if (!model_sequence_parallel(model)) {
        tensor_parallel_all_reduce(model->tp, partial, (size_t)BT * C, stream);
        return partial;
    }
    tensor_parallel_reduce_scatter(model->tp, member_rows, partial, (size_t)model_stream_tokens(model, BT) * C, stream);
    return member_rows;
}
// Where a norm of the stream writes the rows that a split block reads whole: `whole` itself, or with sequence
// parallelism this member's rows in a.member_norm, which tp_gather_norm then puts together into `whole`.
static floatX* tp_norm_output(const Model* model, floatX* whole) {
    return model_sequence_parallel(model) ? model->acts.member_norm : whole;
}
static void tp_gather_norm(Model* model, floatX* whole, int BT, cudaStream_t stream) {
    if (!model_sequence_parallel(model)) return;
    size_t rows = model_stream_tokens(model, BT);
    tensor_parallel_all_gather(model->tp, whole, model->acts.member_norm, rows * model->config.channels, stream);
}
// The stream's gradient `dstream` as a split block's output gradient over the whole batch: itself, or with sequence
// parallelism every member's tokens put together in a.gathered_dout.
static const floatX* tp_whole_gradient(Model* model, const floatX* dstream, int BT, cudaStream_t stream) {
    if (!model_sequence_parallel(model)) return dstream;
    size_t rows = model_stream_tokens(model, BT);
    tensor_parallel_all_gather(model->tp, model->acts.gathered_dout, dstream, rows * model->config.channels, stream);
    return model->acts.gathered_dout;
}
// With sequence parallelism each member's norm weight gradients are its tokens' part: summed over the members (on the
// step's last micro-step, when they are complete) before they are reduced over the data-parallel processes.
static void tp_sum_norm_gradients(Model* model, floatX* weight, floatX* bias, cudaStream_t stream) {
    if (!model_sequence_parallel(model)) return;
    size_t C = model->config.channels;
    tensor_parallel_all_reduce(model->tp, weight, C, stream);
    if (bias) tensor_parallel_all_reduce(model->tp, bias, C, stream);
}

// The embeddings into a.encoded (the stream's tokens). Under tensor parallelism vocabulary-parallel: each member looks
// up the tokens its wte rows hold (zero for the others), member 0 adds wpe, and the sum over the members is the stream.
static void model_embed(Model* model, const ParameterTensors* p, int B, int T, cudaStream_t stream) {
    const ModelConfig* c = &model->config;
    ActivationTensors a = model->acts;
    const floatX* wpe = c->positions == POSITIONS_LEARNED ? p->wpe : nullptr;
    if (model_tp_degree(model) == 1) {
        encoder_forward(a.encoded, model->inputs, p->wte, wpe, B, T, c->channels, stream);
        return;
    }
    int Vs = local_vocab(model);
    floatX* partial = model_sequence_parallel(model) ? a.scratch_btc : a.encoded;
    encoder_forward_vocab_range(partial, model->inputs, p->wte, model_tp_member(model) == 0 ? wpe : nullptr, B, T,
                                c->channels, model_tp_member(model) * Vs, Vs, stream);
    tp_sum_over_members(model, partial, a.encoded, B * T, stream);
}

// The loss and (with write_dlogits) the logits' gradient from this member's slice of the logits (B*T rows of Vp/N):
// the vocabulary-parallel classifier (llmc/fused_classifier.cuh), whose rows' max, sum of exponentials and target
// logit are reduced over the members between its kernels. Every member gets every token's loss.
static void vocab_parallel_loss(Model* model, float dloss, int BT, bool write_dlogits, cudaStream_t stream) {
    ActivationTensors a = model->acts;
    int Vs = local_vocab(model), v0 = model_tp_member(model) * Vs, V = model->config.vocab_size;
    float* stats = a.classifier_stats;  // (4, BT): row max, own max, sum, target logit
    vocab_parallel_classifier_stats(stats, a.output, model->targets, BT, Vs, v0, V, stream);
    tensor_parallel_all_reduce_float(model->tp, stats, BT, ncclMax, stream);
    vocab_parallel_classifier_rescale(stats, BT, stream);
    tensor_parallel_all_reduce_float(model->tp, stats + 2 * (size_t)BT, 2 * (size_t)BT, ncclSum, stream);
    vocab_parallel_classifier_finish(a.output, a.losses, stats, dloss, model->targets, BT, Vs, v0, V, write_dlogits,
                                     stream);
}

// Logits rows whole (rows, Vp) into host memory from this member's (rows, Vp/N) on the device. Under tensor
// parallelism collective over the members, each of which holds Vp/N columns of every row.
static void tp_copy_logits(Model* model, floatX* host, const floatX* mine, size_t rows, cudaStream_t stream) {
    size_t Vp = model->config.padded_vocab_size, Vs = local_vocab(model), N = model_tp_degree(model);
    if (N == 1) {
        cudaCheck(cudaMemcpyAsync(host, mine, rows * Vp * sizeof(floatX), cudaMemcpyDeviceToHost, stream));
        cudaCheck(cudaStreamSynchronize(stream));
        return;
    }
    floatX* all;  // (N, rows, Vs)
    cudaCheck(cudaMalloc((void**)&all, N * rows * Vs * sizeof(floatX)));
    tensor_parallel_all_gather(model->tp, all, mine, rows * Vs, stream);
    floatX* gathered = (floatX*)malloc_check(N * rows * Vs * sizeof(floatX));
    cudaCheck(cudaMemcpyAsync(gathered, all, N * rows * Vs * sizeof(floatX), cudaMemcpyDeviceToHost, stream));
    cudaCheck(cudaStreamSynchronize(stream));
    cudaCheck(cudaFree(all));
    for (size_t m = 0; m < N; m++)
        for (size_t r = 0; r < rows; r++)
            memcpy(host + r * Vp + m * Vs, gathered + (m * rows + r) * Vs, Vs * sizeof(floatX));
    free(gathered);
}
// Rows [first, first + rows) of the last forward pass's logits, whole (rows, Vp), into host memory (collective under
// tensor parallelism)
static void model_copy_logits(Model* model, floatX* host, size_t first, size_t rows, cudaStream_t stream) {
    tp_copy_logits(model, host, model->acts.output + first * local_vocab(model), rows, stream);
}
