// llmc/output_lock.h: one run at a time in an output directory (-o). Used by train_gpt.cu (and through it
// train_moe.cu); tested by dev/test/test_train_gpt.sh (a second run into a held directory is refused).
#pragma once
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>
#include "utils.h"

// One run at a time writes into an output directory: process 0 holds an exclusive flock on <dir>/train.lock (with
// its pid in it) for as long as it lives, and a second run is refused naming the holder. The kernel drops the lock
// when the process ends, however it ends, so a crashed run leaves no stale lock behind.
static void lock_output_dir(const char* dir) {
    create_dir_if_not_exists(dir);
    char path[1100];
    snprintf(path, sizeof(path), "%s/train.lock", dir);
    int fd = open(path, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0) {
        fprintf(stderr, "-o %s: cannot open the lock file %s: %s\n", dir, path, strerror(errno));
        exit(EXIT_FAILURE);
    }
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        char holder[32] = "";
        ssize_t got = pread(fd, holder, sizeof(holder) - 1, 0);
        holder[got > 0 ? got : 0] = '\0';
        holder[strcspn(holder, "\n")] = '\0';
        fprintf(stderr, "-o %s: in use by another run (pid %s holds %s)\n", dir, holder[0] ? holder : "unknown", path);
        exit(EXIT_FAILURE);
    }
    char pid[32];
    int n = snprintf(pid, sizeof(pid), "%d\n", (int)getpid());
    if (ftruncate(fd, 0) != 0 || pwrite(fd, pid, n, 0) != n) {
        fprintf(stderr, "-o %s: cannot write %s: %s\n", dir, path, strerror(errno));
        exit(EXIT_FAILURE);
    }
    // fd stays open (and locked) until the process exits
}
