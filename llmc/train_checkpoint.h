// llmc/train_checkpoint.h: the trainer's checkpoints: the training state (TrainerState), writing a checkpoint
// (collective: the model file, each process's state file, an extension's, then the DONE marker), verifying one, and
// reading a state back, also into a different number of processes (resharding). The files' names and life cycle
// are llmc/checkpoint.h's, their layouts doc/formats.md's. train_gpt.cu includes it after the model and its
// optimizer step; it needs model_write_model_file (llmc/model_file.h), the parameter sets (llmc/optimizer.cuh) and
// the data loader. Tests: train-gpt-cli and train-moe-cli (resume bit-identity, corrupted and partial checkpoints,
// resharded resumes).
#pragma once

// Checkpoints: <dir>/model_%08d.bin (rank 0), <dir>/state_%08d_%05d.bin (each rank), <dir>/DONE_%08d
// once every rank has written. Each file is written under a temporary name and renamed. A fine-tuning run (-ft) writes
// its adapter, <dir>/adapter_%08d.bin, in place of the model file (llmc/model_adapter.h): the model file is -e's.

typedef struct {
    int step;
    int good_steps;
    float loss_scale;
    unsigned long long rng_state;
    unsigned long long sample_rng_state;
    OutlierDetector loss_outlier, norm_outlier;
} TrainerState;


// Collective over all processes.
static void write_checkpoint(const char* dir, Model* model, const DataLoader* loader, const TrainerState* ts,
                             const MultiGpuConfig* mg, int zero_stage, cudaStream_t stream) {
    char* tmp;
    const char* parameters_kind = model->adapter ? "adapter" : "model";
    char* path = checkpoint_path(dir, parameters_kind, ts->step, -1);
    if (model->adapter) adapter_write_checkpoint(model, path, ts->step, mg, stream);
    else model_write_model_file(model, path, stream);
    free(path);
    // an extension's state is its own set's optimizer state, which a frozen model (fine-tuning) has none of
    const CheckpointExtension* x = model->extension.checkpoint;
    const char* extension_state = model->frozen ? NULL : x->state_file;
    if (x->write_state && extension_state) x->write_state(dir, ts->step, model, zero_stage, stream);
    path = checkpoint_path(dir, "state", ts->step, mg->process_rank);
    FILE* f = fopen_tmp_for(path, &tmp);
    int header[256] = {0};
    header[0] = STATE_FILE_MAGIC;
    header[1] = 1;
    header[2] = mg->num_processes;
    header[3] = mg->process_rank;
    header[4] = model->store.has_master;
    header[5] = ts->step;
    header[6] = PRECISION_MODE;
    header[7] = (int)sizeof(TrainerState);
    header[8] = (int)(model->store.shard_size >> 31);
    header[9] = (int)(model->store.shard_size & 0x7fffffff);
    size_t loader_bytes = dataloader_state_bytes(loader);
    header[10] = (int)loader_bytes;
    // the tensor-parallel degree of the state's slices, with -tp 2 or more (0: layers whole, -tp 1)
    header[11] = model_tp_degree(model) > 1 ? model_tp_degree(model) : 0;
    // the pipeline's stages, chunks per stage and each model chunk's first layer, with -pp 2 or more (0: one stage)
    StageCut cut = model_stage_cut(model);
    header[12] = cut.stages > 1 ? cut.stages : 0;
    header[13] = cut.stages > 1 ? cut.chunks : 0;
    for (int j = 1; cut.stages > 1 && j < cut.stages * cut.chunks; j++) header[13 + j] = cut.first_layer[j];
    fwrite_check(header, sizeof(int), 256, f, tmp);
    sharded_parameters_write_state(&model->store, f, tmp);
    void* lstate = malloc_check(loader_bytes);
    dataloader_save_state(loader, lstate);
    fwrite_check(lstate, 1, loader_bytes, f, tmp);
    free(lstate);
    fwrite_check(ts, sizeof(TrainerState), 1, f, tmp);
    commit_tmp(f, tmp, path);
    free(tmp);
    // every process checksums its own state file (in parallel, from the page cache); process 0 gathers them, which
    // is also the barrier before the DONE marker
    uint64_t mine[2], *all = (uint64_t*)malloc_check(2 * (size_t)mg->num_processes * sizeof(uint64_t));
    if (!checkpoint_checksum(path, &mine[0], &mine[1])) {
        fprintf(stderr, "%s: cannot read back the file just written\n", path);
        exit(EXIT_FAILURE);
    }
    uint64_t* device;
    cudaCheck(cudaMalloc((void**)&device, 2 * (size_t)(mg->num_processes + 1) * sizeof(uint64_t)));
    cudaCheck(cudaMemcpy(device, mine, sizeof(mine), cudaMemcpyHostToDevice));
    ncclCheck(ncclAllGather(device, device + 2, 2, ncclUint64, mg->nccl_comm, mg->nccl_stream));
    cudaCheck(cudaStreamSynchronize(mg->nccl_stream));
    cudaCheck(cudaMemcpy(all, device + 2, 2 * (size_t)mg->num_processes * sizeof(uint64_t), cudaMemcpyDeviceToHost));
    cudaCheck(cudaFree(device));
    free(path);
    if (mg->process_rank == 0) {
        path = checkpoint_path(dir, "DONE", ts->step, -1);
        FILE* d = fopen_tmp_for(path, &tmp);
        int header[256];
        model_file_header(model, header);
        fprintf(d, "checkpoint 1\nstep %d\nprocesses %d\nmodel", ts->step, mg->num_processes);
        for (int i = 1; i <= 12; i++) fprintf(d, " %d", header[i]);
        fprintf(d, "\n");
        const char* kinds[2] = {parameters_kind, extension_state};
        for (int k = 0; k < 2 && kinds[k]; k++) {
            uint64_t size, hash;
            char* file = checkpoint_path(dir, kinds[k], ts->step, -1);
            if (!checkpoint_checksum(file, &size, &hash)) {
                fprintf(stderr, "%s: cannot read back the file just written\n", file);
                exit(EXIT_FAILURE);
            }
            fprintf(d, "file %s %llu %016llx\n", strrchr(file, '/') + 1, (unsigned long long)size,
                    (unsigned long long)hash);
            free(file);
        }
        for (int r = 0; r < mg->num_processes; r++) {
            char* file = checkpoint_path(dir, "state", ts->step, r);
            fprintf(d, "file %s %llu %016llx\n", strrchr(file, '/') + 1, (unsigned long long)all[2 * r],
                    (unsigned long long)all[2 * r + 1]);
            free(file);
        }
        commit_tmp(d, tmp, path);
        free(tmp);
        free(path);
    }
    free(all);
}

