// llmc/dataloader.h: reads token batches from data shards for training and validation (flags -i, -j).
// A shard is a 256-int32 header [0]=20240520, [1]=1 (uint16 tokens) or 2 (uint32 tokens), [2]=ntok,
// followed by the ntok tokens. The shards are the files matching a glob pattern, in sorted order.
//
// Layout of a shard as batches: a row is T+1 consecutive tokens starting at a multiple of T (inputs are
// the first T, targets the last T), so a shard has floor((ntok-1)/T) rows. One global batch is
// num_processes*B rows, rank r's part being rows r*B .. r*B+B-1 of it; a shard gives
// floor((ntok-1)/(num_processes*B*T)) global batches and the rest of its tokens are not used. Without
// shuffling, the k-th batch of rank r starts at token (k*num_processes + r)*B*T of the shard: the ranks
// read consecutive stretches. With shuffling, every epoch visits the shards in a new order and every shard
// visit takes its rows in a new order (a permutation of all the shard's rows, of which the first
// batches*num_processes*B are used), both drawn from the seed, the epoch and the position in the epoch
// only: every rank computes the same permutations and so reads its own disjoint part of the same global
// batches, and a loader restored from a saved state continues bit for bit, also on another number of processes
// with the same global batch (processes x B).
// After the last batch of the last shard the loader wraps around to the first shard of the next epoch.
//
// Loss masks: a shard PATH may have a mask shard PATH.mask, a 256-int32 header [0]=20261206, [1]=1, [2]=ntok (the
// shard's), then one byte per token: 1 when the token counts as a target (the loss predicts it), 0 when it does not
// (an instruction's prompt). Every shard of a pattern has one, or none does. A masked target is -1 in `targets`.
//
// Header-only: #include it from a .cu (built by nvcc or cpu/cucc). Tested by dev/test/test_host_utils.cu.
#pragma once
#include <glob.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "rand.h"
#include "utils.h"

#define DATA_SHARD_MAGIC 20240520
#define DATA_MASK_MAGIC 20261206
#define DATA_MASK_VERSION 1
#define DATALOADER_STATE_MAGIC 20260101ull
#define DATALOADER_STATE_WORDS 12

typedef struct {
    size_t B;
    size_t T;
    int process_rank;
    int num_processes;
    int should_shuffle;
    unsigned long long seed;
    int vocab_size;  // tokens must be below it (dataloader_set_vocab_size); 0: not checked
    // the shards, validated at init
    int num_shards;
    char** shard_paths;
    size_t* shard_ntok;
    int* shard_token_bytes;    // 2 or 4
    size_t* shard_num_batches;  // global batches of num_processes*B*T tokens
    size_t num_tokens;
    uint64_t shards_fingerprint;  // of every shard's size and token width, to recognise a saved state's data
    // position of the next batch: shard shard_order[shard_position] of epoch `epoch`, its batch batch_index
    size_t epoch;
    int shard_position;
    size_t batch_index;
    int* shard_order;  // this epoch's order of the shards
    int* row_order;    // this shard visit's order of the rows (shuffling only)
    int open_shard;    // the shard `file` and row_order belong to, -1 for none
    FILE* file;
    unsigned char* row_buffer;  // T+1 tokens of the widest type
    int has_masks;     // every shard has a mask shard (PATH.mask)
    FILE* mask_file;   // the open shard's mask shard
    char* mask_path;   // its path
    unsigned char* mask_buffer;  // T+1 flags
    // the batch, B*T each
    int* inputs;
    int* targets;
} DataLoader;

// A seed for one permutation, from the loader's seed, the epoch and which permutation of that epoch
// (0: the shard order, 1+p: the rows of the shard at position p), mixed with splitmix64's finaliser so
// that neighbouring epochs and positions give unrelated streams.
static inline uint32_t dataloader_permutation_seed(unsigned long long seed, size_t epoch, size_t stream) {
    uint64_t x = (uint64_t)seed ^ ((uint64_t)epoch * 0x9E3779B97F4A7C15ull) ^ ((uint64_t)stream * 0xD1B54A32D192ED03ull);
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBull;
    x ^= x >> 31;
    return (uint32_t)(x >> 32);
}

