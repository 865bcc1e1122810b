// llmc/bpe_encoder.h: encodes text into token ids with the pieces of a tokenizer file (llmc/tokenizer.h), as GPT-2's
// byte-level BPE does:
//   1. the text is cut into words by GPT-2's pattern: the contractions 's 't 're 've 'm 'll 'd; a run of letters, of
//      digits or of other symbols, each with an optional leading space; whitespace (a run before a non-space keeps
//      that run's last space for the word after it);
//   2. each word starts as its bytes, and the adjacent pair whose joined bytes are the piece of the lowest id is joined,
//      again and again, until no adjacent pair joins into a piece.
// A piece's id is its merge rank. That holds in every byte-level BPE whose ids follow its merges (GPT-2's, and the
// tokenizers package's), and it is what scripts/hf_export.py --tokenizer assumes. The end-of-text piece is a special
// token: text never encodes to it. A vocabulary of bytes (data/bytes.py: ids 0..255 the bytes, no longer pieces)
// encodes byte by byte.
// The pattern needs Unicode's letter and number classes and a lookahead: it runs in PCRE2 (Debian libpcre2-dev; link
// -lpcre2-8), with Unicode properties (PCRE2_UCP), so that \s is Unicode's whitespace as in GPT-2's regex.
// Used by generate.cu's text prompts. Tested by dev/test/test_hf.sh against the tokenizers package's own encoder, on
// a byte-level BPE it trains (through dev/test/test_host_utils encode).
#pragma once
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include "tokenizer.h"
#include "utils.h"

#define BPE_PATTERN "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"

typedef struct {
    const Tokenizer* tokenizer;
    pcre2_code* pattern;
    pcre2_match_data* match;
    int* slots;  // open addressing: each slot -1 or the id of a piece, by the hash of the piece's bytes
    uint32_t slot_mask;  // slots: a power of two, at least twice the pieces
} BpeEncoder;

static inline uint32_t bpe_hash(const unsigned char* bytes, size_t length) {  // FNV-1a
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < length; i++) h = (h ^ bytes[i]) * 16777619u;
    return h;
}

// The id of the piece with these bytes, or -1 when no piece has them.
static inline int bpe_find(const BpeEncoder* e, const unsigned char* bytes, size_t length) {
    for (uint32_t s = bpe_hash(bytes, length) & e->slot_mask;; s = (s + 1) & e->slot_mask) {
        int id = e->slots[s];
        if (id < 0) return -1;
        if (e->tokenizer->token_length[id] == length && memcmp(e->tokenizer->token_table[id], bytes, length) == 0)
            return id;
    }
}

// Refused with one line: no tokenizer loaded; a byte that is no piece (not a byte-level tokenizer).
static inline void bpe_encoder_init(BpeEncoder* e, const Tokenizer* t) {
    if (!t->init_ok) {
        fprintf(stderr, "tokenizer file %s not found: text needs it to be encoded\n", t->path);
        exit(EXIT_FAILURE);
    }
    e->tokenizer = t;
    uint32_t slots = 1;
    while (slots < 2 * t->vocab_size) slots *= 2;
    e->slot_mask = slots - 1;
    e->slots = (int*)malloc_check(slots * sizeof(int));
    for (uint32_t s = 0; s < slots; s++) e->slots[s] = -1;
    for (uint32_t id = 0; id < t->vocab_size; id++) {
        if ((int)id == t->eot_token) continue;
        const unsigned char* bytes = (const unsigned char*)t->token_table[id];
        if (bpe_find(e, bytes, t->token_length[id]) >= 0) continue;  // a repeated piece: the lowest id is its rank
        uint32_t s = bpe_hash(bytes, t->token_length[id]) & e->slot_mask;
        while (e->slots[s] >= 0) s = (s + 1) & e->slot_mask;
        e->slots[s] = (int)id;
    }
    for (int b = 0; b < 256; b++) {
        unsigned char byte = (unsigned char)b;
        if (bpe_find(e, &byte, 1) < 0) {
            fprintf(stderr, "tokenizer file %s: no piece is the byte 0x%02x: not a byte-level BPE, so it cannot encode "
                    "text\n", t->path, b);
            exit(EXIT_FAILURE);
        }
    }
    int error;
    PCRE2_SIZE error_offset;
    e->pattern = pcre2_compile((PCRE2_SPTR)BPE_PATTERN, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP, &error,
                               &error_offset, NULL);
    if (e->pattern == NULL) {
        PCRE2_UCHAR message[256];
        pcre2_get_error_message(error, message, sizeof(message));
        fprintf(stderr, "bpe_encoder_init: PCRE2 refuses GPT-2's pattern at %zu: %s\n", (size_t)error_offset,
                (char*)message);
        exit(EXIT_FAILURE);
    }
    e->match = pcre2_match_data_create_from_pattern(e->pattern, NULL);
}

// Step 2 for one word: appends its pieces' ids to out.
static inline int bpe_merge_word(const BpeEncoder* e, const unsigned char* word, size_t length, int* out) {
    size_t* starts = (size_t*)malloc_check((length + 1) * sizeof(size_t));  // part i: bytes starts[i]..starts[i+1]
    size_t parts = length;
    for (size_t i = 0; i <= length; i++) starts[i] = i;
    while (parts > 1) {
        int best_id = -1;
        size_t best = 0;
        for (size_t i = 0; i + 1 < parts; i++) {
            int id = bpe_find(e, word + starts[i], starts[i + 2] - starts[i]);
            if (id >= 0 && (best_id < 0 || id < best_id)) { best_id = id; best = i; }
        }
        if (best_id < 0) break;
        memmove(&starts[best + 1], &starts[best + 2], (parts - best - 1) * sizeof(size_t));
        parts--;
    }
    for (size_t i = 0; i < parts; i++) out[i] = bpe_find(e, word + starts[i], starts[i + 1] - starts[i]);
    free(starts);
    return (int)parts;
}

// Writes the ids of text[0, length) to out, which has room for length ids (a piece holds at least a byte). Returns
// how many, or -1 when the text is not UTF-8 (*bad_offset: where it stops being UTF-8).
static inline int bpe_encode(const BpeEncoder* e, const char* text, size_t length, int* out, size_t* bad_offset) {
    int n = 0;
    uint32_t options = 0;  // the first match checks the whole text's UTF-8; the others need not repeat it
    for (PCRE2_SIZE at = 0; at < length; options = PCRE2_NO_UTF_CHECK) {
        int rc = pcre2_match(e->pattern, (PCRE2_SPTR)text, length, at, options, e->match, NULL);
        if (rc <= PCRE2_ERROR_UTF8_ERR1 && rc >= PCRE2_ERROR_UTF8_ERR21) {
            *bad_offset = (size_t)pcre2_get_startchar(e->match);  // where the bad character starts
            return -1;
        }
        if (rc < 0) {  // every character matches one of \s+ or the symbol runs: a library failure
            PCRE2_UCHAR message[256];
            pcre2_get_error_message(rc, message, sizeof(message));
            fprintf(stderr, "bpe_encode: PCRE2 match failed at byte %zu: %s\n", (size_t)at, (char*)message);
            exit(EXIT_FAILURE);
        }
        PCRE2_SIZE* span = pcre2_get_ovector_pointer(e->match);
        n += bpe_merge_word(e, (const unsigned char*)text + span[0], span[1] - span[0], out + n);
        at = span[1];
    }
    return n;
}

static inline void bpe_encoder_free(BpeEncoder* e) {
    pcre2_match_data_free(e->match);
    pcre2_code_free(e->pattern);
    free(e->slots);
    e->slots = NULL;
}
