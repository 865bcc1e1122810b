// dev/test/test_common.h: the small check-and-count harness shared by the backend tests in dev/test/.
// A test binary calls check()/check_close() as often as it likes and ends with
// `return test_summary("name");`, which prints "name: N passed, N failed" and exits non-zero on any failure.
// Inputs come from a seeded xorshift generator so a failure reproduces; outputs are poisoned with NaN
// (poison_f32) before the code under test writes them, so an element it forgets to write cannot pass.
#pragma once
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

static int tests_passed = 0;
static int tests_failed = 0;

// One named check. Prints the failure with its printf-style description.
static void check(int ok, const char* fmt, ...) {
    if (ok) { tests_passed++; return; }
    tests_failed++;
    va_list ap;
    va_start(ap, fmt);
    printf("FAIL: ");
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
    fflush(stdout);
}

// Compares got[i] with want[i] (want in double, from a plain host loop): |got - want| <= atol + rtol * |want|.
// NaN or inf in got always fails. Counts as one check; prints the first 5 mismatches.
static void check_close(const char* what, const float* got, const double* want, size_t n, double atol, double rtol) {
    size_t bad = 0;
    double worst = 0.0;
    for (size_t i = 0; i < n; i++) {
        double g = (double)got[i];
        double err = fabs(g - want[i]);
        int ok = isfinite(g) && err <= atol + rtol * fabs(want[i]);
        if (!ok) {
            if (bad < 5) printf("  %s[%zu]: got %.9g, want %.9g (err %.3g)\n", what, i, g, want[i], err);
            bad++;
        }
        if (isfinite(err) && err > worst) worst = err;
    }
    check(bad == 0, "%s: %zu of %zu elements outside atol %.2g rtol %.2g (max err %.3g)", what, bad, n, atol, rtol, worst);
}

// xorshift64*: deterministic, seedable, good enough for test inputs.
static uint64_t test_rng_state = 0x9E3779B97F4A7C15ull;
static void test_seed(uint64_t seed) { test_rng_state = seed ? seed : 0x9E3779B97F4A7C15ull; }
static uint32_t test_rand_u32(void) {
    test_rng_state ^= test_rng_state >> 12;
    test_rng_state ^= test_rng_state << 25;
    test_rng_state ^= test_rng_state >> 27;
    return (uint32_t)((test_rng_state * 0x2545F4914F6CDD1Dull) >> 32);
}
// uniform in [lo, hi)
static float test_rand_uniform(float lo, float hi) { return lo + (hi - lo) * (float)(test_rand_u32() >> 8) / 16777216.0f; }
static void fill_uniform(float* x, size_t n, float lo, float hi) {
    for (size_t i = 0; i < n; i++) x[i] = test_rand_uniform(lo, hi);
}
static void poison_f32(float* x, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] = NAN;
}

static int test_summary(const char* name) {
    printf("%s: %d passed, %d failed\n", name, tests_passed, tests_failed);
    fflush(stdout);
    return tests_failed == 0 && tests_passed > 0 ? 0 : 1;
}

// Runs this program again as `self mode` (a fresh process: fork without exec would inherit OpenMP's
// thread pool in an unusable state) and checks that it fails — killed by a signal or a non-zero exit —
// with every string of `needles` (a NULL-terminated list) in what it wrote to stderr.
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>
static void expect_child_failure(const char* self, const char* mode, const char* const* needles) {
    int pipefd[2];
    if (pipe(pipefd) != 0) { check(0, "%s: pipe failed", mode); return; }
    pid_t pid = fork();
    if (pid == 0) {
        dup2(pipefd[1], 2);
        close(pipefd[0]);
        close(pipefd[1]);
        execl(self, self, mode, (char*)NULL);
        _exit(127);
    }
    close(pipefd[1]);
    static char err[1 << 16];
    size_t len = 0;
    ssize_t r;
    while ((r = read(pipefd[0], err + len, sizeof(err) - 1 - len)) > 0) len += (size_t)r;
    err[len] = 0;
    close(pipefd[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    int failed = WIFSIGNALED(status) || (WIFEXITED(status) && WEXITSTATUS(status) != 0 && WEXITSTATUS(status) != 127);
    int found = 1;
    for (const char* const* n = needles; *n; n++)
        if (!strstr(err, *n)) {
            found = 0;
            printf("  %s: stderr lacks \"%s\"\n", mode, *n);
        }
    check(failed && found, "%s: the program must fail with the expected message%s%s", mode,
          failed ? "" : " (it did not fail)", found ? "" : " (message differs, stderr follows)");
    if (!(failed && found)) printf("---- stderr of %s ----\n%s\n----\n", mode, err);
}
