// llmc/model_pipeline.h: the model cut into pipeline stages (-pp N, doc/parallelism.md "Pipeline parallelism"): the
// layers a stage runs, the blocks of each tensor it holds (its layers' slices of the stacked tensors; the embeddings on
// the first stage, the final norm and the classifier on the last, wte on both with a tied output embedding), the whole
// model put together from the stages, and the tied embedding's gradient summed between the first and last stage.
// train_gpt.cu includes it after llmc/model_tensor_parallel.h; the groups, schedules and sends are llmc/pipeline.h's.
// Tests: pipeline-cli (dev/test/test_pipeline_parallel.sh).
#pragma once

static int model_pp_stages(const Model* m) { return m->pp ? m->pp->stages : 1; }
static int model_pp_stage(const Model* m) { return m->pp ? m->pp->stage : 0; }
static int model_pp_chunks(const Model* m) { return m->pp ? m->pp->chunks : 1; }
static int model_first_stage(const Model* m) { return model_pp_stage(m) == 0; }
static int model_last_stage(const Model* m) { return model_pp_stage(m) == model_pp_stages(m) - 1; }

// A cut of the layers into stages and their chunks: model chunk j = c p + s, stage s's chunk c, holds layers
// [first_layer[j], first_layer[j + 1]) (one chunk per stage but with interleaving); this run's, or a checkpoint's.
typedef struct {
    int stages, chunks;
    int first_layer[PIPELINE_MAX_STAGES + 1];
} StageCut;
static StageCut model_stage_cut(const Model* m) {
    StageCut c;
    c.stages = model_pp_stages(m), c.chunks = model_pp_chunks(m);
    int n = c.stages * c.chunks;
    for (int j = 0; j <= n; j++) c.first_layer[j] = c.stages == 1 ? (j ? m->config.num_layers : 0) : m->pp->first_layer[j];
    return c;
}
// stage s's chunk c: layers [cut_begin, cut_end)
static int cut_begin(const StageCut* cut, int s, int c) { return cut->first_layer[c * cut->stages + s]; }
static int cut_end(const StageCut* cut, int s, int c) { return cut->first_layer[c * cut->stages + s + 1]; }

// This stage's layers, chunk after chunk: how many, and layer l's place among them (its slices' index in the stage's
// stacked tensors and activations); the same for the dense layers among them
static int model_stage_layers(const Model* m) {
    StageCut cut = model_stage_cut(m);
    int n = 0;
    for (int c = 0; c < cut.chunks; c++) n += cut_end(&cut, model_pp_stage(m), c) - cut_begin(&cut, model_pp_stage(m), c);
    return n;
}
static int model_local_layer(const Model* m, int l) {
    StageCut cut = model_stage_cut(m);
    int s = model_pp_stage(m), before = 0;
    for (int c = 0; c < cut.chunks; c++) {
        int b = cut_begin(&cut, s, c), e = cut_end(&cut, s, c);
        if (l >= b && l < e) return before + l - b;
        before += e - b;
    }
    fprintf(stderr, "model_local_layer: layer %d is not stage %d's\n", l, s);
    exit(EXIT_FAILURE);
}
static int model_stage_dense_index(const Model* m, int l) {  // the stage's dense layers before l
    StageCut cut = model_stage_cut(m);
    int s = model_pp_stage(m), before = 0;
    for (int c = 0; c < cut.chunks; c++) {
        int b = cut_begin(&cut, s, c), e = cut_end(&cut, s, c);
        if (l >= b && l < e) return before + model_dense_index(m, l) - model_dense_index(m, b);
        before += model_dense_index(m, e) - model_dense_index(m, b);
    }
    return before;
}
static int model_stage_dense_layers(const Model* m) { return model_stage_dense_index(m, m->config.num_layers); }

// The layers of the current pass: model->chunk's (the pipeline's step sets it; 0 otherwise): [begin, end)
static int model_layer_begin(const Model* m) {
    StageCut cut = model_stage_cut(m);
    return cut_begin(&cut, model_pp_stage(m), m->chunk);
}
static int model_layer_end(const Model* m) {
    StageCut cut = model_stage_cut(m);
    return cut_end(&cut, model_pp_stage(m), m->chunk);
}
// whether the current pass's chunk is the model's first (the embeddings) or last (the final norm and the classifier)
static int model_first_chunk(const Model* m) { return model_first_stage(m) && m->chunk == 0; }
static int model_last_chunk(const Model* m) { return model_last_stage(m) && m->chunk == model_pp_chunks(m) - 1; }
// With a tied output embedding and two or more stages, the first and the last stage both hold wte.
static int model_shares_wte(const Model* m) { return m->config.tied && model_pp_stages(m) > 1; }