// Fisher-Yates shuffle of 0..n-1 with the Mersenne Twister
static inline void dataloader_random_permutation(int* out, int n, uint32_t seed) {
    mt19937_state rng;
    manual_seed(&rng, seed);
    for (int i = 0; i < n; i++) out[i] = i;
    for (int i = n - 1; i > 0; i--) {
        int j = (int)(randint32(&rng) % (uint32_t)(i + 1));
        int tmp = out[i];
        out[i] = out[j];
        out[j] = tmp;
    }
}

// Validates one shard and records its size; keeps nothing open.
static inline void dataloader_check_shard(DataLoader* loader, int s) {
    const char* path = loader->shard_paths[s];
    FILE* f = fopen_check(path, "rb");
    int header[256];
    read_header_check(f, header, path, DATA_SHARD_MAGIC, "data shard");
    if (header[1] != 1 && header[1] != 2) {
        fprintf(stderr, "%s: unsupported data shard version %d (expected 1 for uint16 or 2 for uint32 tokens)\n", path,
                header[1]);
        exit(EXIT_FAILURE);
    }
    if (header[2] <= 0) {
        fprintf(stderr, "%s: header says %d tokens (expected a positive count)\n", path, header[2]);
        exit(EXIT_FAILURE);
    }
    size_t ntok = (size_t)header[2];
    int token_bytes = header[1] == 1 ? 2 : 4;
    size_t expected_bytes = 256 * sizeof(int) + ntok * token_bytes;
    if (fseek(f, 0, SEEK_END) != 0) {
        fprintf(stderr, "%s: cannot seek to the end to check its size\n", path);
        exit(EXIT_FAILURE);
    }
    size_t file_bytes = (size_t)ftell(f);
    fclose_check(f, path);
    if (file_bytes < expected_bytes) {
        fprintf(stderr, "%s is truncated: its header says %zu tokens (%zu bytes with the header), the file has %zu bytes\n",
                path, ntok, expected_bytes, file_bytes);
        exit(EXIT_FAILURE);
    }
    if (file_bytes > expected_bytes) {
        fprintf(stderr, "%s: %zu bytes, more than its header's %zu tokens account for (%zu bytes with the header)\n",
                path, file_bytes, ntok, expected_bytes);
        exit(EXIT_FAILURE);
    }
    size_t global_batch_tokens = (size_t)loader->num_processes * loader->B * loader->T;
    if (ntok < global_batch_tokens + 1) {
        fprintf(stderr, "%s: %zu tokens, too few for one batch (expected at least %d processes x B %zu x T %zu + 1 = %zu)\n",
                path, ntok, loader->num_processes, loader->B, loader->T, global_batch_tokens + 1);
        exit(EXIT_FAILURE);
    }
    loader->shard_ntok[s] = ntok;
    loader->shard_token_bytes[s] = token_bytes;
    loader->shard_num_batches[s] = (ntok - 1) / global_batch_tokens;
}

static inline char* dataloader_mask_path(const DataLoader* loader, int s) {
    return string_format("%s.mask", loader->shard_paths[s]);
}

