// llmc/checkpoint.h: the names and life cycle of the trainers' checkpoint files in an output directory:
//   model_%08d.bin        the model (rank 0)
//   state_%08d_%05d.bin   one training state per process (optimizer shard, data loader, RNG, loss scale)
//   expert_state_%08d.bin the MoE experts' optimizer state, every expert in the model file's layout (rank 0)
//   DONE_%08d             written last, once every process has written: a checkpoint without it is incomplete
// Every file is written under a temporary name and renamed (llmc/utils.h), and deletion removes the DONE
// marker first, so an interrupted write or delete never leaves a checkpoint that looks complete.
#pragma once
#include <dirent.h>
#include <limits.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "utils.h"

// Integrity: the DONE marker lists the checkpoint's step, process count, model header and, for every file, its
// size and a 64-bit checksum (checkpoint_checksum):
//   checkpoint 1 / step S / processes P / model H1 .. H12 / file NAME SIZE HASH (one line per file)
// A resumed run verifies them (train_gpt.cu) and falls back to the previous complete checkpoint if they do not
// match. An empty DONE marker is an older trainer's: its checkpoint loads unverified, with a note.

// A checkpoint file's name in dir (the caller frees it); kind: "model", "adapter" (fine-tuning's, in place of the
// model file), "expert_state", "state" (with rank >= 0) or "DONE"
static char* checkpoint_path(const char* dir, const char* kind, int step, int rank) {
    if (rank >= 0) return string_format("%s/%s_%08d_%05d.bin", dir, kind, step, rank);
    return string_format("%s/%s_%08d%s", dir, kind, step, strcmp(kind, "DONE") ? ".bin" : "");
}

static void remove_checkpoint_file(const char* dir, const char* kind, int step, int rank) {
    char* path = checkpoint_path(dir, kind, step, rank);
    remove(path);
    free(path);
}

static void delete_checkpoint(const char* dir, int step, int num_processes) {
    remove_checkpoint_file(dir, "DONE", step, -1);  // first: the checkpoint is incomplete from now on
    remove_checkpoint_file(dir, "model", step, -1);
    remove_checkpoint_file(dir, "adapter", step, -1);  // absent but when fine-tuning
    remove_checkpoint_file(dir, "expert_state", step, -1);  // absent for a dense model
    for (int r = 0; r < num_processes; r++) remove_checkpoint_file(dir, "state", step, r);
}

// The step of a checkpoint file's name (model_S.bin, adapter_S.bin, state_S_R.bin, expert_state_S.bin, DONE_S, and
// their temporaries S... .tmp), or -1 for any other name
static int checkpoint_file_step(const char* name) {
    const char* kinds[] = {"model_", "adapter_", "state_", "expert_state_", "DONE_"};
    for (size_t k = 0; k < sizeof(kinds) / sizeof(kinds[0]); k++) {
        size_t len = strlen(kinds[k]);
        int step, used = 0;
        if (strncmp(name, kinds[k], len) == 0 && sscanf(name + len, "%8d%n", &step, &used) == 1 && used == 8)
            return step;
    }
    return -1;
}

// Removes the checkpoint files of dir that belong to none of the `n` complete checkpoints in `steps`: what a crash
// left of a checkpoint being written or deleted (deletion removes the DONE marker first, so such files never look
// complete), and the temporaries of an interrupted write. Process 0, once its own checkpoint is complete.
static void remove_incomplete_checkpoint_files(const char* dir, const int* steps, int n) {
    DIR* d = opendir(dir);
    if (!d) return;
    struct dirent* e;
    while ((e = readdir(d)) != NULL) {
        int step = checkpoint_file_step(e->d_name), kept = 0;
        for (int i = 0; i < n && step >= 0; i++) kept |= steps[i] == step && strstr(e->d_name, ".tmp") == NULL;
        if (step < 0 || kept) continue;
        char* path = string_format("%s/%s", dir, e->d_name);
        remove(path);
        free(path);
    }
    closedir(d);
}

// Deletes every complete checkpoint (one with a DONE marker) of dir but the newest `keep`, and the files of none.
static void prune_checkpoints(const char* dir, int keep, int num_processes) {
    DIR* d = opendir(dir);
    if (!d) return;
    int* steps = NULL;
    int n = 0, capacity = 0;
    struct dirent* e;
    while ((e = readdir(d)) != NULL) {
        int step;
        char rest;
        if (sscanf(e->d_name, "DONE_%8d%c", &step, &rest) != 1) continue;
        if (n == capacity) {
            capacity = capacity ? 2 * capacity : 16;
            int* grown = (int*)realloc(steps, (size_t)capacity * sizeof(int));
            if (!grown) break;  // out of memory: prune what was listed
            steps = grown;
        }
        steps[n++] = step;
    }
    closedir(d);
    // the newest first (insertion sort: a handful of checkpoints)
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && steps[j] > steps[j - 1]; j--) {
            int t = steps[j];
            steps[j] = steps[j - 1];
            steps[j - 1] = t;
        }
    for (int i = keep; i < n; i++) delete_checkpoint(dir, steps[i], num_processes);
    remove_incomplete_checkpoint_files(dir, steps, n < keep ? n : keep);
    free(steps);
}

// A file's size and checksum: 64-bit words (little-endian as stored), each xored in, multiplied by an odd constant
// and folded, then the tail bytes. Returns 0 if the file cannot be read.
static int checkpoint_checksum(const char* path, uint64_t* size, uint64_t* hash) {
    FILE* f = fopen(path, "rb");
    if (f == NULL) return 0;
    size_t chunk = 1 << 20;
    unsigned char* buf = (unsigned char*)malloc(chunk);
    if (buf == NULL) {
        fclose(f);
        return 0;
    }
    uint64_t h = 0xcbf29ce484222325ull, total = 0;
    size_t got;
    while ((got = fread(buf, 1, chunk, f)) > 0) {
        size_t words = got / 8;  // every chunk but the last is a whole number of words
        for (size_t i = 0; i < words; i++) {
            uint64_t w;
            memcpy(&w, buf + 8 * i, 8);
            h = (h ^ w) * 0x9E3779B97F4A7C15ull;
            h ^= h >> 29;
        }
        for (size_t i = 8 * words; i < got; i++) h = (h ^ buf[i]) * 0x100000001b3ull;
        total += got;
    }
    int ok = !ferror(f);
    free(buf);
    fclose(f);
    *size = total;
    *hash = h;
    return ok;
}

// the latest step below `below` with a DONE marker in dir, or -1
static int find_checkpoint_before(const char* dir, int below) {
    DIR* d = opendir(dir);
    if (!d) return -1;
    int best = -1;
    struct dirent* e;
    while ((e = readdir(d)) != NULL) {
        int step;
        char rest;
        if (sscanf(e->d_name, "DONE_%8d%c", &step, &rest) == 1 && step > best && step < below) best = step;
    }
    closedir(d);
    return best;
}

// the latest step with a DONE marker in dir, or -1
static int find_latest_checkpoint(const char* dir) { return find_checkpoint_before(dir, INT_MAX); }