// Whether the checkpoint of `step` in dir is sound for this process: its DONE marker's step and model header agree
// with the files, and the checksums of the model, an extension's state file and this process's state match (all the
// states, when the checkpoint was written by another number of processes: read_checkpoint_state reads them all).
// An empty DONE marker (an older trainer's) has no checksums: only the step and process count of the state and
// the model header's readability are checked, and *legacy is set. On failure *why (the caller frees it) says what,
// naming the file.
static int verify_checkpoint(const char* dir, int step, int rank, int num_processes, int* legacy, char** why) {
    char* done = checkpoint_path(dir, "DONE", step, -1);
    *legacy = 0;
    *why = NULL;
    FILE* f = fopen(done, "r");
    if (f == NULL) {
        *why = string_format("%s: cannot open", done);
        free(done);
        return 0;
    }
    char line[2048];
    int version = -1, done_step = -1, processes = -1, have_model = 0, model_header[13] = {0}, lines = 0;
    // the files the DONE lists, checked as they come; this process's state must be among them
    int checked_state = 0, adapter = 0;
    while (*why == NULL && fgets(line, sizeof(line), f) != NULL) {
        lines++;
        char name[1024];
        unsigned long long size, hash;
        if (sscanf(line, "checkpoint %d", &version) == 1) continue;
        if (sscanf(line, "step %d", &done_step) == 1) continue;
        if (sscanf(line, "processes %d", &processes) == 1) continue;
        if (strncmp(line, "model ", 6) == 0) {
            char* at = line + 6;
            have_model = 1;
            for (int i = 1; i <= 12; i++) model_header[i] = (int)strtol(at, &at, 10);
            continue;
        }
        if (sscanf(line, "file %1023s %llu %llx", name, &size, &hash) == 3) {
            int r, s2;
            char rest;
            int is_state = sscanf(name, "state_%8d_%5d.bin%c", &s2, &r, &rest) == 2;
            adapter |= strncmp(name, "adapter_", 8) == 0;
            if (is_state && r != rank && processes == num_processes) continue;  // every process checks its own
            char* path = string_format("%s/%s", dir, name);
            uint64_t got_size, got_hash;
            if (!checkpoint_checksum(path, &got_size, &got_hash))
                *why = string_format("%s: cannot read it", path);
            else if (got_size != size || got_hash != hash)
                *why = string_format("%s: %llu bytes, checksum %016llx; %s lists %llu bytes, checksum %016llx", path,
                                     (unsigned long long)got_size, (unsigned long long)got_hash, done, size, hash);
            free(path);
            checked_state |= is_state;
            continue;
        }
        *why = string_format("%s: unexpected line '%.60s'", done, line);
    }
    fclose(f);
    if (*why == NULL && lines == 0) {
        *legacy = 1;
    } else if (*why == NULL &&
               (version != 1 || done_step != step || processes < 1 || !have_model || !checked_state)) {
        *why = string_format("%s: says checkpoint %d, step %d, %d processes%s; expected version 1, step %d and the "
                             "states", done, version, done_step, processes, have_model ? "" : ", no model header",
                             step);
    }
    // an older trainer's checkpoint resumes only on its own process count
    int saved_processes = *legacy ? num_processes : processes;
    // the files' own headers: the model's configuration as the DONE lists it, the state's step and process count
    // (a fine-tuning checkpoint has no model file: its adapter names the model it was trained on by its checksum)
    int header[256];
    char* path = checkpoint_path(dir, "model", step, -1);
    FILE* m = *why == NULL && !adapter ? fopen(path, "rb") : NULL;
    if (*why == NULL && !adapter && (m == NULL || fread(header, sizeof(int), 256, m) != 256))
        *why = string_format("%s: cannot read its header", path);
    if (m) fclose(m);
    for (int i = 1; i <= 12 && !*legacy && !adapter && *why == NULL; i++)
        if (header[i] != model_header[i])
            *why = string_format("%s: header[%d] = %d, but %s says %d", path, i, header[i], done, model_header[i]);
    free(path);
    path = checkpoint_path(dir, "state", step, saved_processes == num_processes ? rank : 0);
    FILE* st = *why == NULL ? fopen(path, "rb") : NULL;
    if (*why == NULL && (st == NULL || fread(header, sizeof(int), 256, st) != 256))
        *why = string_format("%s: cannot read its header", path);
    if (st) fclose(st);
    if (*why == NULL && (header[0] != STATE_FILE_MAGIC || header[5] != step || header[2] != saved_processes))
        *why = string_format("%s: a state of step %d for %d processes (magic %d), not of step %d for %d", path,
                             header[5], header[2], header[0], step, saved_processes);
    free(path);
    free(done);
    return *why == NULL;
}