// Whether the shards have mask shards: all or none (refused otherwise); each one validated against its shard.
static inline int dataloader_check_masks(const DataLoader* loader) {
    int found = 0, missing = -1, present = -1;
    for (int s = 0; s < loader->num_shards; s++) {
        char* path = dataloader_mask_path(loader, s);
        if (access(path, F_OK) == 0) {
            found++;
            present = s;
        } else {
            missing = s;
        }
        free(path);
    }
    if (found > 0 && found < loader->num_shards) {
        fprintf(stderr, "%s.mask: a loss mask, but %s has none (the shards of a pattern all have one, or none does)\n",
                loader->shard_paths[present], loader->shard_paths[missing]);
        exit(EXIT_FAILURE);
    }
    for (int s = 0; s < found; s++) {
        char* path = dataloader_mask_path(loader, s);
        FILE* f = fopen_check(path, "rb");
        int header[256];
        read_versioned_header_check(f, header, path, DATA_MASK_MAGIC, DATA_MASK_VERSION, "loss mask");
        size_t expected_bytes = 256 * sizeof(int) + loader->shard_ntok[s];
        if (fseek(f, 0, SEEK_END) != 0) {
            fprintf(stderr, "%s: cannot seek to the end to check its size\n", path);
            exit(EXIT_FAILURE);
        }
        size_t file_bytes = (size_t)ftell(f);
        fclose_check(f, path);
        if (header[2] < 0 || (size_t)header[2] != loader->shard_ntok[s] || file_bytes != expected_bytes) {
            fprintf(stderr, "%s: a mask of %d tokens in %zu bytes; expected one flag per token of %s, %zu tokens "
                    "(%zu bytes with the header)\n", path, header[2], file_bytes, loader->shard_paths[s],
                    loader->shard_ntok[s], expected_bytes);
            exit(EXIT_FAILURE);
        }
        free(path);
    }
    return found > 0;
}

// Makes shard_order, file and row_order match (epoch, shard_position).
static inline void dataloader_enter_position(DataLoader* loader, int epoch_changed) {
    if (epoch_changed) {
        if (loader->should_shuffle) {
            dataloader_random_permutation(loader->shard_order, loader->num_shards,
                                          dataloader_permutation_seed(loader->seed, loader->epoch, 0));
        } else {
            for (int s = 0; s < loader->num_shards; s++) loader->shard_order[s] = s;
        }
    }
    int shard = loader->shard_order[loader->shard_position];
    if (shard != loader->open_shard) {
        if (loader->file != NULL) fclose_check(loader->file, loader->shard_paths[loader->open_shard]);
        loader->file = fopen_check(loader->shard_paths[shard], "rb");
        if (loader->has_masks) {
            if (loader->mask_file != NULL) fclose(loader->mask_file);
            free(loader->mask_path);
            loader->mask_path = dataloader_mask_path(loader, shard);
            loader->mask_file = fopen_check(loader->mask_path, "rb");
        }
        loader->open_shard = shard;
    }
    if (loader->should_shuffle) {
        // with one shard the row order still changes every epoch, so the cached shard id alone is not enough
        int rows = (int)((loader->shard_ntok[shard] - 1) / loader->T);
        free(loader->row_order);
        loader->row_order = (int*)malloc_check((size_t)rows * sizeof(int));
        dataloader_random_permutation(loader->row_order, rows,
                                      dataloader_permutation_seed(loader->seed, loader->epoch,
                                                                  1 + (size_t)loader->shard_position));
    }
}

static inline uint64_t dataloader_fingerprint(const DataLoader* loader) {
    uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a
    for (int s = 0; s < loader->num_shards; s++) {
        uint64_t words[2] = {(uint64_t)loader->shard_ntok[s], (uint64_t)loader->shard_token_bytes[s]};
        const unsigned char* bytes = (const unsigned char*)words;
        for (size_t i = 0; i < sizeof(words); i++) h = (h ^ bytes[i]) * 0x100000001b3ull;
    }
    return h;
}

