// llmc/kv_cache.h: the paged KV cache's bookkeeping on the host (doc/inference.md, "The paged KV cache"): a pool of
// fixed-size blocks of `block_size` token positions, a reference count per block (a block of a prompt that -sn
// samples share counts each of them), and per sequence a block table of the physical blocks that hold its positions
// 0, 1, ... in order. Blocks are taken on demand, lowest free index first (so that a run allocates the same blocks
// every time), and go back to the pool when their last reader lets go. A sequence about to write into a block that
// others still read copies it first (copy on write). The device memory itself is llmc/generation.h's (engine_block_bytes per
// block); the kernels that read and write it through the tables are llmc/paged_attention.cuh's.
// Tests: generate-* rows (dev/test/test_generate.sh: block counts with shared prompts, pre-emption, paged against
// contiguous).
#pragma once
#include <stdlib.h>
#include "utils.h"

typedef struct {
    int num_blocks;
    int block_size;   // token positions per block
    int* refcount;    // (num_blocks) readers of each block; 0: free
    int num_free;
    int peak_used;    // the most blocks in use at once
    long long taken;  // blocks taken from the pool over the run (copies on write included)
} BlockPool;

typedef struct {
    int* blocks;      // (max_blocks) the physical block of positions [i * block_size, (i + 1) * block_size)
    int num_blocks;
} BlockTable;

static void block_pool_init(BlockPool* pool, int num_blocks, int block_size) {
    pool->num_blocks = num_blocks;
    pool->block_size = block_size;
    pool->refcount = (int*)calloc(num_blocks, sizeof(int));
    if (pool->refcount == NULL) {
        fprintf(stderr, "block_pool_init: cannot allocate %d block counts\n", num_blocks);
        exit(EXIT_FAILURE);
    }
    pool->num_free = num_blocks;
    pool->peak_used = 0;
    pool->taken = 0;
}

static void block_pool_free(BlockPool* pool) { free(pool->refcount); }

// the lowest free block, now with one reader; -1 when none is free
static int block_take(BlockPool* pool) {
    if (pool->num_free == 0) return -1;
    for (int b = 0; b < pool->num_blocks; b++) {
        if (pool->refcount[b] == 0) {
            pool->refcount[b] = 1;
            pool->num_free--;
            pool->taken++;
            int used = pool->num_blocks - pool->num_free;
            if (used > pool->peak_used) pool->peak_used = used;
            return b;
        }
    }
    return -1;
}

static void block_release(BlockPool* pool, int block) {
    if (--pool->refcount[block] == 0) pool->num_free++;
}

// the blocks a sequence of `positions` token positions needs
static int blocks_for(const BlockPool* pool, int positions) {
    return (positions + pool->block_size - 1) / pool->block_size;
}

static void block_table_init(BlockTable* t, int max_blocks) {
    t->blocks = (int*)malloc_check((size_t)max_blocks * sizeof(int));
    t->num_blocks = 0;
}

// every block of the table back to the pool (a shared one stays with its other readers)
static void block_table_release(BlockTable* t, BlockPool* pool) {
    for (int i = 0; i < t->num_blocks; i++) block_release(pool, t->blocks[i]);
    t->num_blocks = 0;
}

// `to` reads the blocks of `from` too (a prompt's blocks shared by its samples)
static void block_table_share(BlockTable* to, const BlockTable* from, BlockPool* pool) {
    for (int i = 0; i < from->num_blocks; i++) {
        to->blocks[i] = from->blocks[i];
        pool->refcount[from->blocks[i]]++;
    }
    to->num_blocks = from->num_blocks;
}
