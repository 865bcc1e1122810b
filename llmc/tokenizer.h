// llmc/tokenizer.h: decodes token ids to text for the trainers' samples (llmc/bpe_encoder.h encodes with it). The file (written by
// train_gpt.py) is a 256-int32 header [0]=20240328, [1]=2, [2]=V, [3]=EOT id, then per token one length
// byte and that many bytes. A missing file is not an error, since training does not need it; a file that
// is there but broken is, so that a wrong path is never silently decoded as garbage.
// Header-only: #include it from a .cu (built by nvcc or cpu/cucc). Tested by dev/test/test_host_utils.cu.
#pragma once
#include <ctype.h>
#include <stdint.h>
#include <stdio.h>
#include <unistd.h>
#include "utils.h"

#define TOKENIZER_MAGIC 20240328
#define TOKENIZER_VERSION 2

typedef struct {
    int init_ok;
    int eot_token;
    uint32_t vocab_size;
    char** token_table;  // vocab_size NUL-terminated pieces
    unsigned char* token_length;  // each piece's bytes (a piece may hold a zero byte)
    char* path;  // for error messages
} Tokenizer;

static inline void tokenizer_init(Tokenizer* t, const char* path) {
    t->init_ok = 0;
    t->eot_token = -1;
    t->vocab_size = 0;
    t->token_table = NULL;
    t->token_length = NULL;
    t->path = string_format("%s", path);
    if (access(path, F_OK) != 0) {
        printf("tokenizer file %s not found: samples will not be decoded\n", path);
        return;
    }
    FILE* f = fopen_check(path, "rb");
    int header[256];
    read_versioned_header_check(f, header, path, TOKENIZER_MAGIC, TOKENIZER_VERSION, "tokenizer");
    if (header[2] <= 0) {
        fprintf(stderr, "%s: vocabulary size %d (expected a positive number)\n", path, header[2]);
        exit(EXIT_FAILURE);
    }
    if (header[3] < 0 || header[3] >= header[2]) {
        fprintf(stderr, "%s: EOT token %d out of range (vocabulary size %d)\n", path, header[3], header[2]);
        exit(EXIT_FAILURE);
    }
    t->vocab_size = (uint32_t)header[2];
    t->eot_token = header[3];
    t->token_table = (char**)malloc_check(t->vocab_size * sizeof(char*));
    t->token_length = (unsigned char*)malloc_check(t->vocab_size);
    for (uint32_t i = 0; i < t->vocab_size; i++) {
        unsigned char length;
        fread_check(&length, 1, 1, f, path);
        if (length == 0) {
            fprintf(stderr, "%s: token %u has length 0 (expected 1 to 255 bytes)\n", path, i);
            exit(EXIT_FAILURE);
        }
        t->token_table[i] = (char*)malloc_check((size_t)length + 1);
        fread_check(t->token_table[i], 1, length, f, path);
        t->token_table[i][length] = '\0';
        t->token_length[i] = length;
    }
    long end = ftell(f);
    if (fgetc(f) != EOF) {
        fprintf(stderr, "%s: extra bytes after the %u tokens (offset %ld; expected the end of the file)\n", path,
                t->vocab_size, end);
        exit(EXIT_FAILURE);
    }
    fclose_check(f, path);
    t->init_ok = 1;
}

static inline const char* tokenizer_decode(const Tokenizer* t, uint32_t token) {
    if (!t->init_ok) {
        fprintf(stderr, "tokenizer_decode: no tokenizer loaded from %s\n", t->path);
        exit(EXIT_FAILURE);
    }
    if (token >= t->vocab_size) {
        fprintf(stderr, "tokenizer_decode: token %u out of range (vocabulary size %u in %s)\n", token, t->vocab_size,
                t->path);
        exit(EXIT_FAILURE);
    }
    return t->token_table[token];
}

// GPT-2's byte-level tokens include lone control bytes; printing those would garble the terminal. A
// single-byte piece is printed only if it is printable or whitespace; longer pieces (text, UTF-8) as they are.
static inline void safe_printf(const char* piece) {
    if (piece == NULL || piece[0] == '\0') return;
    if (piece[1] == '\0') {
        unsigned char byte = (unsigned char)piece[0];
        if (!(isprint(byte) || isspace(byte))) return;
    }
    printf("%s", piece);
}

static inline void tokenizer_free(Tokenizer* t) {
    if (t->token_table != NULL) {
        for (uint32_t i = 0; i < t->vocab_size; i++) free(t->token_table[i]);
        free(t->token_table);
    }
    free(t->token_length);
    t->token_table = NULL;
    t->token_length = NULL;
    t->init_ok = 0;
    free(t->path);
    t->path = NULL;
}