// The optimizer state of the replicated set from a checkpoint written by `saved_processes` processes with shards of
// `saved_shard` values (the whole padded set at ZeRO-0), at another stage or process count: each buffer (m, v, master)
// put together whole from the state files, then this process's shard of it. The parameters past the real ones are
// padding, zero in every layout.
static void read_resharded_state(const char* dir, int step, Model* model, int saved_processes, size_t saved_shard) {
    ShardedParameters* p = &model->store;
    size_t n = p->num_parameters, saved_files = saved_shard >= n ? 1 : (size_t)saved_processes;
    float* full = (float*)malloc_check(p->num_parameters_padded * sizeof(float));
    for (int buffer = 0; buffer < (p->has_master ? 3 : 2); buffer++) {
        memset(full, 0, p->num_parameters_padded * sizeof(float));
        for (size_t r = 0; r < saved_files; r++) {
            char* path = checkpoint_path(dir, "state", step, (int)r);
            FILE* f = fopen_check(path, "rb");
            fseek_check(f, 256 * sizeof(int) + buffer * saved_shard * sizeof(float), path);
            size_t begin = r * saved_shard, count = begin < n ? (n - begin < saved_shard ? n - begin : saved_shard) : 0;
            fread_check(full + begin, sizeof(float), count, f, path);
            fclose_check(f, path);
            free(path);
        }
        sharded_parameters_scatter_state(p, buffer, full);
    }
    free(full);
}

