// llmc/preemption.h: pre-emption. Clusters (Slurm, Kubernetes) send SIGTERM, or a chosen signal such as SIGUSR1
// (Slurm's --signal=USR1@120), some time before they kill a job. The trainers catch both: the handler only notes the
// signal, the step in progress finishes, and at the next step boundary every process learns whether any of them was
// signalled through one collective that all of them reach (so a signal to one process stops them all at the same
// step). The job then writes a complete checkpoint (with -o), says so in one line and exits with status 128 + the
// signal's number (143 for SIGTERM, 138 for SIGUSR1), as if the signal had ended it; -y 1 resumes bit-identically.
// A second signal while the checkpoint is written is noted and changes nothing: the checkpoint completes, and the
// previous complete one stays intact until it has (llmc/checkpoint.h). Used by train_gpt.cu (and through it
// train_moe.cu); tested by dev/test/test_train_gpt.sh (SIGTERM on one and on two processes, a second signal).
#pragma once
#include <signal.h>
#include <string.h>
#include "multi_gpu.cuh"

static volatile sig_atomic_t preemption_signal_received = 0;

static void preemption_note_signal(int signal_number) { preemption_signal_received = signal_number; }

// SIGTERM and SIGUSR1 from here on only note themselves (system calls they interrupt are restarted)
static void preemption_install(void) {
    struct sigaction action;
    memset(&action, 0, sizeof(action));
    action.sa_handler = preemption_note_signal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    sigaction(SIGTERM, &action, NULL);
    sigaction(SIGUSR1, &action, NULL);
}

// At a step boundary (collective over all processes of `world`): 0, or the signal the job stops for: SIGTERM if any
// process got one, else SIGUSR1 if any did. Every process returns the same.
static int preemption_agreed(const MultiGpuConfig* world) {
    int mine = preemption_signal_received;
    if (multi_gpu_cpu_float_sum(mine != 0 ? 1.0f : 0.0f, world) == 0.0f) return 0;
    return multi_gpu_cpu_float_sum(mine == SIGTERM ? 1.0f : 0.0f, world) > 0.0f ? SIGTERM : SIGUSR1;
}
