// llmc/output_lock.h: one run at a time in an output directory (-o), and one run per directory: a fresh run into a
// directory that holds another run's files is refused, and a directory in which the checkpoints' names cannot be
// created is refused before training. Used by train_gpt.cu (and through it train_moe.cu); tested by
// dev/test/test_train_gpt.sh (a second run into a held or used directory, names of any length).
#pragma once
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/file.h>
#include <unistd.h>
#include "utils.h"

// One run at a time writes into an output directory: process 0 holds an exclusive flock on <dir>/train.lock (with
// its pid in it) for as long as it lives, and a second run is refused naming the holder. The kernel drops the lock
// when the process ends, however it ends, so a crashed run leaves no stale lock behind.
static void lock_output_dir(const char* dir) {
    create_dir_if_not_exists(dir);
    char* path = string_format("%s/train.lock", dir);  // kept for the life of the process, as the lock
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

// A fresh run (without -y 1) into a directory that holds another run's log or checkpoint files would mix the two: a
// later -y 1 would resume the other run. Refused, naming what is there and the ways on (-y 1, or a new -o).
static void refuse_used_output_dir(const char* dir) {
    DIR* d = opendir(dir);
    if (d == NULL) return;
    const char* kinds[] = {"main.log", "DONE_", "model_", "state_", "expert_state_"};
    char* found = NULL;
    struct dirent* e;
    while (found == NULL && (e = readdir(d)) != NULL)
        for (size_t k = 0; k < sizeof(kinds) / sizeof(kinds[0]) && found == NULL; k++)
            if (strncmp(e->d_name, kinds[k], strlen(kinds[k])) == 0 && strstr(e->d_name, ".tmp") == NULL)
                found = string_format("%s", e->d_name);  // (a temporary is what an interrupted write left)
    closedir(d);
    if (found == NULL) return;
    fprintf(stderr, "-o %s: holds another run (%s): resume it with -y 1, or give a new -o\n", dir, found);
    exit(EXIT_FAILURE);
}

// The checkpoints' longest name (expert_state_%08d.bin.tmp) must be one the file system accepts in dir: a directory
// path it refuses would otherwise fail at the first checkpoint, after the training it was to keep. Refused with the
// path whole, before any training.
static void check_output_names(const char* dir) {
    char* probe = string_format("%s/expert_state_%08d.bin.tmp", dir, 99999999);
    int fd = open(probe, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0 && errno != EEXIST) {
        fprintf(stderr, "-o %s: cannot create the checkpoints' files in it (%s: %s)\n", dir, probe, strerror(errno));
        exit(EXIT_FAILURE);
    }
    if (fd >= 0) {
        close(fd);
        unlink(probe);
    }
    free(probe);
}
