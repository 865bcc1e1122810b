// llmc/cli.h: parsing the trainers' "-flag value" command-line values: a value that is not what the flag
// takes gets one line naming the flag and the value, and exit(EXIT_FAILURE).
#pragma once
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
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
