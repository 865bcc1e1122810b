// llmc/info_table.h: the trainers' start-up table (device, precision, model, memory plan, ...), two columns each
// as wide as its widest entry. Used by train_gpt.cu and train_moe.cu (an FFN's own rows).
#pragma once
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// The start-up table: rows of a name and a value, printed with each column as wide as its widest entry.
#define INFO_TABLE_ROWS 32
struct InfoTable {
    char name[INFO_TABLE_ROWS][32];
    char value[INFO_TABLE_ROWS][128];
    int rows;
};

static void info_row(InfoTable* t, const char* name, const char* fmt, ...) {
    if (t->rows == INFO_TABLE_ROWS) {
        fprintf(stderr, "info_row: more than %d rows (%s)\n", INFO_TABLE_ROWS, name);
        exit(EXIT_FAILURE);
    }
    snprintf(t->name[t->rows], sizeof(t->name[0]), "%s", name);
    va_list args;
    va_start(args, fmt);
    vsnprintf(t->value[t->rows], sizeof(t->value[0]), fmt, args);
    va_end(args);
    t->rows++;
}

static void info_table_print(const InfoTable* t) {
    int wn = 0, wv = 0;
    for (int i = 0; i < t->rows; i++) {
        if ((int)strlen(t->name[i]) > wn) wn = (int)strlen(t->name[i]);
        if ((int)strlen(t->value[i]) > wv) wv = (int)strlen(t->value[i]);
    }
    char rule[200];
    int n = 0;
    rule[n++] = '+';
    for (int i = 0; i < wn + 2; i++) rule[n++] = '-';
    rule[n++] = '+';
    for (int i = 0; i < wv + 2; i++) rule[n++] = '-';
    rule[n++] = '+';
    rule[n] = '\0';
    printf("%s\n", rule);
    for (int i = 0; i < t->rows; i++) printf("| %-*s | %-*s |\n", wn, t->name[i], wv, t->value[i]);
    printf("%s\n", rule);
}