// The same from a checkpoint written in another tensor-parallel or pipeline layout: `saved_processes` processes at
// degree `saved_tp` over the stages of `saved` (file (stage * D + d) * saved_tp + m holds member m's shard d of that
// stage's set, D the data-parallel processes per stage; each file's header gives its shard size, which differs between
// stages). Per buffer: each saved member's set of each stage put together from its shards, its slices of the stage's
// blocks put into the whole tensors in model-file order (the cuts of model_tensor_split and stage_split_of, the same at
// every layout), and this process's member's slices of its stage's blocks cut out of those, of which it keeps its shard.
static void read_resliced_state(const char* dir, int step, Model* model, int saved_processes, int saved_tp,
                                const StageCut* saved) {
    ShardedParameters* p = &model->store;
    size_t in_file[NUM_PARAMETER_TENSORS], in_set[NUM_PARAMETER_TENSORS], at[NUM_PARAMETER_TENSORS], whole_n = 0;
    fill_in_parameter_sizes(model, in_file, in_set);
    for (int i = 0; i < NUM_PARAMETER_TENSORS; i++) at[i] = whole_n, whole_n += in_file[i];
    int D = saved_processes / (saved->stages * saved_tp);
    float* whole = (float*)malloc_check(whole_n * sizeof(float));
    float* mine = (float*)malloc_check(p->num_parameters_padded * sizeof(float));
    for (int buffer = 0; buffer < (p->has_master ? 3 : 2); buffer++) {
        for (int st = 0; st < saved->stages; st++) {
            size_t set_n = 0;  // a member's set of this stage
            for (int i = 0; i < NUM_PARAMETER_TENSORS; i++) {
                for (int c = 0; c < saved->chunks; c++) {
                    size_t offset;
                    TensorSplit t = stage_split_of(model, saved, i, st, c, in_file, &offset);
                    set_n += tensor_split_slice_size(&t, saved_tp);
                }
            }
            for (int m = 0; m < saved_tp; m++) {
                float* member_set = NULL;
                size_t files = 0, shard = 0;
                for (size_t d = 0; d == 0 || d < files; d++) {
                    char* path = checkpoint_path(dir, "state", step, (int)((st * D + d) * saved_tp + m));
                    FILE* f = fopen_check(path, "rb");
                    int header[256];
                    read_header_check(f, header, path, STATE_FILE_MAGIC, "GPT-2 training state");
                    size_t file_shard = ((size_t)header[8] << 31) | (size_t)header[9];
                    if (d == 0) {  // a whole set (ZeRO-0) is in one file
                        shard = file_shard, files = shard >= set_n ? 1 : (size_t)D;
                        if (files * shard < set_n) {
                            fprintf(stderr, "%s: optimizer shards of %zu values on %d processes do not hold stage %d's "
                                    "%zu parameters per member\n", path, shard, D, st, set_n);
                            exit(EXIT_FAILURE);
                        }
                        member_set = (float*)malloc_check((files * shard > set_n ? files * shard : set_n) *
                                                          sizeof(float));
                    }
                    fseek_check(f, 256 * sizeof(int) + buffer * file_shard * sizeof(float), path);
                    size_t begin = d * shard, count = begin < set_n ? (set_n - begin < shard ? set_n - begin : shard) : 0;
                    fread_check(member_set + begin, sizeof(float), count, f, path);
                    fclose_check(f, path);
                    free(path);
                }
                size_t from = 0;
                for (int i = 0; i < NUM_PARAMETER_TENSORS; i++) {
                    for (int c = 0; c < saved->chunks; c++) {
                        size_t offset;
                        TensorSplit t = stage_split_of(model, saved, i, st, c, in_file, &offset);
                        tensor_split_copy(&t, m, saved_tp, whole + at[i] + offset, member_set + from, sizeof(float), 1);
                        from += tensor_split_slice_size(&t, saved_tp);
                    }
                }
                free(member_set);
            }
        }
        memset(mine, 0, p->num_parameters_padded * sizeof(float));  // the padding past the parameters is zero
        size_t from = 0;
        for (int i = 0; i < NUM_PARAMETER_TENSORS; i++) {
            for (int c = 0; c < model_pp_chunks(model); c++) {
                size_t offset;
                TensorSplit t = model_stage_split(model, i, model_pp_stage(model), c, in_file, &offset);
                tensor_split_copy(&t, model_tp_member(model), model_tp_degree(model), whole + at[i] + offset,
                                  mine + from, sizeof(float), 0);
                from += tensor_split_slice_size(&t, model_tp_degree(model));
            }
        }
        sharded_parameters_scatter_state(p, buffer, mine);
    }
    free(whole);
    free(mine);
}

