// llmc/cli.h: the trainers' command line: "-flag value" pairs parsed from tables of flags (Flag: name, type,
// where the value goes, help line), the usage text generated from the same tables. A value that is not what the
// flag takes, or an unknown flag, gets one line naming it and exit(EXIT_FAILURE).
#pragma once
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static int parse_int_flag(const char* flag, const char* value) {
    char* end;
    long v = strtol(value, &end, 10);
    if (*value == '\0' || *end != '\0' || v < -2147483647L || v > 2147483647L) {
        fprintf(stderr, "flag %s: expected an integer, got '%s'\n", flag, value);
        exit(EXIT_FAILURE);
    }
    return (int)v;
}

static float parse_float_flag(const char* flag, const char* value) {
    char* end;
    float v = strtof(value, &end);
    if (*value == '\0' || *end != '\0' || !isfinite(v)) {
        fprintf(stderr, "flag %s: expected a number, got '%s'\n", flag, value);
        exit(EXIT_FAILURE);
    }
    return v;
}

static int file_exists(const char* path) {
    struct stat st;
    return stat(path, &st) == 0;
}

// A trainer's flags as a table: each "-name value" flag with its type, where its value goes, and its help line
// (the usage text is generated from the tables, so it cannot disagree with what is parsed). `given` counts the
// times the command line set it, for checks such as "this flag contradicts the model file".
typedef enum { FLAG_INT, FLAG_FLOAT, FLAG_STRING } FlagType;
typedef struct {
    const char* name;  // "-b"
    FlagType type;
    void* value;       // int*, float* or const char**
    const char* help;  // one or more lines (separated by '\n'), the default at the end
    int given;
} Flag;

// A program's flags are written once, as an X-macro table whose rows read X(name, type, member, default, help):
// type INT, FLOAT or STRING, member the settings struct's field that takes the value, help ending with the default
// in words. From that one table come the settings struct (FLAG_FIELD), its defaults (FLAG_DEFAULT_VALUE, in a
// braced initialiser of that struct), the Flag rows that flags_parse fills (FLAG_ROW, given FLAG_TARGET: the
// struct the values go to), and so the usage text and doc/flags.md.
#define FLAG_CTYPE_INT int
#define FLAG_CTYPE_FLOAT float
#define FLAG_CTYPE_STRING const char*
#define FLAG_FIELD(name, type, member, value, help) FLAG_CTYPE_##type member;
#define FLAG_DEFAULT_VALUE(name, type, member, value, help) value,
#define FLAG_ROW(name, type, member, value, help) {name, FLAG_##type, &(FLAG_TARGET).member, help, 0},

// A list of flag tables: the trainer's, and a model's own (train_moe.cu's MoE flags).
typedef struct {
    Flag* flags[2];
    int counts[2];
    int num_tables;
} FlagTables;

static void flags_usage(const FlagTables* t, const char* const* titles) {
    static const char* type_names[3] = {"int", "float", "string"};
    for (int k = 0; k < t->num_tables; k++) {
        fprintf(stderr, "%s\n", titles[k]);
        for (int i = 0; i < t->counts[k]; i++) {
            const Flag* f = &t->flags[k][i];
            char head[40];
            if (strcmp(f->name, "-h") == 0) snprintf(head, sizeof(head), "%s", f->name);
            else snprintf(head, sizeof(head), "%s <%s>", f->name, type_names[f->type]);
            // a column of 15: "-arch <string>" and a space
            fprintf(stderr, "  %-15s", head);
            for (const char* c = f->help; *c; c++) {
                fputc(*c, stderr);
                if (*c == '\n') fprintf(stderr, "  %-15s", "");
            }
            fputc('\n', stderr);
        }
    }
}

// The same tables as Markdown on stdout, what doc/flags.md holds: under each title a table of the flags, their
// types and their help (its lines joined).
static void flags_markdown(const FlagTables* t, const char* const* titles) {
    static const char* type_names[3] = {"int", "float", "string"};
    for (int k = 0; k < t->num_tables; k++) {
        printf("%s## %s\n\n| flag | type | meaning (default) |\n|---|---|---|\n", k ? "\n" : "", titles[k]);
        for (int i = 0; i < t->counts[k]; i++) {
            const Flag* f = &t->flags[k][i];
            if (f->value == NULL) continue;  // -h
            printf("| `%s` | %s | ", f->name, type_names[f->type]);
            for (const char* c = f->help; *c; c++) {
                if (*c == '\n') putchar(' ');
                else if (*c == '|') fputs("\\|", stdout);
                else putchar(*c);
            }
            printf(" |\n");
        }
    }
}

// Parses "-flag value" pairs into the tables' values. Returns 1 for -h / --help, 2 for --help-markdown, 0 when all
// were parsed; a flag that no table has, a missing value or a value of the wrong type gets one line and
// exit(EXIT_FAILURE).
static int flags_parse(FlagTables* t, int argc, char* argv[]) {
    for (int i = 1; i < argc; i += 2) {
        const char* name = argv[i];
        if (!strcmp(name, "-h") || !strcmp(name, "--help")) return 1;
        if (!strcmp(name, "--help-markdown")) return 2;
        if (name[0] != '-' || i + 1 >= argc) {
            fprintf(stderr, "argument %s: expected '-flag value' pairs (see -h)\n", name);
            exit(EXIT_FAILURE);
        }
        Flag* f = NULL;
        for (int k = 0; k < t->num_tables && f == NULL; k++)
            for (int j = 0; j < t->counts[k] && f == NULL; j++)
                if (!strcmp(t->flags[k][j].name, name)) f = &t->flags[k][j];
        if (f == NULL || f->value == NULL) {
            fprintf(stderr, "unknown flag %s (see -h)\n", name);
            exit(EXIT_FAILURE);
        }
        const char* v = argv[i + 1];
        if (f->type == FLAG_INT) *(int*)f->value = parse_int_flag(name, v);
        else if (f->type == FLAG_FLOAT) *(float*)f->value = parse_float_flag(name, v);
        else *(const char**)f->value = v;
        f->given++;
    }
    return 0;
}

// the flag named `name` of a table (for its `given` count); NULL if it has none
static const Flag* flag_find(const Flag* flags, int count, const char* name) {
    for (int i = 0; i < count; i++)
        if (!strcmp(flags[i].name, name)) return &flags[i];
    return NULL;
}
