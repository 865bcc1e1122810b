// dev/test/test_host_utils.cu: tests of the trainers' host-side utilities in llmc/: checked file I/O and
// atomic commits (utils.h), data shards and batches per rank with and without shuffling, uint16 and
// uint32, save/load of the loader state (dataloader.h), the tokenizer and its BPE encoder, the learning-rate schedules, the
// outlier detector, the training log, the peak-flops table, torch's mt19937 and normal_ (rand.h, against
// values printed by torch 1.13), the sampler, and the single-process and flag-checking side of
// multi_gpu.cuh; the pipeline's schedules, cut and sends (pipeline.h). Every bad input is checked by running this program again in a child mode that must fail
// with its one line (expect_child_failure). Expectations are computed independently of the code under test:
// by hand, from the format's definition, or by PyTorch.
// The multi-process side (tcp/fs id exchange, mpirun) is dev/test/test_multi_gpu.sh, which starts this
// program in its command-line modes:
//   test_host_utils share-id tcp|fs RANK NPROC ADDRESS|DIR PORT TIMEOUT_S SEED
//   test_host_utils mpi-sum                          (under mpirun: -pi mpi)
//   test_host_utils init tcp|fs ADDRESS|DIR          (under mpirun on the CPU backend: -pi tcp/fs)
// and dev/test/test_hf.sh holds the BPE encoder to the tokenizers package's through
//   test_host_utils encode TOKENIZER TEXTS           (each line of TEXTS encoded: its ids on a line)
// Build and run (CPU backend):
//   make build/test_host_utils     (cpu/cucc -O2 -I dev/test dev/test/test_host_utils.cu ... -lnccl -lmpi -lpcre2-8)
//   build/test_host_utils
#include <dirent.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include "test_common.h"
#include "../../llmc/utils.h"
#include "../../llmc/dataloader.h"
#include "../../llmc/tokenizer.h"
#include "../../llmc/bpe_encoder.h"
#include "../../llmc/schedulers.h"
#include "../../llmc/outlier_detector.h"
#include "../../llmc/logger.h"
#include "../../llmc/mfu.h"
#include "../../llmc/rand.h"
#include "../../llmc/sampler.h"
#include "../../llmc/multi_gpu.cuh"
#include "../../llmc/pipeline.h"

// The scratch directory, shared with the child processes through the environment.
static char tmp_dir[256];

static const char* tmp_path(const char* name) {
    static char paths[8][512];
    static int next = 0;
    char* p = paths[next++ % 8];
    snprintf(p, 512, "%s/%s", tmp_dir, name);
    return p;
}

static void write_bytes(const char* path, const void* data, size_t bytes) {
    FILE* f = fopen(path, "wb");
    if (f == NULL || fwrite(data, 1, bytes, f) != bytes || fclose(f) != 0) {
        printf("cannot write test file %s\n", path);
        exit(1);
    }
}

static size_t read_whole(const char* path, char* out, size_t capacity) {
    FILE* f = fopen(path, "rb");
    if (f == NULL) return (size_t)-1;
    size_t n = fread(out, 1, capacity - 1, f);
    out[n] = '\0';
    fclose(f);
    return n;
}

// ----------------------------------------------------------------------------------------------------
// data shards. A token tells where it came from: in shard file f at position p it is
// 4096*f + p (uint16 shards, p < 4096) or 70000 + 100000*f + p (uint32 shards, all above 65535).

static int shard_token(int file, size_t pos, int version) {
    return version == 1 ? (int)(4096 * file + pos) : (int)(70000 + 100000 * file + pos);
}

static void write_shard(const char* path, int file, size_t ntok, int version, int header_ntok, int magic) {
    size_t token_bytes = version == 1 ? 2 : 4;
    size_t bytes = 1024 + ntok * token_bytes;
    unsigned char* buf = (unsigned char*)calloc(bytes, 1);
    int header[256] = {0};
    header[0] = magic;
    header[1] = version;
    header[2] = header_ntok;
    memcpy(buf, header, sizeof(header));
    for (size_t i = 0; i < ntok; i++) {
        uint32_t v = (uint32_t)shard_token(file, i, version);
        if (version == 1) {
            uint16_t v16 = (uint16_t)v;
            memcpy(buf + 1024 + 2 * i, &v16, 2);
        } else {
            memcpy(buf + 1024 + 4 * i, &v, 4);
        }
    }
    write_bytes(path, buf, bytes);
    free(buf);
}

// the three uint16 shards of the batch tests, in sorted-name order; written out of order to test sorting
static const size_t shard_sizes[3] = {53, 70, 41};
static void write_test_shards(void) {
    write_shard(tmp_path("train_02.bin"), 2, shard_sizes[2], 1, (int)shard_sizes[2], DATA_SHARD_MAGIC);
    write_shard(tmp_path("train_00.bin"), 0, shard_sizes[0], 1, (int)shard_sizes[0], DATA_SHARD_MAGIC);
    write_shard(tmp_path("train_01.bin"), 1, shard_sizes[1], 1, (int)shard_sizes[1], DATA_SHARD_MAGIC);
}

// Batches without shuffling, straight from the definition: batch k of rank r in a shard starts at token
// (k*P + r)*B*T, a shard has floor((ntok-1)/(P*B*T)) batches, shards in order, wrapping around.
static void test_dataloader_sequential(int P, size_t B, size_t T) {
    int batches = 2 * (int)((shard_sizes[0] - 1) / (P * B * T) + (shard_sizes[1] - 1) / (P * B * T) +
                            (shard_sizes[2] - 1) / (P * B * T)) + 3;  // two epochs and a bit
    for (int r = 0; r < P; r++) {
        DataLoader loader;
        dataloader_init(&loader, tmp_path("train_*.bin"), B, T, r, P, 0, 1234);
        check(dataloader_num_tokens(&loader) == shard_sizes[0] + shard_sizes[1] + shard_sizes[2],
              "dataloader: num_tokens %zu", dataloader_num_tokens(&loader));
        int file = 0;
        size_t k = 0;
        int bad = 0;
        for (int step = 0; step < batches; step++) {
            if ((k + 1) * P * B * T + 1 > shard_sizes[file]) {
                file = (file + 1) % 3;
                k = 0;
            }
            dataloader_next_batch(&loader);
            size_t start = (k * P + r) * B * T;
            for (size_t i = 0; i < B * T; i++) {
                bad += loader.inputs[i] != shard_token(file, start + i, 1);
                bad += loader.targets[i] != shard_token(file, start + i + 1, 1);
            }
            k++;
        }
        check(bad == 0, "dataloader sequential P=%d B=%zu T=%zu rank %d: %d wrong tokens over %d batches", P, B, T, r,
              bad, batches);
        // reset goes back to batch 0 of the first shard; by hand: rank r's first input is token r*B*T of shard 0
        dataloader_reset(&loader);
        dataloader_next_batch(&loader);
        check(loader.inputs[0] == (int)(r * B * T) && loader.targets[B * T - 1] == (int)((r + 1) * B * T),
              "dataloader reset: rank %d starts at token %d (want %zu)", r, loader.inputs[0], r * B * T);
        dataloader_free(&loader);
    }
}

static void test_dataloader_uint32(void) {
    // 2 processes, B 3, T 5: a global batch is 30 tokens; shards of 61 and 95 tokens give 2 and 3 batches
    write_shard(tmp_path("wide_a.bin"), 0, 61, 2, 61, DATA_SHARD_MAGIC);
    write_shard(tmp_path("wide_b.bin"), 1, 95, 2, 95, DATA_SHARD_MAGIC);
    DataLoader loader;
    dataloader_init(&loader, tmp_path("wide_*.bin"), 3, 5, 1, 2, 0, 0);
    // rank 1, by hand: shard a batches start at 15 and 45, shard b at 15, 45, 75, then shard a again at 15
    const int want_file[6] = {0, 0, 1, 1, 1, 0};
    const int want_start[6] = {15, 45, 15, 45, 75, 15};
    int bad = 0;
    for (int step = 0; step < 6; step++) {
        dataloader_next_batch(&loader);
        for (int i = 0; i < 15; i++) {
            bad += loader.inputs[i] != 70000 + 100000 * want_file[step] + want_start[step] + i;
            bad += loader.targets[i] != 70000 + 100000 * want_file[step] + want_start[step] + i + 1;
        }
    }
    check(bad == 0, "dataloader uint32 shards: %d wrong tokens", bad);
    dataloader_free(&loader);
}

typedef struct {
    int file;
    size_t start;
} RowId;

// Decodes a batch row back to (shard, start) and checks it is T+1 consecutive tokens starting at a multiple
// of T; returns file -1 if not.
static RowId decode_row(const DataLoader* loader, size_t b) {
    RowId id = {-1, 0};
    const size_t T = loader->T;
    int first = loader->inputs[b * T];
    int file = first / 4096;
    size_t start = (size_t)(first % 4096);
    if (start % T != 0 || file < 0 || file > 2 || start + T + 1 > shard_sizes[file]) return id;
    for (size_t i = 0; i < T; i++) {
        if (loader->inputs[b * T + i] != shard_token(file, start + i, 1)) return id;
        if (loader->targets[b * T + i] != shard_token(file, start + i + 1, 1)) return id;
    }
    id.file = file;
    id.start = start;
    return id;
}

