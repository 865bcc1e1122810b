// llmc/logger.h: the training log <log_dir>/main.log (flag -o), one line per event, read by plotting
// scripts: "s:STEP tel:VAL_LOSS" for a validation loss, "s:STEP trl:LOSS norm:N lr:LR ms:MS mfu:PCT tok/s:R"
// for a training step (mfu left out when the device's peak is not known), and free-form lines from
// logger_log_text. Only rank 0 writes; a resumed run appends (after logger_resume drops the steps it redoes), a
// fresh run starts the file over. Every line
// is flushed at once, so a crashed run keeps its log up to the last step.
// Header-only: #include it from a .cu (built by nvcc or cpu/cucc). Tested by dev/test/test_host_utils.cu.
#pragma once
#include <stdio.h>
#include "utils.h"

typedef struct {
    int active;
    char* path;  // <log_dir>/main.log (NULL when not active)
    FILE* file;
} Logger;

static inline void logger_init(Logger* l, const char* log_dir, int process_rank, int resume) {
    l->active = log_dir != NULL && process_rank == 0;
    l->path = NULL;
    l->file = NULL;
    if (!l->active) return;
    create_dir_if_not_exists(log_dir);
    l->path = string_format("%s/main.log", log_dir);
    l->file = fopen_check(l->path, resume ? "a" : "w");
}

// A run resumed from step `step` redoes every step after it: their lines (and, when `eval_redone`, the validation
// lines of step `step` itself, which the resumed run computes again) are dropped from the log, which is rewritten
// through a temporary file, and a "resumed from step" line marks the place. So a plot never draws a step twice.
static inline void logger_resume(Logger* l, int step, int eval_redone) {
    if (!l->active) return;
    fclose_check(l->file, l->path);
    l->file = NULL;
    FILE* in = fopen(l->path, "r");
    char* tmp;
    FILE* out = fopen_tmp_for(l->path, &tmp);
    if (in != NULL) {
        char line[4096];
        int dropped = 0;
        while (fgets(line, sizeof(line), in) != NULL) {
            int s;
            if (sscanf(line, "s:%d", &s) == 1) {
                int eval = strstr(line, " tel:") != NULL || strstr(line, " layer:") != NULL;
                if (s > step || (s == step && eval && eval_redone)) {
                    dropped++;
                    continue;
                }
            }
            fputs(line, out);
        }
        fclose(in);
        fprintf(out, "resumed from step %d (%d later lines dropped)\n", step, dropped);
    }
    commit_tmp(out, tmp, l->path);
    free(tmp);
    l->file = fopen_check(l->path, "a");
}

static inline void logger_flush_line(Logger* l) {
    if (fflush(l->file) != 0) {
        fprintf(stderr, "%s: cannot write the log: %s\n", l->path, strerror(errno));
        exit(EXIT_FAILURE);
    }
}

static inline void logger_log_val(Logger* l, int step, float val_loss) {
    if (!l->active) return;
    fprintf(l->file, "s:%d tel:%.4f\n", step, val_loss);
    logger_flush_line(l);
}

static inline void logger_log_train(Logger* l, int step, float train_loss, float norm, float learning_rate, float ms,
                                    float mfu_percent, float tokens_per_second) {
    if (!l->active) return;
    fprintf(l->file, "s:%d trl:%.4f norm:%.4f lr:%.6e ms:%.2f", step, train_loss, norm, learning_rate, ms);
    if (mfu_percent >= 0.0f) fprintf(l->file, " mfu:%.2f", mfu_percent);
    fprintf(l->file, " tok/s:%.0f\n", tokens_per_second);
    logger_flush_line(l);
}

static inline void logger_log_text(Logger* l, const char* line) {
    if (!l->active) return;
    fprintf(l->file, "%s\n", line);
    logger_flush_line(l);
}

static inline void logger_free(Logger* l) {
    if (l->file != NULL) fclose_check(l->file, l->path);
    l->file = NULL;
    l->active = 0;
    free(l->path);
    l->path = NULL;
}