static inline void dataloader_init(DataLoader* loader, const char* filename_pattern, size_t B, size_t T,
                                   int process_rank, int num_processes, int should_shuffle, unsigned long long seed) {
    if (B < 1 || T < 1) {
        fprintf(stderr, "data loader for %s: B %zu and T %zu must be at least 1\n", filename_pattern, B, T);
        exit(EXIT_FAILURE);
    }
    if (num_processes < 1 || process_rank < 0 || process_rank >= num_processes) {
        fprintf(stderr, "data loader for %s: process rank %d out of range for %d processes\n", filename_pattern,
                process_rank, num_processes);
        exit(EXIT_FAILURE);
    }
    loader->B = B;
    loader->T = T;
    loader->process_rank = process_rank;
    loader->num_processes = num_processes;
    loader->should_shuffle = should_shuffle;
    loader->seed = seed;
    loader->vocab_size = 0;

    glob_t matches;
    int glob_status = glob(filename_pattern, 0, NULL, &matches);
    if (glob_status == GLOB_NOMATCH) {
        fprintf(stderr, "no files match %s\n", filename_pattern);
        exit(EXIT_FAILURE);
    }
    if (glob_status != 0) {
        fprintf(stderr, "%s: cannot list the matching files (glob error %d)\n", filename_pattern, glob_status);
        exit(EXIT_FAILURE);
    }
    loader->num_shards = (int)matches.gl_pathc;
    loader->shard_paths = (char**)malloc_check(matches.gl_pathc * sizeof(char*));
    for (size_t s = 0; s < matches.gl_pathc; s++) {
        size_t len = strlen(matches.gl_pathv[s]);
        loader->shard_paths[s] = (char*)malloc_check(len + 1);
        memcpy(loader->shard_paths[s], matches.gl_pathv[s], len + 1);
    }
    globfree(&matches);

    loader->shard_ntok = (size_t*)malloc_check(loader->num_shards * sizeof(size_t));
    loader->shard_token_bytes = (int*)malloc_check(loader->num_shards * sizeof(int));
    loader->shard_num_batches = (size_t*)malloc_check(loader->num_shards * sizeof(size_t));
    loader->num_tokens = 0;
    for (int s = 0; s < loader->num_shards; s++) {
        dataloader_check_shard(loader, s);
        loader->num_tokens += loader->shard_ntok[s];
    }
    loader->shards_fingerprint = dataloader_fingerprint(loader);
    loader->has_masks = dataloader_check_masks(loader);
    loader->mask_file = NULL;
    loader->mask_path = NULL;
    loader->mask_buffer = (unsigned char*)malloc_check(T + 1);

    loader->shard_order = (int*)malloc_check(loader->num_shards * sizeof(int));
    loader->row_order = NULL;
    loader->open_shard = -1;
    loader->file = NULL;
    loader->row_buffer = (unsigned char*)malloc_check((T + 1) * sizeof(uint32_t));
    loader->inputs = (int*)malloc_check(B * T * sizeof(int));
    loader->targets = (int*)malloc_check(B * T * sizeof(int));
    loader->epoch = 0;
    loader->shard_position = 0;
    loader->batch_index = 0;
    dataloader_enter_position(loader, 1);
}

// The model's vocabulary size V: from now on every batch is checked for tokens >= V.
static inline void dataloader_set_vocab_size(DataLoader* loader, int vocab_size) {
    loader->vocab_size = vocab_size;
}

static inline void dataloader_reset(DataLoader* loader) {
    loader->epoch = 0;
    loader->shard_position = 0;
    loader->batch_index = 0;
    dataloader_enter_position(loader, 1);
}

// Reads row `row` (T+1 tokens from token row*T) of the open shard into inputs/targets at batch row b.
static inline void dataloader_read_row(DataLoader* loader, size_t row, size_t b) {
    const int shard = loader->open_shard;
    const char* path = loader->shard_paths[shard];
    const size_t T = loader->T;
    const int token_bytes = loader->shard_token_bytes[shard];
    long offset = (long)(256 * sizeof(int) + row * T * token_bytes);
    if (fseek(loader->file, offset, SEEK_SET) != 0) {
        fprintf(stderr, "%s: cannot seek to offset %ld\n", path, offset);
        exit(EXIT_FAILURE);
    }
    fread_check(loader->row_buffer, token_bytes, T + 1, loader->file, path);
    int* inputs = loader->inputs + b * T;
    int* targets = loader->targets + b * T;
    for (size_t i = 0; i <= T; i++) {
        int token;
        if (token_bytes == 2) {
            uint16_t value;
            memcpy(&value, loader->row_buffer + 2 * i, 2);
            token = value;
        } else {
            uint32_t value;
            memcpy(&value, loader->row_buffer + 4 * i, 4);
            if (value > (uint32_t)INT32_MAX) {
                fprintf(stderr, "%s: token %u at position %zu is not a token id (expected at most %d)\n", path, value,
                        row * T + i, INT32_MAX);
                exit(EXIT_FAILURE);
            }
            token = (int)value;
        }
        // a token the model has no embedding row for would read (and its gradient write) outside wte: every
        // row read is checked, since shards are read lazily and a bad token may sit anywhere
        if (loader->vocab_size > 0 && token >= loader->vocab_size) {
            fprintf(stderr, "%s: token %d at position %zu is out of range for the model's vocabulary (expected 0 to "
                    "%d, V = %d)\n", path, token, row * T + i, loader->vocab_size - 1, loader->vocab_size);
            exit(EXIT_FAILURE);
        }
        if (i < T) inputs[i] = token;
        if (i > 0) targets[i - 1] = token;
    }
    if (!loader->has_masks) return;
    const char* mask_path = loader->mask_path;
    offset = (long)(256 * sizeof(int) + row * T);
    if (fseek(loader->mask_file, offset, SEEK_SET) != 0) {
        fprintf(stderr, "%s: cannot seek to offset %ld\n", mask_path, offset);
        exit(EXIT_FAILURE);
    }
    fread_check(loader->mask_buffer, 1, T + 1, loader->mask_file, mask_path);
    for (size_t i = 1; i <= T; i++) {
        if (loader->mask_buffer[i] > 1) {
            fprintf(stderr, "%s: flag %d at position %zu (expected 0 or 1)\n", mask_path, loader->mask_buffer[i],
                    row * T + i);
            exit(EXIT_FAILURE);
        }
        if (loader->mask_buffer[i] == 0) targets[i - 1] = -1;
    }
}