// Shuffling: what can be checked without re-implementing the permutation. Over an epoch every rank reads
// well-formed rows, the ranks read distinct rows of the same shard at every step, each shard gives exactly
// its batch count, the order is not the sequential one, it changes between epochs and seeds, and the
// same seed repeats it exactly.
static void test_dataloader_shuffled(void) {
    const int P = 2;
    const size_t B = 2, T = 3;
    size_t batches_per_shard[3];
    int epoch_batches = 0;
    for (int s = 0; s < 3; s++) {
        batches_per_shard[s] = (shard_sizes[s] - 1) / (P * B * T);
        epoch_batches += (int)batches_per_shard[s];
    }
    DataLoader loaders[P], again, other_seed;
    for (int r = 0; r < P; r++) dataloader_init(&loaders[r], tmp_path("train_*.bin"), B, T, r, P, 1, 42);
    dataloader_init(&again, tmp_path("train_*.bin"), B, T, 0, P, 1, 42);
    dataloader_init(&other_seed, tmp_path("train_*.bin"), B, T, 0, P, 1, 43);
    int malformed = 0, duplicates = 0, mixed_shards = 0, differs_from_again = 0, differs_from_other_seed = 0;
    int out_of_sequence = 0, epochs_differ = 0;
    int shard_batch_count[2][3] = {{0}};
    static int first_epoch_starts[64];
    for (int epoch = 0; epoch < 2; epoch++) {
        static unsigned char seen[3][4096];
        memset(seen, 0, sizeof(seen));
        for (int step = 0; step < epoch_batches; step++) {
            int step_file = -1;
            for (int r = 0; r < P; r++) {
                dataloader_next_batch(&loaders[r]);
                for (size_t b = 0; b < B; b++) {
                    RowId id = decode_row(&loaders[r], b);
                    if (id.file < 0) { malformed++; continue; }
                    if (step_file < 0) step_file = id.file;
                    mixed_shards += id.file != step_file;
                    duplicates += seen[id.file][id.start]++ != 0;
                    size_t sequential_start = ((shard_batch_count[epoch][id.file] * P + r) * B + b) * T;
                    out_of_sequence += id.start != sequential_start;
                    if (r == 0 && b == 0) {
                        if (epoch == 0 && step < 64) first_epoch_starts[step] = id.file * 4096 + (int)id.start;
                        if (epoch == 1 && step < 64) epochs_differ += first_epoch_starts[step] != id.file * 4096 + (int)id.start;
                    }
                }
            }
            if (step_file >= 0) shard_batch_count[epoch][step_file]++;
            dataloader_next_batch(&again);
            dataloader_next_batch(&other_seed);
            differs_from_again += memcmp(again.inputs, loaders[0].inputs, B * T * sizeof(int)) != 0;
            differs_from_other_seed += memcmp(other_seed.inputs, loaders[0].inputs, B * T * sizeof(int)) != 0;
        }
    }
    check(malformed == 0, "dataloader shuffled: %d rows are not T+1 consecutive tokens at a multiple of T", malformed);
    check(duplicates == 0, "dataloader shuffled: %d rows read twice in one epoch (across ranks)", duplicates);
    check(mixed_shards == 0, "dataloader shuffled: %d rows from another shard than the rest of their step", mixed_shards);
    for (int e = 0; e < 2; e++)
        for (int s = 0; s < 3; s++)
            check(shard_batch_count[e][s] == (int)batches_per_shard[s], "dataloader shuffled: epoch %d shard %d gave %d "
                  "batches, want %zu", e, s, shard_batch_count[e][s], batches_per_shard[s]);
    check(out_of_sequence > 0, "dataloader shuffled: the rows came in sequential order");
    check(epochs_differ > 0, "dataloader shuffled: epoch 1 repeats epoch 0's order");
    check(differs_from_again == 0, "dataloader shuffled: the same seed gave %d different batches", differs_from_again);
    check(differs_from_other_seed > 0, "dataloader shuffled: seeds 42 and 43 gave the same batches");
    for (int r = 0; r < P; r++) dataloader_free(&loaders[r]);
    dataloader_free(&again);
    dataloader_free(&other_seed);

    // one shard: only the row order can change between epochs, and it must
    DataLoader single;
    dataloader_init(&single, tmp_path("train_01.bin"), B, T, 0, 1, 1, 42);
    const int single_batches = (int)((shard_sizes[1] - 1) / (B * T));
    int first_epoch[64], same_order = 1;
    for (int epoch = 0; epoch < 2; epoch++) {
        for (int step = 0; step < single_batches; step++) {
            dataloader_next_batch(&single);
            if (epoch == 0) first_epoch[step] = single.inputs[0];
            else same_order = same_order && first_epoch[step] == single.inputs[0];
        }
    }
    check(!same_order, "dataloader shuffled: with one shard, epoch 1 repeats epoch 0's row order");
    dataloader_free(&single);
}

// A loader restored from a state saved after any number of batches continues exactly like the original,
// and the state is the same on every rank: rank 0's state restores rank 1.
static void test_dataloader_state(int shuffle) {
    const int P = 2;
    const size_t B = 2, T = 3;
    DataLoader rank0, rank1;
    dataloader_init(&rank0, tmp_path("train_*.bin"), B, T, 0, P, shuffle, 7);
    dataloader_init(&rank1, tmp_path("train_*.bin"), B, T, 1, P, shuffle, 7);
    size_t state_bytes = dataloader_state_bytes(&rank0);
    unsigned char* state = (unsigned char*)malloc(state_bytes);
    int mismatches = 0;
    const int continue_batches = 6;
    for (int saved_at = 0; saved_at < 26; saved_at++) {
        dataloader_reset(&rank0);
        dataloader_reset(&rank1);
        for (int i = 0; i < saved_at; i++) {
            dataloader_next_batch(&rank0);
            dataloader_next_batch(&rank1);
        }
        dataloader_save_state(&rank0, state);
        DataLoader restored;
        dataloader_init(&restored, tmp_path("train_*.bin"), B, T, 1, P, shuffle, 7);
        dataloader_next_batch(&restored);  // a position to be overwritten
        dataloader_load_state(&restored, state);
        for (int i = 0; i < continue_batches; i++) {
            dataloader_next_batch(&rank1);
            dataloader_next_batch(&restored);
            mismatches += memcmp(rank1.inputs, restored.inputs, B * T * sizeof(int)) != 0;
            mismatches += memcmp(rank1.targets, restored.targets, B * T * sizeof(int)) != 0;
        }
        dataloader_free(&restored);
    }
    check(mismatches == 0, "dataloader state (shuffle %d): %d batches differ after load_state", shuffle, mismatches);
    if (!shuffle) {
        // the state the failure modes below load: saved by this configuration after 5 batches
        dataloader_reset(&rank0);
        for (int i = 0; i < 5; i++) dataloader_next_batch(&rank0);
        dataloader_save_state(&rank0, state);
        write_bytes(tmp_path("state.bin"), state, state_bytes);
    }
    free(state);
    dataloader_free(&rank0);
    dataloader_free(&rank1);
}

// loads tmp/state.bin (saved with B 2, T 3, 2 processes, no shuffling, seed 7, the train_* shards)
static void load_saved_state(const char* pattern, size_t B, size_t T, int P, int shuffle, unsigned long long seed,
                             int corrupt) {
    DataLoader loader;
    dataloader_init(&loader, pattern, B, T, 0, P, shuffle, seed);
    unsigned char state[DATALOADER_STATE_WORDS * 8];
    FILE* f = fopen(tmp_path("state.bin"), "rb");
    if (f == NULL || fread(state, 1, sizeof(state), f) != sizeof(state)) exit(3);
    fclose(f);
    if (corrupt) state[8 * 10] ^= 1;  // the batch index
    dataloader_load_state(&loader, state);
}

// Loss masks (dataloader.h): token p of shard file f counts as a target unless (7p + f) % 3 == 0; `bad_at` >= 0 puts
// flag 2 there.
static int mask_flag(int file, size_t pos) { return (7 * pos + file) % 3 != 0; }
static void write_mask(const char* shard_path, int file, size_t ntok, int header_ntok, int magic, long bad_at) {
    char path[600];
    snprintf(path, sizeof(path), "%s.mask", shard_path);
    unsigned char* buf = (unsigned char*)calloc(1024 + ntok, 1);
    int header[256] = {0};
    header[0] = magic;
    header[1] = 1;
    header[2] = header_ntok;
    memcpy(buf, header, sizeof(header));
    for (size_t i = 0; i < ntok; i++) buf[1024 + i] = (unsigned char)((long)i == bad_at ? 2 : mask_flag(file, i));
    write_bytes(path, buf, 1024 + ntok);
    free(buf);
}

// Shuffled batches of 2 processes over two masked shards: each target is its token or, where the mask hides it, -1
// (its position known from the input before it); dataloader_count_targets_ahead counts what the next batches hold and
// leaves the position as it was.
static void test_dataloader_masks(void) {
    const size_t sizes[2] = {53, 70};
    for (int f = 0; f < 2; f++) {
        const char* path = tmp_path(f == 0 ? "masked_0.bin" : "masked_1.bin");
        write_shard(path, f, sizes[f], 1, (int)sizes[f], DATA_SHARD_MAGIC);
        write_mask(path, f, sizes[f], (int)sizes[f], DATA_MASK_MAGIC, -1);
    }
    const size_t B = 2, T = 4;
    for (int r = 0; r < 2; r++) {
        DataLoader loader;
        dataloader_init(&loader, tmp_path("masked_*.bin"), B, T, r, 2, 1, 99);
        int bad = 0, masked = 0, counted_ok = 1;
        for (int batch = 0; batch < 24; batch++) {
            size_t ahead = batch % 5 == 0 ? dataloader_count_targets_ahead(&loader, 3) : 0;
            size_t counted = 0;
            for (int k = 0; k < (batch % 5 == 0 ? 3 : 1); k++) {
                dataloader_next_batch(&loader);
                for (size_t i = 0; i < B * T; i++) {
                    int file = loader.inputs[i] / 4096, pos = loader.inputs[i] % 4096 + 1;
                    int want = mask_flag(file, (size_t)pos) ? 4096 * file + pos : -1;
                    bad += loader.targets[i] != want;
                    masked += want < 0;
                    counted += loader.targets[i] >= 0;
                }
            }
            if (batch % 5 == 0) counted_ok &= counted == ahead;
        }
        check(bad == 0 && masked > 0, "dataloader masks rank %d: %d targets wrong (%d masked)", r, bad, masked);
        check(counted_ok, "dataloader_count_targets_ahead rank %d: a count differs from the batches read after it", r);
        dataloader_free(&loader);
    }
    write_shard(tmp_path("half_0.bin"), 0, 40, 1, 40, DATA_SHARD_MAGIC);
    write_shard(tmp_path("half_1.bin"), 1, 40, 1, 40, DATA_SHARD_MAGIC);
    write_mask(tmp_path("half_1.bin"), 1, 40, 40, DATA_MASK_MAGIC, -1);
    write_shard(tmp_path("mask_len.bin"), 0, 40, 1, 40, DATA_SHARD_MAGIC);
    write_mask(tmp_path("mask_len.bin"), 0, 39, 39, DATA_MASK_MAGIC, -1);
    write_shard(tmp_path("mask_magic.bin"), 0, 40, 1, 40, DATA_SHARD_MAGIC);
    write_mask(tmp_path("mask_magic.bin"), 0, 40, 40, 1234, -1);
    write_shard(tmp_path("mask_flag.bin"), 0, 40, 1, 40, DATA_SHARD_MAGIC);
    write_mask(tmp_path("mask_flag.bin"), 0, 40, 40, DATA_MASK_MAGIC, 3);
}