static void read_checkpoint_state(const char* dir, int step, Model* model, DataLoader* loader, TrainerState* ts,
                                  const MultiGpuConfig* mg) {
    char* path = checkpoint_path(dir, "state", step, mg->process_rank);
    FILE* f = fopen(path, "rb");
    if (f == NULL) {  // written by fewer processes: rank 0's file has the state that all of them share
        free(path);
        path = checkpoint_path(dir, "state", step, 0);
        f = fopen_check(path, "rb");
    }
    int header[256];
    read_header_check(f, header, path, STATE_FILE_MAGIC, "GPT-2 training state");
    size_t shard_size = ((size_t)header[8] << 31) | (size_t)header[9];
    if (header[1] != 1 || header[2] < 1 || header[4] != model->store.has_master || header[6] != PRECISION_MODE ||
        header[7] != (int)sizeof(TrainerState)) {
        fprintf(stderr, "%s: state written by a different run setup (master weights %d, precision %d) than this one (%d, "
                "%d)\n", path, header[4], header[6], model->store.has_master, PRECISION_MODE);
        exit(EXIT_FAILURE);
    }
    int saved_processes = header[2], saved_tp = header[11] > 0 ? header[11] : 1, tp = model_tp_degree(model);
    // the pipeline's cut the state was written at (one stage: every layer)
    StageCut saved_cut, cut = model_stage_cut(model);
    saved_cut.stages = header[12] > 0 ? header[12] : 1;
    saved_cut.chunks = header[12] > 0 ? header[13] : 1;
    int L = model->config.num_layers, n = saved_cut.stages * saved_cut.chunks;
    if (saved_cut.chunks < 1 || n > PIPELINE_MAX_STAGES || n > L ||
        saved_processes % (saved_cut.stages * saved_tp) != 0) {
        fprintf(stderr, "%s: a state of %d processes at -pp %d -ppv %d -tp %d is no layout of this model's %d layers\n",
                path, saved_processes, saved_cut.stages, saved_cut.chunks, saved_tp, L);
        exit(EXIT_FAILURE);
    }
    int same_cut = saved_cut.stages == cut.stages && saved_cut.chunks == cut.chunks;
    saved_cut.first_layer[0] = 0, saved_cut.first_layer[n] = L;
    for (int j = 1; j < n; j++) {
        saved_cut.first_layer[j] = header[13 + j];
        if (saved_cut.first_layer[j] <= saved_cut.first_layer[j - 1] || saved_cut.first_layer[j] >= L) {
            fprintf(stderr, "%s: chunk %d begins at layer %d: no cut of %d layers\n", path, j, header[13 + j], L);
            exit(EXIT_FAILURE);
        }
        same_cut = same_cut && saved_cut.first_layer[j] == cut.first_layer[j];
    }
    // a frozen set has no optimizer state (a fine-tuning run's is in its adapter file, whole: any layout reads it)
    if (model->store.frozen && shard_size != 0) {
        fprintf(stderr, "%s: a state with the model's optimizer state; this run fine-tunes (-ft), which keeps none\n",
                path);
        exit(EXIT_FAILURE);
    }
    if (model->store.frozen ||
        (saved_tp == tp && same_cut && saved_processes == mg->num_processes && header[3] == mg->process_rank &&
         shard_size == model->store.shard_size)) {
        sharded_parameters_read_state(&model->store, f, path);
    } else if (saved_tp > 1 || tp > 1 || saved_cut.stages > 1 || model_pp_stages(model) > 1) {
        // another tensor-parallel or pipeline layout: the slices, the stages' blocks and the shards are cut anew
        if (shard_size == 0) {
            fprintf(stderr, "%s: a state of %d processes at -pp %d -tp %d with shards of 0 values is no layout\n", path,
                    saved_processes, saved_cut.stages, saved_tp);
            exit(EXIT_FAILURE);
        }
        read_resliced_state(dir, step, model, saved_processes, saved_tp, &saved_cut);
        fseek_check(f, 256 * sizeof(int) + (model->store.has_master ? 3 : 2) * shard_size * sizeof(float), path);
    } else {  // another ZeRO stage or process count: the shards are cut anew
        if (shard_size * (size_t)saved_processes < model->store.num_parameters) {
            fprintf(stderr, "%s: optimizer shards of %zu values on %d processes do not hold this model's %zu parameters\n",
                    path, shard_size, saved_processes, model->store.num_parameters);
            exit(EXIT_FAILURE);
        }
        read_resharded_state(dir, step, model, saved_processes, shard_size);
        fseek_check(f, 256 * sizeof(int) + (model->store.has_master ? 3 : 2) * shard_size * sizeof(float), path);
    }
    size_t loader_bytes = (size_t)header[10];
    if (loader_bytes != dataloader_state_bytes(loader)) {
        fprintf(stderr, "%s: data loader state of %zu bytes does not fit this data loader (%zu bytes)\n", path,
                loader_bytes, dataloader_state_bytes(loader));
        exit(EXIT_FAILURE);
    }
    void* lstate = malloc_check(loader_bytes);
    fread_check(lstate, 1, loader_bytes, f, path);
    dataloader_load_state(loader, lstate);
    free(lstate);
    fread_check(ts, sizeof(TrainerState), 1, f, path);
    if (fgetc(f) != EOF) {
        fprintf(stderr, "%s: file is longer than a training state\n", path);
        exit(EXIT_FAILURE);
    }
    fclose_check(f, path);
    free(path);
    if (model->extension.checkpoint->read_state && !model->frozen)
        model->extension.checkpoint->read_state(dir, step, model);
}