static inline void dataloader_next_batch(DataLoader* loader) {
    if (loader->batch_index >= loader->shard_num_batches[loader->shard_order[loader->shard_position]]) {
        loader->batch_index = 0;
        loader->shard_position++;
        int new_epoch = loader->shard_position == loader->num_shards;
        if (new_epoch) {
            loader->shard_position = 0;
            loader->epoch++;
        }
        dataloader_enter_position(loader, new_epoch);
    }
    const size_t B = loader->B;
    const size_t first_row = (loader->batch_index * loader->num_processes + loader->process_rank) * B;
    for (size_t b = 0; b < B; b++) {
        size_t row = loader->should_shuffle ? (size_t)loader->row_order[first_row + b] : first_row + b;
        dataloader_read_row(loader, row, b);
    }
    loader->batch_index++;
}

// The targets that count (not masked) in this process's next `batches` batches, the position left as it was: what a
// training step's loss is averaged over, counted before its first micro-batch.
static inline size_t dataloader_count_targets_ahead(DataLoader* loader, int batches) {
    size_t epoch = loader->epoch, batch_index = loader->batch_index;
    int shard_position = loader->shard_position;
    size_t count = 0;
    for (int k = 0; k < batches; k++) {
        dataloader_next_batch(loader);
        for (size_t i = 0; i < loader->B * loader->T; i++) count += loader->targets[i] >= 0;
    }
    // within the same shard visit its files and row order still hold; past it, they are made again
    int moved = loader->epoch != epoch || loader->shard_position != shard_position;
    int epoch_changed = loader->epoch != epoch;
    loader->epoch = epoch;
    loader->shard_position = shard_position;
    loader->batch_index = batch_index;
    if (moved) dataloader_enter_position(loader, epoch_changed);
    return count;
}

static inline size_t dataloader_num_tokens(const DataLoader* loader) {
    return loader->num_tokens;
}

// The state is DATALOADER_STATE_WORDS uint64: a magic number, what the loader must match (B, T, number of
// processes, shuffling, seed, number and sizes of the shards) and the position. The rank is not part of
// it: the position is the same on every rank, so any rank's state restores every rank.
static inline size_t dataloader_state_bytes(const DataLoader* loader) {
    (void)loader;
    return DATALOADER_STATE_WORDS * sizeof(uint64_t);
}