static void test_dataloader(const char* self) {
    write_test_shards();
    test_dataloader_masks();
    test_dataloader_sequential(1, 1, 4);
    test_dataloader_sequential(2, 2, 4);
    test_dataloader_sequential(3, 1, 3);
    test_dataloader_uint32();
    test_dataloader_shuffled();
    test_dataloader_state(0);
    test_dataloader_state(1);

    write_shard(tmp_path("bad_magic.bin"), 0, 40, 1, 40, 1234);
    write_shard(tmp_path("bad_version.bin"), 0, 40, 3, 40, DATA_SHARD_MAGIC);
    write_shard(tmp_path("bad_truncated.bin"), 0, 40, 1, 100, DATA_SHARD_MAGIC);
    write_shard(tmp_path("bad_long.bin"), 0, 40, 1, 30, DATA_SHARD_MAGIC);
    write_shard(tmp_path("bad_short.bin"), 0, 16, 1, 16, DATA_SHARD_MAGIC);
    const char junk[20] = "not a shard header";  // 19 characters and the NUL: 20 bytes, no header
    write_bytes(tmp_path("bad_header.bin"), junk, sizeof(junk));
    struct { const char* mode; const char* needles[4]; } cases[] = {
        {"dl-nomatch", {"no files match", "nothing_*.bin", NULL}},
        {"dl-magic", {"bad_magic.bin: not a data shard file (magic 1234, expected 20240520)", NULL}},
        {"dl-version", {"bad_version.bin: unsupported data shard version 3 (expected 1 for uint16 or 2 for uint32", NULL}},
        {"dl-truncated", {"bad_truncated.bin is truncated: its header says 100 tokens (1224 bytes with the header), "
                          "the file has 1104 bytes", NULL}},
        {"dl-long", {"bad_long.bin: 1104 bytes, more than its header's 30 tokens", NULL}},
        {"dl-short", {"bad_short.bin: 16 tokens, too few for one batch (expected at least 2 processes x B 2 x T 4 + 1 = 17)",
                      NULL}},
        {"dl-header", {"bad_header.bin is truncated: expected a 1024-byte data shard header, found 20 bytes", NULL}},
        {"dl-rank", {"process rank 2 out of range for 2 processes", NULL}},
        {"dl-mask-half", {"half_1.bin.mask: a loss mask, but", "half_0.bin has none", NULL}},
        {"dl-mask-length", {"mask_len.bin.mask: a mask of 39 tokens in 1063 bytes; expected one flag per token of",
                            "mask_len.bin, 40 tokens (1064 bytes with the header)", NULL}},
        {"dl-mask-magic", {"mask_magic.bin.mask: not a loss mask file (magic 1234, expected 20261206)", NULL}},
        {"dl-mask-flag", {"mask_flag.bin.mask: flag 2 at position 3 (expected 0 or 1)", NULL}},
        {"dl-state-shape", {"data loader state: saved with B 2, T 3 on 2 processes; expected a global batch of B x "
                            "processes = 6 rows of T 3", NULL}},
        {"dl-state-seed", {"data loader state: saved with shuffling off and seed 7; expected shuffling off and seed 8", NULL}},
        {"dl-state-files", {"data loader state: saved for other data (3 shards", NULL}},
        {"dl-state-corrupt", {"data loader state: not a valid saved state", NULL}},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) expect_child_failure(self, cases[i].mode, cases[i].needles);
}

static int run_dataloader_child(const char* mode) {
    DataLoader loader;
    if (!strcmp(mode, "dl-nomatch")) dataloader_init(&loader, tmp_path("nothing_*.bin"), 1, 4, 0, 1, 0, 0);
    else if (!strcmp(mode, "dl-magic")) dataloader_init(&loader, tmp_path("bad_magic.bin"), 1, 4, 0, 1, 0, 0);
    else if (!strcmp(mode, "dl-version")) dataloader_init(&loader, tmp_path("bad_version.bin"), 1, 4, 0, 1, 0, 0);
    else if (!strcmp(mode, "dl-truncated")) dataloader_init(&loader, tmp_path("bad_truncated.bin"), 1, 4, 0, 1, 0, 0);
    else if (!strcmp(mode, "dl-long")) dataloader_init(&loader, tmp_path("bad_long.bin"), 1, 4, 0, 1, 0, 0);
    else if (!strcmp(mode, "dl-short")) dataloader_init(&loader, tmp_path("bad_short.bin"), 2, 4, 1, 2, 0, 0);
    else if (!strcmp(mode, "dl-header")) dataloader_init(&loader, tmp_path("bad_header.bin"), 1, 4, 0, 1, 0, 0);
    else if (!strcmp(mode, "dl-rank")) dataloader_init(&loader, tmp_path("train_*.bin"), 1, 4, 2, 2, 0, 0);
    else if (!strcmp(mode, "dl-mask-half")) dataloader_init(&loader, tmp_path("half_*.bin"), 1, 4, 0, 1, 0, 0);
    else if (!strcmp(mode, "dl-mask-length")) dataloader_init(&loader, tmp_path("mask_len.bin"), 1, 4, 0, 1, 0, 0);
    else if (!strcmp(mode, "dl-mask-magic")) dataloader_init(&loader, tmp_path("mask_magic.bin"), 1, 4, 0, 1, 0, 0);
    else if (!strcmp(mode, "dl-mask-flag")) {
        dataloader_init(&loader, tmp_path("mask_flag.bin"), 1, 4, 0, 1, 0, 0);
        dataloader_next_batch(&loader);
    }
    else if (!strcmp(mode, "dl-state-shape")) load_saved_state(tmp_path("train_*.bin"), 3, 3, 2, 0, 7, 0);
    else if (!strcmp(mode, "dl-state-seed")) load_saved_state(tmp_path("train_*.bin"), 2, 3, 2, 0, 8, 0);
    else if (!strcmp(mode, "dl-state-files")) load_saved_state(tmp_path("train_0[01].bin"), 2, 3, 2, 0, 7, 0);
    else if (!strcmp(mode, "dl-state-corrupt")) load_saved_state(tmp_path("train_*.bin"), 2, 3, 2, 0, 7, 1);
    else return -1;
    return 0;  // the code under test accepted the bad input: the parent reports it
}

// ----------------------------------------------------------------------------------------------------
// utils.h

static void test_utils(const char* self) {
    const char* path = tmp_path("numbers.bin");
    int numbers[10];
    for (int i = 0; i < 10; i++) numbers[i] = (int)test_rand_u32();
    FILE* f = fopen_check(path, "wb");
    fwrite_check(numbers, sizeof(int), 10, f, path);
    fclose_check(f, path);
    int back[10] = {0};
    f = fopen_check(path, "rb");
    fread_check(back, sizeof(int), 10, f, path);
    fclose_check(f, path);
    check(memcmp(numbers, back, sizeof(back)) == 0, "utils: fwrite_check/fread_check round trip");

    int* block = (int*)malloc_check(1000 * sizeof(int));
    for (int i = 0; i < 1000; i++) block[i] = i;
    check(block[999] == 999, "utils: malloc_check gives usable memory");
    free(block);
    free(malloc_check(0));

    // atomic commit: the old file stays whole until the commit, the temporary is gone after it
    const char* final_path = tmp_path("checkpoint.bin");
    write_bytes(final_path, "old", 3);
    char* tmp_name;
    FILE* t = fopen_tmp_for(final_path, &tmp_name);
    char want_tmp[600];
    snprintf(want_tmp, sizeof(want_tmp), "%s.tmp", final_path);
    check(strcmp(tmp_name, want_tmp) == 0, "utils: fopen_tmp_for names %s, want %s", tmp_name, want_tmp);
    fwrite_check("new contents", 1, 12, t, tmp_name);
    char content[64];
    read_whole(final_path, content, sizeof(content));
    check(strcmp(content, "old") == 0, "utils: the final file changed before commit_tmp (\"%s\")", content);
    commit_tmp(t, tmp_name, final_path);
    read_whole(final_path, content, sizeof(content));
    check(strcmp(content, "new contents") == 0, "utils: after commit_tmp the file holds \"%s\"", content);
    check(access(tmp_name, F_OK) != 0, "utils: %s still exists after commit_tmp", tmp_name);
    free(tmp_name);

    const char* dir = tmp_path("made/");
    create_dir_if_not_exists(dir);
    create_dir_if_not_exists(dir);  // exists already: fine
    struct stat st;
    check(stat(dir, &st) == 0 && S_ISDIR(st.st_mode), "utils: create_dir_if_not_exists made %s", dir);

    int header[256] = {0};
    header[0] = 7;
    write_bytes(tmp_path("magic7.bin"), header, sizeof(header));
    header[0] = 20240328;
    write_bytes(tmp_path("magic_ok.bin"), header, sizeof(header));
    f = fopen_check(tmp_path("magic_ok.bin"), "rb");
    int got[256];
    read_header_check(f, got, tmp_path("magic_ok.bin"), 20240328, "tokenizer");
    fclose_check(f, tmp_path("magic_ok.bin"));
    check(got[0] == 20240328, "utils: read_header_check reads the header");

    struct { const char* mode; const char* needles[4]; } cases[] = {
        {"utils-missing", {"cannot open", "does_not_exist.bin", "No such file", NULL}},
        {"utils-truncated", {"numbers.bin is truncated: expected 12 bytes at offset 32", NULL}},
        {"utils-magic", {"magic7.bin: not a tokenizer file (magic 7, expected 20240328)", NULL}},
        {"utils-not-dir", {"numbers.bin exists but is not a directory", NULL}},
        {"utils-malloc", {"out of host memory: cannot allocate", NULL}},
    };
    // AddressSanitizer (cpu/cucc --sanitize) aborts on a huge malloc unless told to return NULL like libc
    const char* asan_options = getenv("ASAN_OPTIONS");
    char saved_options[1024];
    snprintf(saved_options, sizeof(saved_options), "%s", asan_options ? asan_options : "");
    char options[1100];
    snprintf(options, sizeof(options), "%s%sallocator_may_return_null=1", saved_options, asan_options ? ":" : "");
    setenv("ASAN_OPTIONS", options, 1);
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) expect_child_failure(self, cases[i].mode, cases[i].needles);
    if (asan_options) setenv("ASAN_OPTIONS", saved_options, 1);
    else unsetenv("ASAN_OPTIONS");
}

