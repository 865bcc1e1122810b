// llmc/utils.h: checked file and memory helpers for the host side of the trainers. Every failure prints
// ONE line on stderr naming the file (or the allocation) and what was expected, then exits with
// EXIT_FAILURE: a training run must never continue on a short read or a garbage header.
// Checkpoints are written atomically (fopen_tmp_for + commit_tmp) so that a crash while saving leaves the
// previous checkpoint intact instead of a truncated one.
// Header-only; include it from a .cu (nvcc or cpu/cucc). Tested by dev/test/test_host_utils.cu.
#pragma once
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

// (a directory opens for reading, and would read as an empty file: refused by name)
static inline FILE* fopen_check(const char* path, const char* mode) {
    struct stat st;
    if (mode[0] == 'r' && stat(path, &st) == 0 && S_ISDIR(st.st_mode)) {
        fprintf(stderr, "%s: is a directory, not a file\n", path);
        exit(EXIT_FAILURE);
    }
    FILE* f = fopen(path, mode);
    if (f == NULL) {
        fprintf(stderr, "cannot open %s (mode \"%s\"): %s\n", path, mode, strerror(errno));
        exit(EXIT_FAILURE);
    }
    return f;
}

// printf into memory of its own, as long as it takes (the caller frees it): paths of any length
static inline char* string_format(const char* format, ...) __attribute__((format(printf, 1, 2)));
static inline char* string_format(const char* format, ...) {
    va_list args;
    va_start(args, format);
    int n = vsnprintf(NULL, 0, format, args);
    va_end(args);
    char* out = n >= 0 ? (char*)malloc((size_t)n + 1) : NULL;
    if (out == NULL) {
        fprintf(stderr, "out of host memory for a string of %d characters (format \"%s\")\n", n, format);
        exit(EXIT_FAILURE);
    }
    va_start(args, format);
    vsnprintf(out, (size_t)n + 1, format, args);
    va_end(args);
    return out;
}

// to byte `offset` from the file's start (64-bit: optimizer states pass 2 GiB)
static inline void fseek_check(FILE* f, size_t offset, const char* path) {
    if (fseeko(f, (off_t)offset, SEEK_SET) != 0) {
        fprintf(stderr, "%s: cannot seek to byte %zu: %s\n", path, offset, strerror(errno));
        exit(EXIT_FAILURE);
    }
}

static inline void fread_check(void* ptr, size_t size, size_t nmemb, FILE* f, const char* path) {
    long offset = ftell(f);
    size_t got = fread(ptr, size, nmemb, f);
    if (got != nmemb) {
        if (ferror(f)) {
            fprintf(stderr, "%s: read error at offset %ld: %s\n", path, offset, strerror(errno));
        } else {
            fprintf(stderr, "%s is truncated: expected %zu bytes at offset %ld\n", path, size * nmemb, offset);
        }
        exit(EXIT_FAILURE);
    }
}

static inline void fwrite_check(const void* ptr, size_t size, size_t nmemb, FILE* f, const char* path) {
    long offset = ftell(f);
    if (fwrite(ptr, size, nmemb, f) != nmemb) {
        fprintf(stderr, "%s: cannot write %zu bytes at offset %ld: %s\n", path, size * nmemb, offset, strerror(errno));
        exit(EXIT_FAILURE);
    }
}

// fclose flushes what stdio buffered, so a full disk often shows up only here
static inline void fclose_check(FILE* f, const char* path) {
    if (fclose(f) != 0) {
        fprintf(stderr, "%s: cannot close (data may not have been written): %s\n", path, strerror(errno));
        exit(EXIT_FAILURE);
    }
}

static inline void* malloc_check(size_t size) {
    void* p = malloc(size > 0 ? size : 1);  // malloc(0) may return NULL, which is not an error
    if (p == NULL) {
        fprintf(stderr, "out of host memory: cannot allocate %zu bytes\n", size);
        exit(EXIT_FAILURE);
    }
    return p;
}

