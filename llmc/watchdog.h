// llmc/watchdog.h: the trainers' collective watchdog (-wt SECONDS), and the test hook that makes a process stand
// still so that the watchdog has something to catch. Used by train_gpt.cu (and through it train_moe.cu); tested by
// dev/test/test_train_gpt.sh (a stopped rank: the others name the phase and end the job).
#pragma once
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#include "multi_gpu.cuh"

// The collective watchdog (-wt SECONDS): with several processes, a process that stops (a hung GPU, a stopped or
// lost node) leaves the others waiting forever inside an NCCL call. The training loop marks each phase that waits
// on the others (watchdog_begin: what and at which step; watchdog_end), and a thread checks every 100 ms that no
// phase has lasted longer than the limit; if one has, it names it and ends the whole job: ncclCommAbort on a GPU,
// then MPI_Abort (the CPU backend's NCCL is MPI, which MPI_Abort ends with every process of the job).
typedef struct {
    double limit_s;
    MultiGpuConfig* mg;
    const char* op;      // the phase in progress, NULL between phases (written by the loop, read by the thread)
    int step;
    long long start_ns;  // when it began
} Watchdog;
static Watchdog watchdog = {0.0, NULL, NULL, 0, 0};

static long long watchdog_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000ll + t.tv_nsec;
}

static void watchdog_begin(const char* op, int step) {
    // start before op: a thread that sees the new op also sees its start
    __atomic_store_n(&watchdog.step, step, __ATOMIC_RELAXED);
    __atomic_store_n(&watchdog.start_ns, watchdog_now_ns(), __ATOMIC_RELAXED);
    __atomic_store_n(&watchdog.op, op, __ATOMIC_RELEASE);
}

static void watchdog_end(void) { __atomic_store_n(&watchdog.op, (const char*)NULL, __ATOMIC_RELEASE); }

static void* watchdog_thread(void*) {
    for (;;) {
        usleep(100000);
        const char* op = __atomic_load_n(&watchdog.op, __ATOMIC_ACQUIRE);
        if (op == NULL) continue;
        long long start = __atomic_load_n(&watchdog.start_ns, __ATOMIC_RELAXED);
        if ((watchdog_now_ns() - start) * 1e-9 <= watchdog.limit_s) continue;
        if (op != __atomic_load_n(&watchdog.op, __ATOMIC_ACQUIRE)) continue;  // it has just ended
        fprintf(stderr, "watchdog: process %d, step %d: %s did not complete within %.0f s (-wt): another process is "
                "stuck or gone; aborting the job\n", watchdog.mg->process_rank, __atomic_load_n(&watchdog.step,
                __ATOMIC_RELAXED), op, watchdog.limit_s);
        fflush(stdout);
#ifndef __CUCC__
        ncclCommAbort(watchdog.mg->nccl_comm);  // frees the GPU's NCCL kernels (the CPU backend's NCCL is MPI)
        if (!watchdog.mg->used_mpi) _exit(EXIT_FAILURE);
#endif
        MPI_Abort(MPI_COMM_WORLD, EXIT_FAILURE);
        _exit(EXIT_FAILURE);
    }
    return NULL;
}

static void watchdog_start(MultiGpuConfig* mg, int limit_s) {
    if (limit_s <= 0 || mg->num_processes == 1) return;  // alone, nothing can stall a collective
    watchdog.limit_s = limit_s;
    watchdog.mg = mg;
    pthread_t thread;
    if (pthread_create(&thread, NULL, watchdog_thread, NULL) != 0) {
        fprintf(stderr, "-wt %d: cannot start the watchdog thread\n", limit_s);
        exit(EXIT_FAILURE);
    }
    pthread_detach(thread);
}


// A test hook (dev/test/test_train_gpt.sh): TRAIN_TEST_STOP_AT_STEP=N stops (SIGSTOP) the process of rank
// TRAIN_TEST_STOP_RANK (default 0) before training step N, as a hung or crashed process would stand still.
static void test_hook_stop(int step, int rank) {
    const char* at = getenv("TRAIN_TEST_STOP_AT_STEP");
    const char* who = getenv("TRAIN_TEST_STOP_RANK");
    if (at == NULL || atoi(at) != step || (who != NULL ? atoi(who) : 0) != rank) return;
    fprintf(stderr, "TRAIN_TEST_STOP_AT_STEP: process %d stops before step %d\n", rank, step);
    raise(SIGSTOP);
}