static int run_utils_child(const char* mode) {
    if (!strcmp(mode, "utils-missing")) {
        fopen_check(tmp_path("does_not_exist.bin"), "rb");
    } else if (!strcmp(mode, "utils-truncated")) {
        FILE* f = fopen_check(tmp_path("numbers.bin"), "rb");
        int buf[8];
        fread_check(buf, sizeof(int), 8, f, tmp_path("numbers.bin"));
        fread_check(buf, sizeof(int), 3, f, tmp_path("numbers.bin"));  // only 2 ints are left
    } else if (!strcmp(mode, "utils-magic")) {
        int header[256];
        read_header_check(fopen_check(tmp_path("magic7.bin"), "rb"), header, tmp_path("magic7.bin"), 20240328, "tokenizer");
    } else if (!strcmp(mode, "utils-not-dir")) {
        create_dir_if_not_exists(tmp_path("numbers.bin"));
    } else if (!strcmp(mode, "utils-malloc")) {
        malloc_check(SIZE_MAX / 2);
    } else {
        return -1;
    }
    return 0;
}

// ----------------------------------------------------------------------------------------------------
// tokenizer.h

static void write_tokenizer(const char* path, int magic, int version, int V, int eot, const char* const* pieces,
                            int npieces, const char* extra) {
    FILE* f = fopen(path, "wb");
    int header[256] = {0};
    header[0] = magic;
    header[1] = version;
    header[2] = V;
    header[3] = eot;
    fwrite(header, sizeof(int), 256, f);
    for (int i = 0; i < npieces; i++) {
        unsigned char len = (unsigned char)strlen(pieces[i]);
        fwrite(&len, 1, 1, f);
        fwrite(pieces[i], 1, len, f);
    }
    if (extra) fwrite(extra, 1, strlen(extra), f);
    fclose(f);
}

// runs fn with stdout going to a file and returns what it printed
static const char* capture_stdout(void (*fn)(void* arg), void* arg) {
    static char out[4096];
    fflush(stdout);
    int saved = dup(1);
    FILE* f = fopen(tmp_path("stdout.txt"), "wb");
    dup2(fileno(f), 1);
    fn(arg);
    fflush(stdout);
    dup2(saved, 1);
    close(saved);
    fclose(f);
    read_whole(tmp_path("stdout.txt"), out, sizeof(out));
    return out;
}

static const char* const tokenizer_pieces[6] = {"Hello", ",", " world", "\x01", "\n", "<|endoftext|>"};

static void print_all_tokens(void* arg) {
    const Tokenizer* t = (const Tokenizer*)arg;
    for (uint32_t i = 0; i < t->vocab_size; i++) safe_printf(tokenizer_decode(t, i));
}

static void init_missing_tokenizer(void* arg) {
    tokenizer_init((Tokenizer*)arg, tmp_path("no_tokenizer.bin"));
}

static void test_tokenizer(const char* self) {
    write_tokenizer(tmp_path("tok.bin"), 20240328, 2, 6, 5, tokenizer_pieces, 6, NULL);
    Tokenizer t;
    tokenizer_init(&t, tmp_path("tok.bin"));
    check(t.init_ok == 1 && t.vocab_size == 6 && t.eot_token == 5, "tokenizer: init_ok %d, V %u, EOT %d", t.init_ok,
          t.vocab_size, t.eot_token);
    int bad = 0;
    for (uint32_t i = 0; i < 6; i++) bad += strcmp(tokenizer_decode(&t, i), tokenizer_pieces[i]) != 0;
    check(bad == 0, "tokenizer: %d tokens decode wrong", bad);
    const char* printed = capture_stdout(print_all_tokens, &t);
    check(strcmp(printed, "Hello, world\n<|endoftext|>") == 0, "tokenizer: safe_printf printed \"%s\"", printed);
    tokenizer_free(&t);

    Tokenizer missing;
    printed = capture_stdout(init_missing_tokenizer, &missing);
    check(missing.init_ok == 0 && strstr(printed, "no_tokenizer.bin not found: samples will not be decoded") != NULL,
          "tokenizer: a missing file gives init_ok %d and the note \"%s\"", missing.init_ok, printed);

    write_tokenizer(tmp_path("tok_magic.bin"), 20240327, 2, 6, 5, tokenizer_pieces, 6, NULL);
    write_tokenizer(tmp_path("tok_version.bin"), 20240328, 1, 6, 5, tokenizer_pieces, 6, NULL);
    write_tokenizer(tmp_path("tok_short.bin"), 20240328, 2, 8, 5, tokenizer_pieces, 6, NULL);
    write_tokenizer(tmp_path("tok_extra.bin"), 20240328, 2, 6, 5, tokenizer_pieces, 6, "xyz");
    write_tokenizer(tmp_path("tok_eot.bin"), 20240328, 2, 6, 6, tokenizer_pieces, 6, NULL);
    struct { const char* mode; const char* needles[4]; } cases[] = {
        {"tok-magic", {"tok_magic.bin: not a tokenizer file (magic 20240327, expected 20240328)", NULL}},
        {"tok-version", {"tok_version.bin: unsupported tokenizer version 1 (expected 2)", NULL}},
        {"tok-truncated", {"tok_short.bin is truncated: expected 1 bytes at offset", NULL}},
        {"tok-extra", {"tok_extra.bin: extra bytes after the 6 tokens", NULL}},
        {"tok-eot", {"tok_eot.bin: EOT token 6 out of range (vocabulary size 6)", NULL}},
        {"tok-decode-range", {"tokenizer_decode: token 6 out of range (vocabulary size 6", NULL}},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) expect_child_failure(self, cases[i].mode, cases[i].needles);
}

// bpe_encoder.h on a byte-level BPE by hand: ids 0..255 the bytes, then the merged pieces "bc", "ab", "abc", " a",
// and end of text. Expected ids worked out from GPT-2's pattern and lowest-id-first merging:
//   "abc": ab (257) and bc (256) both pieces, bc first, then a+bc = abc (258);
//   " abx": one word (a space and letters); " a" (259) and ab (257): ab first, then " "+ab is no piece;
//   "ab  a": words "ab", " " (a space run keeps its last space for the next word), " a";
//   "<|endoftext|>" as text: bytes (the words "<|", "endoftext", "|>"), never the special token;
//   "x\xc3\xa9 12": UTF-8 letters are letters (the word "x\xc3\xa9" of 3 bytes), then the word " 12".
static void write_bpe_tokenizer(const char* path) {
    FILE* f = fopen(path, "wb");
    int header[256] = {0};
    header[0] = 20240328;
    header[1] = 2;
    header[2] = 261;
    header[3] = 260;
    fwrite(header, sizeof(int), 256, f);
    unsigned char one = 1;
    for (int b = 0; b < 256; b++) {
        unsigned char byte = (unsigned char)b;
        fwrite(&one, 1, 1, f);
        fwrite(&byte, 1, 1, f);
    }
    const char* merged[5] = {"bc", "ab", "abc", " a", "<|endoftext|>"};
    for (int i = 0; i < 5; i++) {
        unsigned char len = (unsigned char)strlen(merged[i]);
        fwrite(&len, 1, 1, f);
        fwrite(merged[i], 1, len, f);
    }
    fclose(f);
}

static void test_bpe_encoder(const char* self) {
    write_bpe_tokenizer(tmp_path("bpe.bin"));
    Tokenizer t;
    tokenizer_init(&t, tmp_path("bpe.bin"));
    BpeEncoder e;
    bpe_encoder_init(&e, &t);
    struct { const char* text; int ids[16]; int n; } cases[] = {
        {"abc", {258}, 1},
        {" abx", {32, 257, 120}, 3},
        {"ab  a", {257, 32, 259}, 3},
        {"<|endoftext|>", {60, 124, 101, 110, 100, 111, 102, 116, 101, 120, 116, 124, 62}, 13},
        {"x\xc3\xa9 12", {120, 0xc3, 0xa9, 32, 49, 50}, 6},
        {"\x00" "abc", {0, 258}, 2},
    };
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        size_t length = c == 5 ? 4 : strlen(cases[c].text);  // the last text begins with a zero byte
        int out[64];
        for (int i = 0; i < 64; i++) out[i] = -7;  // poison
        size_t bad_offset = 0;
        int n = bpe_encode(&e, cases[c].text, length, out, &bad_offset);
        int same = n == cases[c].n;
        for (int i = 0; same && i < n; i++) same = out[i] == cases[c].ids[i];
        check(same, "bpe_encode: text %zu gives %d ids (expected %d), the first %d", c, n, cases[c].n, n > 0 ? out[0] : -1);
    }
    int out[8];
    size_t bad_offset = 0;
    int n = bpe_encode(&e, "ab\xff", 3, out, &bad_offset);
    check(n == -1 && bad_offset == 2, "bpe_encode: text that is not UTF-8 gives %d at %zu (expected -1 at 2)", n,
          bad_offset);
    bpe_encoder_free(&e);
    tokenizer_free(&t);
    struct { const char* mode; const char* needles[4]; } refusals[] = {
        {"bpe-no-byte", {"tok.bin: no piece is the byte 0x00: not a byte-level BPE", NULL}},
        {"bpe-missing", {"no_tokenizer.bin not found: text needs it to be encoded", NULL}},
    };
    for (size_t i = 0; i < 2; i++) expect_child_failure(self, refusals[i].mode, refusals[i].needles);
}

// The encode mode: each line of a text file (its newline not part of it) encoded, its ids printed on a line.
static int run_encode(const char* tokenizer_path, const char* texts_path) {
    Tokenizer t;
    tokenizer_init(&t, tokenizer_path);
    BpeEncoder e;
    bpe_encoder_init(&e, &t);
    FILE* f = fopen_check(texts_path, "rb");
    char* line = NULL;
    size_t capacity = 0;
    ssize_t got;
    while ((got = getline(&line, &capacity, f)) != -1) {
        if (got > 0 && line[got - 1] == '\n') got--;
        int* ids = (int*)malloc_check(((size_t)got + 1) * sizeof(int));
        size_t bad_offset;
        int n = bpe_encode(&e, line, (size_t)got, ids, &bad_offset);
        if (n < 0) {
            fprintf(stderr, "%s: a line is not UTF-8 (byte %zu)\n", texts_path, bad_offset);
            return 1;
        }
        for (int i = 0; i < n; i++) printf(i ? " %d" : "%d", ids[i]);
        printf("\n");
        free(ids);
    }
    free(line);
    fclose(f);
    bpe_encoder_free(&e);
    tokenizer_free(&t);
    return 0;
}

