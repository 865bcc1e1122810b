// llmc/schedulers.h: the learning-rate schedule (flag -k): cosine, linear, constant or wsd
// (warmup-stable-decay). All four warm up linearly over the first warmup_iterations steps, from lr/warmup
// at step 0 to lr at step warmup-1; the training steps are 0 .. train_num_batches-1 and every decaying
// schedule reaches lr * final_learning_rate_frac exactly at the last one, step train_num_batches-1.
// Later steps keep the final value. wsd holds lr, then decays linearly over the last 20% of the steps.
// Header-only: #include it from a .cu (built by nvcc or cpu/cucc). Tested by dev/test/test_host_utils.cu.
#pragma once
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef enum { LR_COSINE, LR_LINEAR, LR_CONSTANT, LR_WSD } LearningRateSchedule;

typedef struct {
    LearningRateSchedule schedule;
    float learning_rate;
    int warmup_iterations;
    int train_num_batches;
    float final_learning_rate_frac;
} LearningRateScheduler;

static inline void lr_scheduler_init(LearningRateScheduler* s, const char* type, float learning_rate,
                                     int warmup_iterations, int train_num_batches, float final_learning_rate_frac) {
    if (strcmp(type, "cosine") == 0) {
        s->schedule = LR_COSINE;
    } else if (strcmp(type, "linear") == 0) {
        s->schedule = LR_LINEAR;
    } else if (strcmp(type, "constant") == 0) {
        s->schedule = LR_CONSTANT;
    } else if (strcmp(type, "wsd") == 0) {
        s->schedule = LR_WSD;
    } else {
        fprintf(stderr, "unknown learning rate scheduler '%s' (expected cosine, linear, constant or wsd)\n", type);
        exit(EXIT_FAILURE);
    }
    if (!(learning_rate >= 0.0f) || !isfinite(learning_rate)) {
        fprintf(stderr, "learning rate %g: expected a finite value >= 0\n", learning_rate);
        exit(EXIT_FAILURE);
    }
    if (warmup_iterations < 0) {
        fprintf(stderr, "warmup iterations %d: expected a value >= 0\n", warmup_iterations);
        exit(EXIT_FAILURE);
    }
    if (train_num_batches < 1) {
        fprintf(stderr, "learning rate schedule over %d steps: expected at least 1 training step\n", train_num_batches);
        exit(EXIT_FAILURE);
    }
    if (!(final_learning_rate_frac >= 0.0f && final_learning_rate_frac <= 1.0f)) {
        fprintf(stderr, "final learning rate fraction %g: expected a value in [0, 1]\n", final_learning_rate_frac);
        exit(EXIT_FAILURE);
    }
    s->learning_rate = learning_rate;
    s->warmup_iterations = warmup_iterations;
    s->train_num_batches = train_num_batches;
    s->final_learning_rate_frac = final_learning_rate_frac;
}

static inline float lr_scheduler_get(const LearningRateScheduler* s, int step) {
    const double lr = s->learning_rate;
    const double min_lr = lr * s->final_learning_rate_frac;
    const int warmup = s->warmup_iterations;
    const int last_step = s->train_num_batches - 1;
    if (step < warmup) return (float)(lr * (step + 1) / warmup);
    if (s->schedule == LR_CONSTANT) return (float)lr;
    if (s->schedule == LR_WSD) {
        // the decay takes the last 20% of the steps (at least one), ending at min_lr on the last step
        int decay_steps = s->train_num_batches / 5 > 0 ? s->train_num_batches / 5 : 1;
        int decay_start = s->train_num_batches - decay_steps;
        if (step < decay_start) return (float)lr;
        double progress = step >= last_step ? 1.0 : (double)(step - decay_start + 1) / decay_steps;
        return (float)(lr - (lr - min_lr) * progress);
    }
    // cosine and linear decay from lr right after the warmup to min_lr on the last step
    double progress = step >= last_step ? 1.0 : (double)(step - warmup) / (last_step - warmup);
    if (s->schedule == LR_LINEAR) return (float)(lr - (lr - min_lr) * progress);
    return (float)(min_lr + 0.5 * (1.0 + cos(M_PI * progress)) * (lr - min_lr));
}
