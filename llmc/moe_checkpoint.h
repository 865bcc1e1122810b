// llmc/moe_checkpoint.h: the experts' optimizer state file beside the model's checkpoint
// (<dir>/expert_state_%08d.bin, doc/formats.md), in the global layout of the model file's expert tensors so that a
// run resumes into another expert-parallel degree or ZeRO stage. train_moe.cu includes it after llmc/moe_ffn.h and
// fills train_gpt.cu's CheckpointExtension table with it.
// Tests: train-moe-cli (resumes across -ep and -z, bit for bit; truncated and mismatched state files).
#pragma once

#define EXPERT_STATE_MAGIC 20261130

// ----------------------------------------------------------------------------------------------------
// Checkpoints: the experts' optimizer state file

// The experts' optimizer state (m, v, and the master weights if any) of every expert, in the global layout of the
// model file's expert tensors, so that a run may resume with another expert-parallel degree or ZeRO stage:
// <dir>/expert_state_%08d.bin, header [0] magic, [1] version 1, [2] E, [3] Lm, [4] master weights 0/1,
// [5] precision, [6] and [7] the values per buffer (every expert's; high and low 31 bits); then each buffer in
// turn (fp32). Collective: the shards are gathered over the replicas, then process 0's group gathers the experts
// (under -pp each stage's group its layers', put together over the stages), and process 0 writes.
static void write_expert_state(const char* dir, int step, Model* model, int zero_stage, cudaStream_t stream) {
    MoEModel* moe = moe_of(model);
    const MoEConfig* c = &moe->config;
    ShardedParameters* x = &moe->expert_store;
    size_t all_experts = moe_file_expert_values(model);
    float* full;
    cudaCheck(cudaMalloc((void**)&full, x->num_parameters_padded * sizeof(float)));
    int gathers = moe->ep.group == 0;  // process 0's group (at -etp N, with every member's), the one that writes
    float* host = gathers ? (float*)malloc_check(all_experts * sizeof(float)) : NULL;
    char* path = checkpoint_path(dir, "expert_state", step, -1);
    char* tmp = NULL;
    FILE* f = NULL;
    if (model->process_rank == 0 && model_tp_member(model) == 0 && model_pp_stage(model) == 0) {  // the world's 0
        f = fopen_tmp_for(path, &tmp);
        int header[256] = {0};
        header[0] = EXPERT_STATE_MAGIC;
        header[1] = 1;
        header[2] = c->num_experts;
        header[3] = num_moe_layers(model);
        header[4] = x->has_master;
        header[5] = PRECISION_MODE;
        header[6] = (int)(all_experts >> 31);
        header[7] = (int)(all_experts & 0x7fffffff);
        fwrite_check(header, sizeof(int), 256, f, tmp);
    }
    for (int buffer = 0; buffer < (x->has_master ? 3 : 2); buffer++) {
        sharded_parameters_gather_state(x, buffer, full, &moe->ep.replicas, zero_stage, stream);
        if (gathers) moe_gather_stage_experts(model, host, full, sizeof(float), stream);
        if (gathers) moe_join_stage_experts(model, host, sizeof(float));
        if (f) fwrite_check(host, sizeof(float), all_experts, f, tmp);
    }
    if (f) commit_tmp(f, tmp, path);
    free(tmp);
    free(path);
    free(host);
    cudaCheck(cudaFree(full));
}

// Each process reads its own experts' runs of every buffer in its stage's MoE layers (at -etp N cuts its member's
// slices of them) and keeps its shard.
static void read_expert_state(const char* dir, int step, Model* model) {
    MoEModel* moe = moe_of(model);
    const MoEConfig* c = &moe->config;
    ShardedParameters* x = &moe->expert_store;
    size_t all_experts = moe_file_expert_values(model);
    char* path = checkpoint_path(dir, "expert_state", step, -1);
    FILE* f = fopen_check(path, "rb");
    int header[256];
    read_header_check(f, header, path, EXPERT_STATE_MAGIC, "MoE expert optimizer state");
    int Lmodel = num_moe_layers(model), Lm = moe_stage_layers(model);
    size_t values = ((size_t)header[6] << 31) | (size_t)header[7];
    if (header[1] != 1 || header[2] != c->num_experts || header[3] != Lmodel || header[4] != x->has_master ||
        header[5] != PRECISION_MODE || values != all_experts) {
        fprintf(stderr, "%s: expert state of another setup (E %d, MoE layers %d, master weights %d, precision %d, %zu "
                "values) than this run's (%d, %d, %d, %d, %zu)\n", path, header[2], header[3], header[4], header[5],
                values, c->num_experts, Lmodel, x->has_master, PRECISION_MODE, all_experts);
        exit(EXIT_FAILURE);
    }
    size_t local[MLP_EXTENSION_SLOTS], whole = 0;  // this process's experts, whole
    moe_slot_sizes(model, Lm, moe->local_experts, 1, local);
    int* model_index = (int*)malloc_check((size_t)Lmodel * sizeof(int));
    moe_stage_model_indices(model, model_index);
    for (int i = FIRST_EXPERT_SLOT; i < FIRST_EXPERT_SLOT + NUM_EXPERT_TENSORS; i++) whole += local[i];
    float* own = (float*)malloc_check(whole * sizeof(float) + 1);
    float* full = (float*)calloc(x->num_parameters_padded, sizeof(float));
    for (int buffer = 0; buffer < (x->has_master ? 3 : 2); buffer++) {
        // in the file: per tensor and MoE layer, the layer's E experts; ours are a contiguous run of them
        size_t file_offset = 1024 + (size_t)buffer * all_experts * sizeof(float), at = 0;
        for (int i = FIRST_EXPERT_SLOT; i < FIRST_EXPERT_SLOT + NUM_EXPERT_TENSORS; i++) {
            size_t run = local[i] / Lm;
            for (int m = 0; m < Lm; m++) {
                size_t position =
                    file_offset + ((size_t)model_index[m] * moe->ep.degree + moe->ep.member) * run * sizeof(float);
                if (fseek(f, (long)position, SEEK_SET) != 0) {
                    fprintf(stderr, "%s: cannot seek to byte %zu\n", path, position);
                    exit(EXIT_FAILURE);
                }
                fread_check(own + at, sizeof(float), run, f, path);
                at += run;
            }
            file_offset += local[i] / Lm * Lmodel * moe->ep.degree * sizeof(float);
        }
        moe_cut_experts(model, moe->local_experts, moe_expert_member(model), own, full, sizeof(float), 0);
        sharded_parameters_scatter_state(x, buffer, full);
    }
    long end = 1024 + (long)((x->has_master ? 3 : 2) * all_experts * sizeof(float));
    if (fseek(f, 0, SEEK_END) != 0 || ftell(f) != end) {
        fprintf(stderr, "%s: expected %ld bytes, the file has another size\n", path, end);
        exit(EXIT_FAILURE);
    }
    free(model_index);
    free(own);
    free(full);
    fclose_check(f, path);
    free(path);
}