static int run_tokenizer_child(const char* mode) {
    Tokenizer t;
    BpeEncoder e;
    if (!strcmp(mode, "bpe-no-byte")) {
        tokenizer_init(&t, tmp_path("tok.bin"));
        bpe_encoder_init(&e, &t);
        return 0;
    }
    if (!strcmp(mode, "bpe-missing")) {
        tokenizer_init(&t, tmp_path("no_tokenizer.bin"));
        bpe_encoder_init(&e, &t);
        return 0;
    }
    if (!strcmp(mode, "tok-magic")) tokenizer_init(&t, tmp_path("tok_magic.bin"));
    else if (!strcmp(mode, "tok-version")) tokenizer_init(&t, tmp_path("tok_version.bin"));
    else if (!strcmp(mode, "tok-truncated")) tokenizer_init(&t, tmp_path("tok_short.bin"));
    else if (!strcmp(mode, "tok-extra")) tokenizer_init(&t, tmp_path("tok_extra.bin"));
    else if (!strcmp(mode, "tok-eot")) tokenizer_init(&t, tmp_path("tok_eot.bin"));
    else if (!strcmp(mode, "tok-decode-range")) {
        tokenizer_init(&t, tmp_path("tok.bin"));
        tokenizer_decode(&t, 6);
    } else return -1;
    return 0;
}

// ----------------------------------------------------------------------------------------------------
// schedulers.h: lr 0.5, warmup 4, 25 steps (the last is 24), final fraction 0.1 (min lr 0.05). By hand:
// warmup 0.125, 0.25, 0.375, 0.5; cosine/linear decay over steps 4..24 (20 intervals); wsd decays over the
// last 5 steps, 20..24, by 0.09 per step.

static void test_schedulers(const char* self) {
    struct { const char* type; int step; double want; } cases[] = {
        {"cosine", 0, 0.125}, {"cosine", 3, 0.5}, {"cosine", 4, 0.5},
        {"cosine", 9, 0.05 + 0.5 * (1.0 + 0.70710678118654752) * 0.45},  // progress 1/4: cos(pi/4)
        {"cosine", 14, 0.275}, {"cosine", 24, 0.05}, {"cosine", 40, 0.05},
        {"linear", 1, 0.25}, {"linear", 9, 0.3875}, {"linear", 14, 0.275}, {"linear", 24, 0.05},
        {"constant", 2, 0.375}, {"constant", 10, 0.5}, {"constant", 24, 0.5},
        {"wsd", 0, 0.125}, {"wsd", 12, 0.5}, {"wsd", 19, 0.5}, {"wsd", 20, 0.41}, {"wsd", 22, 0.23}, {"wsd", 24, 0.05},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        LearningRateScheduler s;
        lr_scheduler_init(&s, cases[i].type, 0.5f, 4, 25, 0.1f);
        float got = lr_scheduler_get(&s, cases[i].step);
        check(fabs(got - cases[i].want) <= 1e-6, "scheduler %s step %d: %.9g, want %.9g", cases[i].type, cases[i].step,
              got, cases[i].want);
    }
    // no warmup: step 0 is the full rate
    LearningRateScheduler s;
    lr_scheduler_init(&s, "cosine", 3e-4f, 0, 10, 0.0f);
    check(fabsf(lr_scheduler_get(&s, 0) - 3e-4f) <= 1e-10f && fabsf(lr_scheduler_get(&s, 9)) <= 1e-10f,
          "scheduler cosine without warmup: %g at step 0, %g at step 9", lr_scheduler_get(&s, 0), lr_scheduler_get(&s, 9));
    const char* needles_type[] = {"unknown learning rate scheduler 'step' (expected cosine, linear, constant or wsd)", NULL};
    expect_child_failure(self, "sched-type", needles_type);
    const char* needles_frac[] = {"final learning rate fraction 1.5: expected a value in [0, 1]", NULL};
    expect_child_failure(self, "sched-frac", needles_frac);
}

static int run_scheduler_child(const char* mode) {
    LearningRateScheduler s;
    if (!strcmp(mode, "sched-type")) lr_scheduler_init(&s, "step", 0.5f, 4, 25, 0.1f);
    else if (!strcmp(mode, "sched-frac")) lr_scheduler_init(&s, "cosine", 0.5f, 4, 25, 1.5f);
    else return -1;
    return 0;
}

// ----------------------------------------------------------------------------------------------------
// outlier_detector.h

static void test_outlier_detector(void) {
    OutlierDetector d;
    init_detector(&d);
    int nan_while_filling = 0;
    for (int i = 0; i < 128; i++) nan_while_filling += isnan(update_detector(&d, (double)(i % 4)));
    check(nan_while_filling == 128, "outlier: %d of the first 128 z-scores are NaN", nan_while_filling);
    // window 0,1,2,3 x 32: mean 1.5, population variance 1.25
    double z = update_detector(&d, 5.0);
    check(fabs(z - 3.5 / sqrt(1.25)) < 1e-12, "outlier: z %.15g, want %.15g", z, 3.5 / sqrt(1.25));
    // now the window lost its first 0 and gained 5: sum 197, sum of squares 473
    double mean = 197.0 / 128.0, var = 473.0 / 128.0 - mean * mean;
    z = update_detector(&d, 1.5);
    check(fabs(z - (1.5 - mean) / sqrt(var)) < 1e-12, "outlier: z %.15g after the window moved, want %.15g", z,
          (1.5 - mean) / sqrt(var));
    check(isnan(update_detector(&d, NAN)), "outlier: a NaN value gives NaN");

    // random values: against the z-score over the last 128 accepted values, kept in a plain history
    static double history[1000];
    OutlierDetector r;
    init_detector(&r);
    int bad = 0;
    for (int i = 0; i < 1000; i++) {
        double x = 3.0 + test_rand_uniform(-1.0f, 1.0f) + (i % 97 == 0 ? 10.0 : 0.0);
        history[i] = x;
        double want = NAN;
        if (i >= 128) {
            double s = 0.0, s2 = 0.0;
            for (int j = i - 128; j < i; j++) {
                s += history[j];
                s2 += history[j] * history[j];
            }
            double m = s / 128.0;
            want = (x - m) / sqrt(s2 / 128.0 - m * m);
        }
        double got = update_detector(&r, x);
        if (i == 500) {
            OutlierDetector copy;
            memcpy(&copy, &r, sizeof(r));  // the trainer checkpoints it as bytes
            bad += update_detector(&copy, 4.0) != update_detector(&r, 4.0);
            history[++i] = 4.0;
        }
        bad += i < 128 ? !isnan(got) : !(fabs(got - want) < 1e-9 * (1.0 + fabs(want)));
    }
    check(bad == 0, "outlier: %d of 1000 random z-scores differ from the reference", bad);

    OutlierDetector c;
    init_detector(&c);
    for (int i = 0; i < 128; i++) update_detector(&c, 2.0);
    double same = update_detector(&c, 2.0), higher = update_detector(&c, 2.5);
    check(same == 0.0 && isinf(higher) && higher > 0, "outlier: constant window gives z %g for the same value, %g for a "
          "larger one", same, higher);
}

// ----------------------------------------------------------------------------------------------------
// logger.h

static void test_logger(void) {
    const char* dir = tmp_path("logs");
    Logger l;
    logger_init(&l, dir, 0, 0);
    logger_log_val(&l, 0, 4.56789f);
    logger_log_train(&l, 1, 3.25f, 1.5f, 6e-4f, 123.456f, 41.5f, 98765.4f);
    logger_log_train(&l, 2, 3.0f, 0.75f, 3e-4f, 100.0f, -1.0f, 1000.0f);
    logger_log_text(&l, "s:2 moe aux:0.01");
    logger_free(&l);
    char content[1024];
    const char* want = "s:0 tel:4.5679\n"
                       "s:1 trl:3.2500 norm:1.5000 lr:6.000000e-04 ms:123.46 mfu:41.50 tok/s:98765\n"
                       "s:2 trl:3.0000 norm:0.7500 lr:3.000000e-04 ms:100.00 tok/s:1000\n"
                       "s:2 moe aux:0.01\n";
    read_whole(tmp_path("logs/main.log"), content, sizeof(content));
    check(strcmp(content, want) == 0, "logger: main.log is\n%s", content);

    logger_init(&l, dir, 0, 1);  // resume: append
    logger_log_val(&l, 3, 2.0f);
    logger_free(&l);
    read_whole(tmp_path("logs/main.log"), content, sizeof(content));
    check(strlen(content) == strlen(want) + strlen("s:3 tel:2.0000\n") && strstr(content, "s:1 trl") &&
          strstr(content, "s:3 tel:2.0000\n"), "logger: resume appends (file is\n%s)", content);

    logger_init(&l, dir, 0, 0);  // fresh run: starts over
    logger_log_val(&l, 0, 1.0f);
    logger_free(&l);
    read_whole(tmp_path("logs/main.log"), content, sizeof(content));
    check(strcmp(content, "s:0 tel:1.0000\n") == 0, "logger: a fresh run starts over (file is\n%s)", content);

    logger_init(&l, tmp_path("logs_rank1"), 1, 0);
    logger_log_val(&l, 0, 1.0f);
    logger_free(&l);
    check(access(tmp_path("logs_rank1"), F_OK) != 0, "logger: rank 1 must not write");
    logger_init(&l, NULL, 0, 0);
    logger_log_text(&l, "nothing");
    logger_free(&l);
    check(l.active == 0, "logger: no log directory means no log");
}

// ----------------------------------------------------------------------------------------------------
// mfu.h