// malloc_check naming what the memory is for and the file it comes from, for sizes a file decides
static inline void* malloc_for(size_t size, const char* what, const char* path) {
    void* p = malloc(size > 0 ? size : 1);
    if (p == NULL) {
        fprintf(stderr, "%s: out of host memory: cannot allocate %zu bytes for %s\n", path, size, what);
        exit(EXIT_FAILURE);
    }
    return p;
}

// Reads the 256-int32 header every file of the project starts with and checks its magic number.
static inline void read_header_check(FILE* f, int header[256], const char* path, int magic, const char* what) {
    size_t got = fread(header, sizeof(int), 256, f);
    if (got != 256) {
        fprintf(stderr, "%s is truncated: expected a 1024-byte %s header, found %zu bytes\n", path, what,
                got * sizeof(int));
        exit(EXIT_FAILURE);
    }
    if (header[0] != magic) {
        fprintf(stderr, "%s: not a %s file (magic %d, expected %d)\n", path, what, header[0], magic);
        exit(EXIT_FAILURE);
    }
}

// read_header_check, then word 1 against the one version the reader knows.
static inline void read_versioned_header_check(FILE* f, int header[256], const char* path, int magic, int version,
                                               const char* what) {
    read_header_check(f, header, path, magic, what);
    if (header[1] != version) {
        fprintf(stderr, "%s: unsupported %s version %d (expected %d)\n", path, what, header[1], version);
        exit(EXIT_FAILURE);
    }
}

// Opens "<final_path>.tmp" for writing; *tmp_path receives that name (the caller frees it) for commit_tmp. A stale
// temporary (an interrupted write) is removed first and the new one is created exclusively, without following a
// symlink: fopen "wb" would write through a link planted at the temporary name into whatever file it points to.
static inline FILE* fopen_tmp_for(const char* final_path, char** tmp) {
    char* tmp_path = string_format("%s.tmp", final_path);
    *tmp = tmp_path;
    if (unlink(tmp_path) != 0 && errno != ENOENT) {
        fprintf(stderr, "cannot remove the stale temporary file %s: %s\n", tmp_path, strerror(errno));
        exit(EXIT_FAILURE);
    }
    int fd = open(tmp_path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0) {
        fprintf(stderr, "cannot create %s: %s\n", tmp_path, strerror(errno));
        exit(EXIT_FAILURE);
    }
    FILE* f = fdopen(fd, "wb");
    if (f == NULL) {
        fprintf(stderr, "cannot open %s for writing: %s\n", tmp_path, strerror(errno));
        exit(EXIT_FAILURE);
    }
    return f;
}

// Makes the temporary file durable, then renames it over final_path: rename is atomic, so readers see
// either the old file or the complete new one. The directory is synced too, or the rename itself could
// be lost in a crash.
static inline void commit_tmp(FILE* f, const char* tmp_path, const char* final_path) {
    if (fflush(f) != 0 || fsync(fileno(f)) != 0) {
        fprintf(stderr, "%s: cannot flush to disk: %s\n", tmp_path, strerror(errno));
        exit(EXIT_FAILURE);
    }
    fclose_check(f, tmp_path);
    if (rename(tmp_path, final_path) != 0) {
        fprintf(stderr, "cannot rename %s to %s: %s\n", tmp_path, final_path, strerror(errno));
        exit(EXIT_FAILURE);
    }
    const char* slash = strrchr(final_path, '/');
    char* dir = slash == NULL ? string_format(".") : slash == final_path ? string_format("/")
                                                   : string_format("%.*s", (int)(slash - final_path), final_path);
    int dir_fd = open(dir, O_RDONLY);
    if (dir_fd >= 0) {  // some file systems refuse to open or sync a directory; the rename has happened anyway
        fsync(dir_fd);
        close(dir_fd);
    }
    free(dir);
}

static inline void create_dir_if_not_exists(const char* dir) {
    if (mkdir(dir, 0755) == 0) return;
    int err = errno;
    struct stat st;
    if (err == EEXIST && stat(dir, &st) == 0 && S_ISDIR(st.st_mode)) return;
    if (err == EEXIST) {
        fprintf(stderr, "%s exists but is not a directory\n", dir);
    } else {
        fprintf(stderr, "cannot create directory %s: %s\n", dir, strerror(err));
    }
    exit(EXIT_FAILURE);
}