// The blocks of tensor i that stage s's chunk c of `cut` holds, [*first, *first + *count) of *blocks: its layers'
// slices of a tensor stacked over every layer (blocks L), over the dense layers (Ld) or, an extension's, over the
// layers whose FFN it replaces (L - Ld: llmc/model_extension.h); the tensors outside the layers
// are one block, on the first stage (wte, wpe), the last (the final norm, lm_head, and a tied wte), or both (counted
// with chunk 0). A stage's set holds each tensor's blocks chunk after chunk.
static void stage_blocks_of(const Model* m, const StageCut* cut, int i, int s, int c, size_t* first, size_t* count,
                            size_t* blocks) {
    int p = cut->stages, begin = cut_begin(cut, s, c), end = cut_end(cut, s, c);
    int first_stage = s == 0 && c == 0, last_stage = s == p - 1 && c == 0;
    *first = 0;
    switch (i) {
    case PARAM_LN1W: case PARAM_LN1B: case PARAM_QKVW: case PARAM_QKVB: case PARAM_ATTPROJW: case PARAM_ATTPROJB:
    case PARAM_LN2W: case PARAM_LN2B:
        *blocks = m->config.num_layers, *first = begin, *count = end - begin;
        return;
    case PARAM_FCW: case PARAM_FCB: case PARAM_FCPROJW: case PARAM_FCPROJB:
        *blocks = model_dense_layers(m), *first = model_dense_index(m, begin);
        *count = model_dense_index(m, end) - *first;
        return;
    case PARAM_WTE: *blocks = 1, *count = first_stage || (last_stage && m->config.tied); return;
    case PARAM_WPE: *blocks = 1, *count = first_stage; return;
    case PARAM_LNFW: case PARAM_LNFB: case PARAM_LM_HEAD: *blocks = 1, *count = last_stage; return;
    default:  // an extension's
        *blocks = m->config.num_layers - model_dense_layers(m), *first = begin - model_dense_index(m, begin);
        *count = end - model_dense_index(m, end) - *first;
        return;
    }
}


// Tensor i's cut over the tensor-parallel members (model_tensor_split) narrowed to stage s's blocks, and where those
// start in the whole tensor (values): a member's slice of a stage's blocks is its slice of each of those blocks.
static TensorSplit stage_split_of(const Model* m, const StageCut* cut, int i, int s, int c, const size_t* in_file,
                                  size_t* offset) {
    TensorSplit t = model_tensor_split(m, i, in_file);
    size_t first, count, blocks;
    stage_blocks_of(m, cut, i, s, c, &first, &count, &blocks);
    *offset = 0;
    // (an extension's own set's tensors have no rows in this set: the extension cuts them)
    if (blocks == 0 || in_file[i] == 0 || count == blocks || t.rows == 0) return t;
    size_t per_block = in_file[i] / blocks;
    *offset = first * per_block;
    if (t.kind == SPLIT_NONE) t.rows = count * per_block / (t.layers * t.cols);
    else t.layers = count;  // a split tensor's layers are its blocks
    return t;
}
static TensorSplit model_stage_split(const Model* m, int i, int s, int c, const size_t* in_file, size_t* offset) {
    StageCut cut = model_stage_cut(m);
    return stage_split_of(m, &cut, i, s, c, in_file, offset);
}

// The blocks of the whole model that stage s holds, put into `file_order` (host, model-file order) on every process
// from the stage's first holder: collective over the pipeline group, after each stage has filled in its own.
static void model_join_stages(const Model* m, floatX* file_order) {
    if (model_pp_stages(m) == 1) return;
    size_t in_file[NUM_PARAMETER_TENSORS], at[NUM_PARAMETER_TENSORS], n = 0;
    file_tensor_sizes(in_file, m);
    for (int i = 0; i < NUM_PARAMETER_TENSORS; i++) at[i] = n, n += in_file[i];
    floatX* device;
    cudaCheck(cudaMalloc((void**)&device, n * sizeof(floatX)));
    cudaCheck(cudaMemcpy(device, file_order, n * sizeof(floatX), cudaMemcpyHostToDevice));
    const MultiGpuConfig* g = &m->pp->group;
    StageCut cut = model_stage_cut(m);
    for (int i = 0; i < NUM_PARAMETER_TENSORS; i++) {
        int held_before = 0;  // a tensor two stages hold (a tied wte) comes from the first
        for (int s = 0; s < cut.stages && !held_before; s++) {
            for (int c = 0; c < cut.chunks; c++) {
                size_t first, count, blocks;
                stage_blocks_of(m, &cut, i, s, c, &first, &count, &blocks);
                if (count == 0 || in_file[i] == 0) continue;
                size_t per_block = in_file[i] / blocks;
                floatX* range = device + at[i] + first * per_block;
                ncclCheck(ncclBroadcast(range, range, count * per_block, nccl_floatX(), s, g->nccl_comm,
                                        g->nccl_stream));
                held_before = blocks == 1;
            }
        }
    }
    cudaCheck(cudaStreamSynchronize(g->nccl_stream));
    cudaCheck(cudaMemcpy(file_order, device, n * sizeof(floatX), cudaMemcpyDeviceToHost));
    cudaCheck(cudaFree(device));
}

// A tied wte's gradient: the classifier's part on the last stage, the embedding's on the first, summed on both before
// either is reduced over its data-parallel processes (Megatron's embedding group), so that both copies take the same
// update. Collective over the pipeline group's first and last stage; `scratch` holds the other stage's part, `sum`
// receives the sum (dwte itself, or where it is reduced from: ZeRO-2/3's bucket).
static void model_sum_shared_wte(Model* m, const floatX* dwte, floatX* scratch, floatX* sum, cudaStream_t stream) {
    if (!model_shares_wte(m) || !(model_first_stage(m) || model_last_stage(m))) return;
    size_t n = (size_t)local_vocab(m) * m->config.channels;
    int other = model_first_stage(m) ? model_pp_stages(m) - 1 : 0;
    pipeline_exchange(m->pp, dwte, other, scratch, other, n, stream);
    residual_forward(sum, dwte, scratch, n, stream);
}