static void test_mfu(void) {
    struct { const char* name; int precision; float want; } cases[] = {
        {"NVIDIA A100-SXM4-80GB", PRECISION_BF16, 312.0f}, {"NVIDIA A100-SXM4-40GB", PRECISION_FP32, 156.0f},
        {"NVIDIA A100-PCIE-40GB", PRECISION_FP16, 312.0f}, {"NVIDIA A100 80GB PCIe", PRECISION_BF16, 312.0f},
        {"NVIDIA H100 80GB HBM3", PRECISION_BF16, 989.4f}, {"NVIDIA H100 80GB HBM3", PRECISION_FP32, 494.7f},
        {"NVIDIA H100 PCIe", PRECISION_BF16, 756.0f}, {"NVIDIA H100 NVL", PRECISION_FP16, 835.5f},
        {"NVIDIA H200", PRECISION_BF16, 989.4f}, {"NVIDIA H200 NVL", PRECISION_BF16, 835.5f},
        {"NVIDIA L4", PRECISION_BF16, 121.0f}, {"NVIDIA L4", PRECISION_FP32, 60.0f},
        {"NVIDIA A10G", PRECISION_BF16, 70.0f},
        {"NVIDIA GeForce RTX 4090", PRECISION_BF16, 165.2f}, {"NVIDIA GeForce RTX 3090", PRECISION_BF16, 71.0f},
        {"NVIDIA GeForce RTX 3090 Ti", PRECISION_BF16, 80.0f},
        {"NVIDIA L40S", PRECISION_BF16, -1.0f}, {"Tesla V100-SXM2-16GB", PRECISION_BF16, -1.0f},
        {"NVIDIA A100-SXM4-80GB", 7, -1.0f},
        {"CPU backend (cucc): AMD EPYC 7B13", PRECISION_BF16, -1.0f},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        float got = get_flops_promised(cases[i].name, cases[i].precision);
        check(got == cases[i].want, "mfu: %s precision %d: %g, want %g", cases[i].name, cases[i].precision, got,
              cases[i].want);
    }
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess && strstr(prop.name, "CPU backend") != NULL) {
        check(get_flops_promised(prop.name, PRECISION_BF16) == -1.0f, "mfu: the CPU backend's device is unknown");
    }
}

// ----------------------------------------------------------------------------------------------------
// rand.h against torch 1.13:
//   g = torch.Generator().manual_seed(137)
//   torch.randint(0, 2**32 - 1, (6,), generator=g, dtype=torch.int64)   # range < 2**32: one raw draw each
//   torch.rand(4, generator=g)
//   torch.empty(20).normal_(mean=0.5, std=2.0, generator=g)             # n >= 16, not a multiple of 16
//   torch.empty(5).normal_(generator=g)                                  # n < 16: double path, caches a sample
//   torch.empty(3).normal_(generator=g)                                  # starts with the cached sample
//   torch.empty(32).normal_(generator=g)
//   torch.randint(0, 2**32 - 1, (2,), generator=g, dtype=torch.int64)

static void test_rand(void) {
    const uint32_t want_int[6] = {4053805790u, 2173880614u, 380293709u, 1237255315u, 2986595568u, 1663397195u};
    const float want_rand[4] = {0x1.948a7p-3f, 0x1.bd8408p-3f, 0x1.cb9dd2p-1f, 0x1.54932cp-1f};
    const double want_normal20[20] = {
        1.0132173299789429, 0.7707889080047607, -1.076970100402832, -0.11609107255935669, -0.31253159046173096,
        1.6032898426055908, -1.3909884691238403, -0.13543444871902466, 3.0146610736846924, -2.075056314468384,
        -3.6204566955566406, 1.6506438255310059, 2.376683235168457, 2.3703086376190186, -2.0412700176239014,
        1.4950076341629028, -1.2249623537063599, -0.062480270862579346, 0.9011837244033813, 1.2430834770202637};
    const double want_normal5[5] = {1.008763074874878, -0.10044316947460175, -0.18078409135341644,
                                    -2.196692943572998, 0.5370959639549255};
    const double want_normal3[3] = {-1.1920924186706543, -0.8604159355163574, 0.18099234998226166};
    const double want_normal32[32] = {
        -0.13932538032531738, -1.5825822353363037, 0.11954779922962189, 0.5350654125213623, -1.4532544612884521,
        0.3285706043243408, 0.7286346554756165, -0.38119858503341675, 0.11278434097766876, 0.5217812657356262,
        -0.4290372431278229, -3.7756307125091553, -1.3832839727401733, -2.3940999507904053, -0.29157310724258423,
        -2.2417092323303223, -1.0444029569625854, 1.1435433626174927, 0.9058293104171753, 0.46675655245780945,
        0.16835348308086395, -0.3465164601802826, -0.26041364669799805, 0.24257229268550873, -0.10706649720668793,
        -0.7755008339881897, -0.8902794122695923, -0.9555484056472778, -0.07851814478635788, -1.9760901927947998,
        -0.06888177990913391, -0.42534735798835754};
    const uint32_t want_int_after[2] = {472497831u, 1960657725u};

    mt19937_state s;
    manual_seed(&s, 137);
    int bad = 0;
    for (int i = 0; i < 6; i++) bad += randint32(&s) != want_int[i];
    check(bad == 0, "rand: randint32 differs from torch in %d of 6", bad);
    bad = 0;
    for (int i = 0; i < 4; i++) bad += randfloat32(&s) != want_rand[i];
    check(bad == 0, "rand: randfloat32 differs from torch.rand in %d of 4", bad);
    // torch's vectorised sin/cos/log may differ from libm in the last bit: a few float ulps of tolerance
    float normal[32];
    normal_(normal, 20, 0.5f, 2.0f, &s);
    check_close("rand: normal_ n=20", normal, want_normal20, 20, 1e-6, 1e-6);
    normal_(normal, 5, 0.0f, 1.0f, &s);
    check_close("rand: normal_ n=5", normal, want_normal5, 5, 1e-6, 1e-6);
    normal_(normal, 3, 0.0f, 1.0f, &s);
    check_close("rand: normal_ n=3 (cached sample first)", normal, want_normal3, 3, 1e-6, 1e-6);
    normal_(normal, 32, 0.0f, 1.0f, &s);
    check_close("rand: normal_ n=32", normal, want_normal32, 32, 1e-6, 1e-6);
    check(randint32(&s) == want_int_after[0] && randint32(&s) == want_int_after[1],
          "rand: the generator is where torch's is after the normal_ calls");

    // randfloat32_fill gives the numbers of as many randfloat32 calls, across twists of the state (624 words), and
    // leaves the generator where they leave it; normal_chunked gives normal_'s numbers in pieces, a partial last
    // block (torch's redrawn last 16) among them
    enum { FILL = 2000, CHUNKED = 16 * 97 + 5 };
    static float one_by_one[FILL], filled[FILL], whole[CHUNKED], pieces[CHUNKED];
    mt19937_state a, b;
    manual_seed(&a, 42);
    manual_seed(&b, 42);
    for (int i = 0; i < 7; i++) one_by_one[i] = randfloat32(&a);
    randfloat32_fill(filled, 7, &b);  // mid-state
    for (int i = 7; i < FILL; i++) one_by_one[i] = randfloat32(&a);
    randfloat32_fill(filled + 7, FILL - 7, &b);
    check(memcmp(one_by_one, filled, sizeof(filled)) == 0 && randint32(&a) == randint32(&b),
          "rand: randfloat32_fill differs from randfloat32 calls");
    struct Pieces {
        static void take(void* ctx, size_t offset, const float* values, size_t count) {
            memcpy((float*)ctx + offset, values, count * sizeof(float));
        }
    };
    float buf[64];
    for (int n : {(int)CHUNKED, 16 * 97, 16, 21}) {
        manual_seed(&a, 7);
        manual_seed(&b, 7);
        normal_(whole, n, 0.0f, 0.02f, &a);
        normal_chunked(n, 0.0f, 0.02f, &b, buf, 64, Pieces::take, pieces);
        check(memcmp(whole, pieces, n * sizeof(float)) == 0 && randint32(&a) == randint32(&b),
              "rand: normal_chunked differs from normal_ for n = %d", n);
    }
}

// ----------------------------------------------------------------------------------------------------
// sampler.h

static void test_sampler(void) {
    // the same xorshift64* as test_common.h's generator, written independently
    uint64_t state = 0x1234567890ABCDEFull;
    test_seed(0x1234567890ABCDEFull);
    int bad = 0;
    for (int i = 0; i < 1000; i++) bad += random_u32_host(&state) != test_rand_u32();
    check(bad == 0, "sampler: random_u32_host differs from xorshift64* in %d of 1000", bad);
    uint64_t a = 99, b = 99;
    bad = 0;
    for (int i = 0; i < 1000; i++) {
        float f = random_f32_host(&a);
        bad += !(f >= 0.0f && f < 1.0f) || f != (float)(random_u32_host(&b) >> 8) / 16777216.0f;
    }
    check(bad == 0, "sampler: random_f32_host outside [0,1) or not the top 24 bits in %d of 1000", bad);

    // by hand: logits ln 1, ln 2, ln 3, ln 4 give probabilities 0.1, 0.2, 0.3, 0.4 (cumulative .1 .3 .6 1)
    float logits[4] = {0.0f, logf(2.0f), logf(3.0f), logf(4.0f)};
    struct { float coin; int want; } picks[] = {{0.0f, 0}, {0.09f, 0}, {0.11f, 1}, {0.29f, 1}, {0.31f, 2},
                                                {0.59f, 2}, {0.61f, 3}, {0.999f, 3}};
    for (size_t i = 0; i < sizeof(picks) / sizeof(picks[0]); i++) {
        int got = sample_softmax(logits, 4, picks[i].coin);
        check(got == picks[i].want, "sampler: coin %g picks %d, want %d", picks[i].coin, got, picks[i].want);
    }
    // shifted by a large constant (overflow without the max), random logits on a grid of coins
    float big[50];
    double cdf[50], sum = 0.0;
    for (int i = 0; i < 50; i++) {
        big[i] = 1000.0f + test_rand_uniform(-4.0f, 4.0f);
        sum += exp((double)big[i] - 1000.0);
        cdf[i] = sum;
    }
    bad = 0;
    for (int k = 0; k < 10000; k++) {
        float coin = (k + 0.5f) / 10000.0f;
        int want = 0;
        while (want < 49 && (double)coin * sum >= cdf[want]) want++;
        bad += sample_softmax(big, 50, coin) != want;
    }
    check(bad == 0, "sampler: %d of 10000 coins pick another index than the cumulative distribution", bad);
    check(sample_softmax(big, 1, 0.7f) == 0, "sampler: n = 1 picks 0");
}

// ----------------------------------------------------------------------------------------------------
// multi_gpu.cuh, one process; the multi-process side is dev/test/test_multi_gpu.sh