static inline void dataloader_save_state(const DataLoader* loader, void* buffer) {
    uint64_t words[DATALOADER_STATE_WORDS] = {
        DATALOADER_STATE_MAGIC, (uint64_t)loader->B, (uint64_t)loader->T, (uint64_t)loader->num_processes,
        (uint64_t)loader->should_shuffle, (uint64_t)loader->seed, (uint64_t)loader->num_shards,
        loader->shards_fingerprint, (uint64_t)loader->epoch, (uint64_t)loader->shard_position,
        (uint64_t)loader->batch_index, 0};
    // the last word is a checksum of the others, so that a corrupted state is refused, not trusted
    for (int i = 0; i < DATALOADER_STATE_WORDS - 1; i++) words[DATALOADER_STATE_WORDS - 1] ^= words[i] * (2 * i + 3);
    memcpy(buffer, words, sizeof(words));
}

static inline void dataloader_load_state(DataLoader* loader, const void* buffer) {
    uint64_t w[DATALOADER_STATE_WORDS];
    memcpy(w, buffer, sizeof(w));
    uint64_t checksum = 0;
    for (int i = 0; i < DATALOADER_STATE_WORDS - 1; i++) checksum ^= w[i] * (2 * i + 3);
    if (w[0] != DATALOADER_STATE_MAGIC || checksum != w[DATALOADER_STATE_WORDS - 1]) {
        fprintf(stderr, "data loader state: not a valid saved state (bad magic number or checksum)\n");
        exit(EXIT_FAILURE);
    }
    // another process count resumes when the global batch (num_processes*B rows of T) is the same: its batches, and
    // their rows' shuffled order, are then the same ones, shared out otherwise
    if (w[1] * w[3] != loader->B * (uint64_t)loader->num_processes || w[2] != loader->T) {
        fprintf(stderr, "data loader state: saved with B %llu, T %llu on %llu processes; expected a global batch of "
                "B x processes = %zu rows of T %zu\n", (unsigned long long)w[1], (unsigned long long)w[2],
                (unsigned long long)w[3], loader->B * loader->num_processes, loader->T);
        exit(EXIT_FAILURE);
    }
    if (w[4] != (uint64_t)loader->should_shuffle || w[5] != (uint64_t)loader->seed) {
        fprintf(stderr, "data loader state: saved with shuffling %s and seed %llu; expected shuffling %s and seed %llu\n",
                w[4] ? "on" : "off", (unsigned long long)w[5], loader->should_shuffle ? "on" : "off", loader->seed);
        exit(EXIT_FAILURE);
    }
    if (w[6] != (uint64_t)loader->num_shards || w[7] != loader->shards_fingerprint) {
        fprintf(stderr, "data loader state: saved for other data (%llu shards, or shards of other sizes); expected the %d "
                "shards of %s\n", (unsigned long long)w[6], loader->num_shards, loader->shard_paths[0]);
        exit(EXIT_FAILURE);
    }
    if (w[9] >= (uint64_t)loader->num_shards) {
        fprintf(stderr, "data loader state: position shard %llu is out of range for %d shards\n",
                (unsigned long long)w[9], loader->num_shards);
        exit(EXIT_FAILURE);
    }
    loader->epoch = (size_t)w[8];
    loader->shard_position = (int)w[9];
    loader->batch_index = (size_t)w[10];
    dataloader_enter_position(loader, 1);
    size_t batches = loader->shard_num_batches[loader->shard_order[loader->shard_position]];
    if (loader->batch_index > batches) {
        fprintf(stderr, "data loader state: batch %zu is out of range for a shard of %zu batches\n", loader->batch_index,
                batches);
        exit(EXIT_FAILURE);
    }
}

static inline void dataloader_free(DataLoader* loader) {
    if (loader->file != NULL) fclose_check(loader->file, loader->shard_paths[loader->open_shard]);
    if (loader->mask_file != NULL) fclose(loader->mask_file);
    free(loader->mask_path);
    free(loader->mask_buffer);
    for (int s = 0; s < loader->num_shards; s++) free(loader->shard_paths[s]);
    free(loader->shard_paths);
    free(loader->shard_ntok);
    free(loader->shard_token_bytes);
    free(loader->shard_num_batches);
    free(loader->shard_order);
    free(loader->row_order);
    free(loader->row_buffer);
    free(loader->inputs);
    free(loader->targets);
    loader->file = NULL;
    loader->mask_file = NULL;
    loader->mask_path = NULL;
}