static void test_multi_gpu_single(const char* self) {
    MultiGpuConfig c = multi_gpu_config_init("mpi", 1, 0, 8, NULL, NULL);
    check(c.num_processes == 1 && c.process_rank == 0 && c.used_mpi == 0 && c.local_device_idx == 0,
          "multi_gpu single: %d processes, rank %d, used_mpi %d, device %d", c.num_processes, c.process_rank, c.used_mpi,
          c.local_device_idx);
    int count = 0;
    check(ncclCommCount(c.nccl_comm, &count) == ncclSuccess && count == 1, "multi_gpu single: communicator of %d", count);
    check(multi_gpu_cpu_float_sum(3.25f, &c) == 3.25f, "multi_gpu single: the sum over one process is the value");
    multi_gpu_barrier(&c);
    multi_gpu_config_free(&c);
    MultiGpuConfig t = multi_gpu_config_init("tcp", 1, 0, 8, NULL, NULL);  // one process needs no server
    check(t.num_processes == 1 && t.used_mpi == 0, "multi_gpu single: -pi tcp with one process");
    multi_gpu_config_free(&t);

    struct { const char* mode; const char* needles[4]; } cases[] = {
        {"mg-method", {"unknown -pi 'carrier-pigeon' (expected mpi, tcp or fs)", NULL}},
        {"mg-rank", {"-pr 2: out of range for -pn 2 (expected 0 to 1)", NULL}},
        {"mg-fs-path", {"-pi fs: expected -pf, a directory all 2 processes share", NULL}},
        {"mg-ip", {"-ps 'localhost': expected the IPv4 address of rank 0", NULL}},
        {"mg-pn", {"-pn 2: but 1 process was started (with -pi mpi the process count comes from mpirun -np)", NULL}},
        {"mg-gpus", {"-pg 0: expected at least 1 GPU per node", NULL}},
        {"mg-fs-timeout", {"-pi fs: rank 1 timed out after 1 s waiting for", "ncclUniqueId.sync", NULL}},
        {"mg-tcp-timeout", {"-pi tcp: rank 1 could not connect to rank 0 at 127.0.0.1:", "within 1 s", NULL}},
#ifdef __CUCC__
        {"mg-cpu-tcp", {"-pi tcp/fs needs the GPU build; on the CPU backend start the processes with mpirun", NULL}},
#endif
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) expect_child_failure(self, cases[i].mode, cases[i].needles);
}

static int run_multi_gpu_child(const char* mode) {
    ncclUniqueId id;
    if (!strcmp(mode, "mg-method")) multi_gpu_config_init("carrier-pigeon", 1, 0, 8, NULL, NULL);
    else if (!strcmp(mode, "mg-rank")) multi_gpu_config_init("tcp", 2, 2, 8, "127.0.0.1", NULL);
    else if (!strcmp(mode, "mg-fs-path")) multi_gpu_config_init("fs", 2, 1, 8, NULL, NULL);
    else if (!strcmp(mode, "mg-ip")) multi_gpu_config_init("tcp", 2, 1, 8, "localhost", NULL);
    else if (!strcmp(mode, "mg-pn")) multi_gpu_config_init("mpi", 2, 0, 8, NULL, NULL);
    else if (!strcmp(mode, "mg-gpus")) multi_gpu_config_init("mpi", 1, 0, 0, NULL, NULL);
    else if (!strcmp(mode, "mg-fs-timeout")) multi_gpu_share_id_fs(&id, 1, 2, tmp_dir, 1);
    else if (!strcmp(mode, "mg-tcp-timeout")) multi_gpu_share_id_tcp(&id, 1, 2, "127.0.0.1", 1, 1);  // port 1: nobody
    else if (!strcmp(mode, "mg-cpu-tcp")) multi_gpu_config_init("tcp", 2, 1, 8, "127.0.0.1", NULL);
    else return -1;
    return 0;
}

// `share-id tcp|fs RANK NPROC ADDRESS|DIR PORT TIMEOUT_S SEED`: rank 0 sends an id made from SEED, the
// others receive it and compare with the same id made locally. Prints "share-id rank R: ok" or a FAIL line.
static int run_share_id(int argc, char** argv) {
    if (argc != 9) {
        fprintf(stderr, "usage: %s share-id tcp|fs RANK NPROC ADDRESS|DIR PORT TIMEOUT_S SEED\n", argv[0]);
        return 2;
    }
    int rank = atoi(argv[3]), nproc = atoi(argv[4]), port = atoi(argv[6]), timeout_s = atoi(argv[7]);
    ncclUniqueId expected, id;
    test_seed(strtoull(argv[8], NULL, 10));
    for (size_t i = 0; i < sizeof(expected.internal); i++) expected.internal[i] = (char)test_rand_u32();
    memset(&id, 0, sizeof(id));
    if (rank == 0) id = expected;
    if (!strcmp(argv[2], "tcp")) multi_gpu_share_id_tcp(&id, rank, nproc, argv[5], port, timeout_s);
    else multi_gpu_share_id_fs(&id, rank, nproc, argv[5], timeout_s);
    int ok = memcmp(&id, &expected, sizeof(id)) == 0;
    printf("share-id rank %d: %s\n", rank, ok ? "ok" : "FAIL: the id differs from rank 0's");
    return ok ? 0 : 1;
}

// `mpi-sum` or `init tcp|fs ADDRESS|DIR` under mpirun: forms the group, checks rank, size, the float sum
// (rank r contributes 0.25 * (r + 1): the sum is 0.125 * n * (n + 1), exact in fp32) and the barrier.
static int run_group(int argc, char** argv) {
    const char* world_rank = getenv("OMPI_COMM_WORLD_RANK");
    const char* world_size = getenv("OMPI_COMM_WORLD_SIZE");
    if (world_rank == NULL || world_size == NULL || (strcmp(argv[1], "mpi-sum") && argc != 4)) {
        fprintf(stderr, "usage: mpirun -np N %s mpi-sum | init tcp|fs ADDRESS|DIR\n", argv[0]);
        return 2;
    }
    int rank = atoi(world_rank), n = atoi(world_size);
    MultiGpuConfig c;
    if (!strcmp(argv[1], "mpi-sum")) {
        c = multi_gpu_config_init("mpi", 1, 0, 8, NULL, NULL);
    } else {
        int is_tcp = !strcmp(argv[2], "tcp");
        c = multi_gpu_config_init(argv[2], n, rank, 8, is_tcp ? argv[3] : NULL, is_tcp ? NULL : argv[3]);
    }
    int count = 0;
    ncclCommCount(c.nccl_comm, &count);
    float sum = multi_gpu_cpu_float_sum(0.25f * (float)(rank + 1), &c);
    multi_gpu_barrier(&c);
    int ok = c.process_rank == rank && c.num_processes == n && count == n && sum == 0.125f * n * (n + 1);
    printf("%s rank %d of %d: %s (sum %g, communicator of %d)\n", argv[1], c.process_rank, c.num_processes,
           ok ? "ok" : "FAIL", sum, count);
    fflush(stdout);
    multi_gpu_config_free(&c);
    return ok ? 0 : 1;
}

// ----------------------------------------------------------------------------------------------------


// ----------------------------------------------------------------------------------------------------
// The pipeline's schedules (pipeline.h), checked by replaying them: every pass once, in an order its inputs allow; the
// time they take when every pass costs one unit (the formulas' bubbles); the activation slots; and their sends and
// receives run as blocking NCCL groups finish without a deadlock. The balanced cut against every cut, and -ppl.

#define PP_MAX_V 3
#define PP_MAX_M 24
#define PP_MAX_PASSES (3 * PP_MAX_M * PP_MAX_V)
typedef struct {
    PipelinePass passes[PP_MAX_PASSES];
    PipelineOp ops[2 * PP_MAX_PASSES];
    int op_begin[PP_MAX_PASSES + 2];
    int n;
} StagePlan;

// the stage and pass that produce pass x's input on stage s (-1: none): the previous model chunk's F, the next one's
// B, or the stage's own F (for B) and B (for W); chunk j = c p + s
static int pp_input(int p, int v, int s, PipelinePass x, PipelinePass* from, int which) {
    int j = x.chunk * p + s;
    if (which == 1) {  // the stage's own earlier pass
        if (x.kind == PASS_FORWARD) return -1;
        *from = (PipelinePass){x.kind == PASS_BACKWARD ? PASS_FORWARD : PASS_BACKWARD, x.micro, x.chunk};
        return s;
    }
    int other = x.kind == PASS_FORWARD ? j - 1 : j + 1;
    if (x.kind == PASS_WEIGHT || other < 0 || other >= p * v) return -1;
    *from = (PipelinePass){x.kind, x.micro, other / p};
    return other % p;
}

// the unit at whose end each pass of each stage is done, replaying the stages' orders with unit costs: a pass starts
// once the stage's previous pass and its inputs are done. Returns the time the last pass ends, or -1 when no order can
// run (a pass waits on one that waits on it).
static int pp_replay(const StagePlan* plans, int p, int m, int v) {
    static int done[8][3][PP_MAX_M][PP_MAX_V];  // [stage][kind][micro][chunk]: end unit, -1 not yet
    int at[8] = {0}, clock[8] = {0}, end = 0;
    memset(done, 0xff, sizeof(done));
    (void)m;
    for (int progress = 1; progress;) {
        progress = 0;
        for (int s = 0; s < p; s++) {
            if (at[s] == plans[s].n) continue;
            PipelinePass x = plans[s].passes[at[s]];
            int ready = clock[s], blocked = 0;
            for (int which = 0; which < 2; which++) {
                PipelinePass from;
                int t = pp_input(p, v, s, x, &from, which);
                if (t < 0) continue;
                int when = done[t][from.kind][from.micro][from.chunk];
                if (when < 0) blocked = 1;
                else if (when > ready) ready = when;
            }
            if (blocked) continue;
            done[s][x.kind][x.micro][x.chunk] = clock[s] = ready + 1;
            if (clock[s] > end) end = clock[s];
            at[s]++;
            progress = 1;
        }
    }
    for (int s = 0; s < p; s++)
        if (at[s] < plans[s].n) return -1;
    return end;
}

// The sends and receives as NCCL groups of one that block until their partner is posted (a rendezvous): each stage's
// items are its ops and passes in order; an op finishes once its partner's stage has reached the partner. A message
// is named by the pass that takes it. Returns 1 if every stage gets through.
typedef struct {
    int is_op, send, peer;
    PipelinePass taker;  // the pass that takes the message
} PipelineItem;
static PipelineItem pp_items[8][3 * PP_MAX_PASSES + 4];
static int pp_groups_finish(const StagePlan* plans, int p, int v) {
    int count[8], at[8] = {0};
    for (int s = 0; s < p; s++) {
        int c = 0;
        for (int k = 0; k <= plans[s].n; k++) {
            for (int i = plans[s].op_begin[k]; i < plans[s].op_begin[k + 1]; i++) {
                const PipelineOp* o = &plans[s].ops[i];
                PipelineItem it = {1, o->send, o->peer, plans[s].passes[o->pass]};
                if (o->send) {  // taken by the next (F) or previous (B) chunk's pass of the same kind
                    PipelinePass x = plans[s].passes[o->pass];
                    int j = x.chunk * p + s + (x.kind == PASS_FORWARD ? 1 : -1);
                    it.taker = (PipelinePass){x.kind, x.micro, j / p};
                    if (j % p != o->peer) return 0;
                }
                pp_items[s][c++] = it;
            }
            if (k < plans[s].n) pp_items[s][c++] = (PipelineItem){0, 0, -1, {PASS_FORWARD, 0, 0}};
        }
        count[s] = c;
    }
    (void)v;
    for (int progress = 1; progress;) {
        progress = 0;
        for (int s = 0; s < p; s++) {
            if (at[s] == count[s]) continue;
            const PipelineItem* x = &pp_items[s][at[s]];
            int ok = 1;
            if (x->is_op) {  // the partner: the peer's op of the other direction, with this stage, of the same message
                int t = x->peer, j = -1;
                for (int i = 0; i < count[t] && j < 0; i++) {
                    const PipelineItem* y = &pp_items[t][i];
                    if (y->is_op && y->send != x->send && y->peer == s && y->taker.kind == x->taker.kind &&
                        y->taker.micro == x->taker.micro && y->taker.chunk == x->taker.chunk)
                        j = i;
                }
                ok = j >= 0 && at[t] >= j;
            }
            if (ok) at[s]++, progress = 1;
        }
    }
    for (int s = 0; s < p; s++)
        if (at[s] < count[s]) return 0;
    return 1;
}

static void test_pipeline(void) {
    int bad_order = 0, bad_time = 0, bad_slots = 0, deadlocks = 0, cases = 0;
    char first[160] = "";
    for (int schedule = 0; schedule < NUM_SCHEDULES; schedule++) {
        int interleaved = schedule == SCHEDULE_INTERLEAVED;
        for (int v = interleaved ? 2 : 1; v <= (interleaved ? PP_MAX_V : 1); v++) {
            for (int p = interleaved ? 2 : 1; p <= 8; p++) {
                for (int m = 1; m <= PP_MAX_M; m++) {
                    if (schedule == SCHEDULE_ZB && m < p) continue;      // refused by the trainer
                    if (interleaved && m % p != 0) continue;            // refused by the trainer
                    StagePlan plans[8];
                    int most_slots = 0;
                    for (int s = 0; s < p; s++) {
                        plans[s].n = pipeline_passes((PipelineSchedule)schedule, p, s, m, v, plans[s].passes);
                        pipeline_ops((PipelineSchedule)schedule, p, s, m, v, plans[s].ops, plans[s].op_begin);
                        // every pass once; F, B and W of each micro-batch and chunk in that order, each kind of a chunk
                        // in micro-batch order
                        int seen[3][PP_MAX_M][PP_MAX_V] = {{{0}}}, next[3][PP_MAX_V] = {{0}};
                        int kinds = schedule == SCHEDULE_ZB ? 3 : 2, ok = plans[s].n == kinds * m * v;
                        for (int k = 0; k < plans[s].n && ok; k++) {
                            PipelinePass x = plans[s].passes[k];
                            ok = (int)x.kind < kinds && x.chunk >= 0 && x.chunk < v &&
                                 x.micro == next[x.kind][x.chunk]++ && !seen[x.kind][x.micro][x.chunk]++ &&
                                 (x.kind == PASS_FORWARD || seen[x.kind - 1][x.micro][x.chunk]);
                        }
                        bad_order += !ok;
                        int slots = pipeline_slots(plans[s].passes, plans[s].n);
                        if (slots > most_slots) most_slots = slots;
                        int want = schedule == SCHEDULE_GPIPE ? m : (p - s < m ? p - s : m);
                        if ((schedule == SCHEDULE_GPIPE || schedule == SCHEDULE_1F1B) && slots != want) {
                            bad_slots++;
                            if (!first[0]) snprintf(first, sizeof(first), "%s p %d m %d stage %d: %d slots, want %d",
                                                    pipeline_schedule_names[schedule], p, m, s, slots, want);
                        }
                    }
                    // ZB-H1: a micro-batch's slot is held until its W, which waits while up to p are pending;
                    // interleaved: its warm-up holds up to 2 + (v - 1) p / p ... at most every micro-batch
                    if ((schedule == SCHEDULE_ZB && most_slots > 2 * p - 1) || most_slots > m) {
                        bad_slots++;
                        if (!first[0]) snprintf(first, sizeof(first), "%s p %d m %d: %d slots",
                                                pipeline_schedule_names[schedule], p, m, most_slots);
                    }
                    // unit costs: GPipe and 1F1B take (m + p - 1)(F + B), interleaved 2 (m v + p - 1), ZB-H1 3m + p - 1
                    int want = schedule == SCHEDULE_ZB ? 3 * m + p - 1 : 2 * (m * v + p - 1);
                    int took = pp_replay(plans, p, m, v);
                    if (took != want) {
                        bad_time++;
                        if (!first[0]) snprintf(first, sizeof(first), "%s p %d m %d v %d: %d units, want %d",
                                                pipeline_schedule_names[schedule], p, m, v, took, want);
                    }
                    if (!pp_groups_finish(plans, p, v)) {
                        deadlocks++;
                        if (!first[0]) snprintf(first, sizeof(first), "%s p %d m %d v %d: the groups deadlock",
                                                pipeline_schedule_names[schedule], p, m, v);
                    }
                    cases++;
                }
            }
        }
    }
    check(bad_order == 0, "pipeline: %d stages' passes out of order", bad_order);
    check(bad_slots == 0, "pipeline: %d stages with other than the schedule's slots (%s)", bad_slots, first);
    check(bad_time == 0, "pipeline: %d schedules off their unit-cost time (%s)", bad_time, first);
    check(deadlocks == 0, "pipeline: %d schedules whose sends deadlock (%s)", deadlocks, first);
    check(cases > 500, "pipeline: %d cases", cases);

    // the balanced cut: no cut of L layers into p stages has a cheaper costliest stage (every cut enumerated)
    int worse = 0;
    for (int L = 1; L <= 9; L++) {
        for (int p = 1; p <= L; p++) {
            double layer = 3.0, head = 7.0, embed = 0.5;
            int cut[PIPELINE_MAX_STAGES + 1];
            pipeline_balance(L, p, layer, embed, head, cut);
            double got = 0.0;
            for (int s = 0; s < p; s++) {
                double c = (cut[s + 1] - cut[s]) * layer + (s == 0 ? embed : 0.0) + (s == p - 1 ? head : 0.0);
                if (cut[s + 1] <= cut[s]) c = 1e300;
                if (c > got) got = c;
            }
            double best = 1e300;  // every cut: p - 1 boundaries among L - 1 places, as a bit mask
            for (unsigned mask = 0; mask < (1u << (L - 1)); mask++) {
                if (__builtin_popcount(mask) != p - 1) continue;
                double worst = 0.0, c = embed;
                for (int l = 0; l < L; l++) {
                    c += layer;
                    if (l == L - 1 || (mask >> l) & 1) {
                        if (l == L - 1) c += head;
                        if (c > worst) worst = c;
                        c = 0.0;
                    }
                }
                if (worst < best) best = worst;
            }
            worse += got > best + 1e-9;
        }
    }
    check(worse == 0, "pipeline: the balanced cut is not the cheapest in %d cases", worse);
    int first_layer[PIPELINE_MAX_STAGES + 1];
    check(pipeline_parse_layers("3,1,4", 8, 3, first_layer) && first_layer[1] == 3 && first_layer[2] == 4 &&
              first_layer[3] == 8, "pipeline: -ppl 3,1,4 cuts 8 layers at 3 and 4");
}

int main(int argc, char** argv) {
    if (argc >= 2 && !strcmp(argv[1], "share-id")) return run_share_id(argc, argv);
    if (argc >= 2 && (!strcmp(argv[1], "mpi-sum") || !strcmp(argv[1], "init"))) return run_group(argc, argv);
    if (argc == 4 && !strcmp(argv[1], "encode")) return run_encode(argv[2], argv[3]);
    const char* inherited = getenv("HOST_UTILS_TEST_DIR");
    if (argc >= 2) {
        // a child mode: the parent made the files and passed the directory
        if (inherited == NULL) {
            fprintf(stderr, "%s %s: run without HOST_UTILS_TEST_DIR (child modes are started by the test itself)\n",
                    argv[0], argv[1]);
            return 2;
        }
        snprintf(tmp_dir, sizeof(tmp_dir), "%s", inherited);
        int r = run_dataloader_child(argv[1]);
        if (r < 0) r = run_utils_child(argv[1]);
        if (r < 0) r = run_tokenizer_child(argv[1]);
        if (r < 0) r = run_scheduler_child(argv[1]);
        if (r < 0) r = run_multi_gpu_child(argv[1]);
        if (r < 0) {
            fprintf(stderr, "%s: unknown mode %s\n", argv[0], argv[1]);
            return 2;
        }
        return 0;
    }
    snprintf(tmp_dir, sizeof(tmp_dir), "/tmp/test_host_utils.XXXXXX");
    if (mkdtemp(tmp_dir) == NULL) {
        printf("cannot create a scratch directory\n");
        return 1;
    }
    setenv("HOST_UTILS_TEST_DIR", tmp_dir, 1);
    test_seed(20240520);
    const char* self = "/proc/self/exe";
    char self_path[4096];
    ssize_t len = readlink(self, self_path, sizeof(self_path) - 1);
    if (len <= 0) {
        printf("cannot find this program's path\n");
        return 1;
    }
    self_path[len] = '\0';

    test_utils(self_path);
    test_dataloader(self_path);
    test_tokenizer(self_path);
    test_bpe_encoder(self_path);
    test_schedulers(self_path);
    test_outlier_detector();
    test_logger();
    test_mfu();
    test_rand();
    test_sampler();
    test_multi_gpu_single(self_path);
    test_pipeline();

    char command[512];
    snprintf(command, sizeof(command), "rm -rf '%s'", tmp_dir);
    if (system(command) != 0) printf("note: could not remove %s\n", tmp_dir);
    return test_summary("test_host_utils");
}
