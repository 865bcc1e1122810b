// cpu/test/test_fast_math.cu: the CPU backend's GPU numerics (doc/backend.md, "Fast math").
// Built twice (Makefile): plain, where every function must give the exact libm result bit for bit and subnormals
// survive, and with --use_fast_math, where in kernels
//  - each emulated function (tanhf, expf/__expf, exp2f, __exp10f, logf/__logf, log2f/__log2f, sinf/cosf/__sinf/
//    __cosf/__sincosf, powf/__powf, sqrtf, rsqrtf, __fdividef) stays within the error the PTX ISA documents for
//    the instruction nvcc emits, measured against double-precision references on random and edge inputs, AND
//    reaches at least half of it (the emulation is not secretly exact);
//  - subnormal inputs and results are flushed (-ftz=true), on every OpenMP thread that runs blocks;
//  - host code of the same program stays exact (same functions, same TU) and keeps subnormals;
//  - results are identical run to run.
// Prints "test_fast_math: N passed, N failed" last.
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cuda_runtime.h>
#include "test_common.h"


static uint64_t rng = 0x9E3779B97F4A7C15ull;
static double uniform(double lo, double hi) {
    rng ^= rng >> 12;
    rng ^= rng << 25;
    rng ^= rng >> 27;
    return lo + (hi - lo) * (double)((rng * 0x2545F4914F6CDD1Dull) >> 11) / 9007199254740992.0;
}
static float log_uniform(double lo_exp, double hi_exp, int random_sign) {
    float v = (float)exp2(uniform(lo_exp, hi_exp));
    return random_sign && uniform(0, 1) < 0.5 ? -v : v;
}
static uint32_t bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

enum Fn { TANHF, TANHF_I, EXPF, EXPF_I, EXP2F, EXP10F_I, LOGF, LOGF_I, LOG2F, LOG2F_I, SINF, COSF, SINF_I, COSF_I,
          SINCOSF_S, SINCOSF_C, POWF, POWF_I, SQRTF, RSQRTF, FDIVIDEF, NFN };
static const char* fn_name[NFN] = {"tanhf", "__tanhf", "expf", "__expf", "exp2f", "__exp10f", "logf", "__logf",
                                   "log2f", "__log2f", "sinf", "cosf", "__sinf", "__cosf", "__sincosf(sin)",
                                   "__sincosf(cos)", "powf", "__powf", "sqrtf", "rsqrtf", "__fdividef"};

// The functions as device code (or host code: the same calls) writes them. With nvcc the intrinsics are device
// functions only, so there apply is too, and the host-side comparison (CPU backend only) is left out.
#ifdef __CUCC__
__host__ __device__ static float apply(int f, float x, float y) {
#else
__device__ static float apply(int f, float x, float y) {
#endif
    float s, c;
    switch (f) {
        case TANHF: return tanhf(x);
        case TANHF_I: return __tanhf(x);
        case EXPF: return expf(x);
        case EXPF_I: return __expf(x);
        case EXP2F: return exp2f(x);
        case EXP10F_I: return __exp10f(x);
        case LOGF: return logf(x);
        case LOGF_I: return __logf(x);
        case LOG2F: return log2f(x);
        case LOG2F_I: return __log2f(x);
        case SINF: return sinf(x);
        case COSF: return cosf(x);
        case SINF_I: return __sinf(x);
        case COSF_I: return __cosf(x);
        case SINCOSF_S: __sincosf(x, &s, &c); return s;
        case SINCOSF_C: __sincosf(x, &s, &c); return c;
        case POWF: return powf(x, y);
        case POWF_I: return __powf(x, y);
        case SQRTF: return sqrtf(x);
        case RSQRTF: return rsqrtf(x);
        case FDIVIDEF: return __fdividef(x, y);
    }
    return 0.0f;
}

// libm's exact results, called past any macro
static float exact_libm(int f, float x, float y) {
    switch (f) {
        case TANHF: case TANHF_I: return (tanhf)(x);
        case EXPF: case EXPF_I: return (expf)(x);
        case EXP2F: return (exp2f)(x);
        case EXP10F_I: return (exp10f)(x);
        case LOGF: case LOGF_I: return (logf)(x);
        case LOG2F: case LOG2F_I: return (log2f)(x);
        case SINF: case SINF_I: case SINCOSF_S: return (sinf)(x);
        case COSF: case COSF_I: case SINCOSF_C: return (cosf)(x);
        case POWF: case POWF_I: return (powf)(x, y);
        case SQRTF: return (sqrtf)(x);
        case RSQRTF: return 1.0f / (sqrtf)(x);
        case FDIVIDEF: return x / y;
    }
    return 0.0f;
}

__global__ void apply_kernel(int f, const float* x, const float* y, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = apply(f, x[i], y[i]);
}

// subnormals: out[i] = x[i] * y[i] and out[n + i] = x[i] + 0 (a subnormal input passed through an add)
__global__ void subnormal_kernel(const float* x, const float* y, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out[i] = x[i] * y[i];
        out[n + i] = x[i] + 0.0f;
    }
}

static const int N = 1 << 15;

// Runs function f on the device over (x, y); returns the results in out.
static void run_device(int f, const float* x, const float* y, float* out, int n) {
    float *dx, *dy, *dout;
    cudaMalloc(&dx, n * sizeof(float));
    cudaMalloc(&dy, n * sizeof(float));
    cudaMalloc(&dout, n * sizeof(float));
    cudaMemcpy(dx, x, n * sizeof(float), cudaMemcpyHostToDevice);
    cudaMemcpy(dy, y, n * sizeof(float), cudaMemcpyHostToDevice);
    apply_kernel<<<(n + 127) / 128, 128>>>(f, dx, dy, dout, n);
    cudaMemcpy(out, dout, n * sizeof(float), cudaMemcpyDeviceToHost);
    cudaFree(dx);
    cudaFree(dy);
    cudaFree(dout);
}

// Inputs for each function: random over its domain plus edge values.
static int make_inputs(int f, float* x, float* y) {
    int n = 0;
    for (int i = 0; i < N; i++) {
        float a = 0.0f, b = 1.0f;
        switch (f) {
            case TANHF: case TANHF_I:
                a = i % 2 ? (float)uniform(-10, 10) : log_uniform(-20, 3, 1);
                break;
            case EXPF: case EXPF_I:
                a = i % 2 ? (float)uniform(-87, 88) : (float)uniform(-1, 1);
                break;
            case EXP2F: a = (float)uniform(-125, 127); break;
            case EXP10F_I: a = (float)uniform(-37, 38); break;
            case LOGF: case LOGF_I: case LOG2F: case LOG2F_I:
                a = i % 2 ? log_uniform(-125, 127, 0) : (float)uniform(0.5, 2.0);
                break;
            case SINF: case COSF: case SINF_I: case COSF_I: case SINCOSF_S: case SINCOSF_C:
                a = i % 2 ? (float)uniform(-2 * M_PI, 2 * M_PI) : (float)uniform(-100 * M_PI, 100 * M_PI);
                break;
            case POWF: case POWF_I:
                a = log_uniform(-4, 4, 0);
                b = (float)uniform(-4, 4);
                break;
            case SQRTF: case RSQRTF: a = log_uniform(-125, 127, 0); break;
            case FDIVIDEF:
                a = log_uniform(-60, 60, 1);
                b = log_uniform(-60, 60, 1);
                break;
        }
        x[n] = a;
        y[n] = b;
        n++;
    }
    return n;
}

#if CUCC_FAST_MATH  // only the fast-math build measures against the documented bounds
// one fp32 ulp at v's magnitude (normal range)
static double ulp_of(double v) {
    int e;
    frexp(fabs(v), &e);
    if (e < -125) e = -125;
    return ldexp(1.0, e - 24);
}

static double reference(int f, double x, double y) {
    switch (f) {
        case TANHF: case TANHF_I: return tanh(x);
        case EXPF: case EXPF_I: return exp(x);
        case EXP2F: return exp2(x);
        case EXP10F_I: return pow(10.0, x);
        case LOGF: case LOGF_I: return log(x);
        case LOG2F: case LOG2F_I: return log2(x);
        case SINF: case SINF_I: case SINCOSF_S: return sin(x);
        case COSF: case COSF_I: case SINCOSF_C: return cos(x);
        case POWF: case POWF_I: return pow(x, y);
        case SQRTF: return sqrt(x);
        case RSQRTF: return 1.0 / sqrt(x);
        case FDIVIDEF: return x / y;
    }
    return 0.0;
}

// The documented bound for one result, as the error measure it is stated in; *kind names the measure. Returns
// the error and stores the bound.
static double error_and_bound(int f, double x, double y, double got, double* bound, const char** kind) {
    double ref = reference(f, x, y);
    double err = fabs(got - ref);
    double rel = ref != 0.0 ? err / fabs(ref) : err;
    switch (f) {
        case TANHF: case TANHF_I:  // tanh.approx.f32: relative 2^-11
            *kind = "relative";
            *bound = ldexp(1.0, -11);
            return rel;
        case EXP2F:  // ex2.approx: 2 ulp from the correctly rounded result
            *kind = "ulp from the correctly rounded result";
            *bound = 2.0;
            return fabs(got - (double)(float)ref) / ulp_of((float)ref);
        case EXPF: case EXPF_I: case EXP10F_I: {
            // ex2 (2 ulp from correctly rounded, 2.5 from exact) of t = x * log2(b) rounded to fp32: the product's
            // rounding and the constant's add 1.5 |t| ln2 2^-24 relative, i.e. 1.5 |t| ln2 ulp at most
            double t = f == EXP10F_I ? x * log2(10.0) : x * M_LOG2E;
            *kind = "ulp (2.5 + 1.5 |t| ln 2)";
            *bound = 2.5 + 1.5 * fabs(t) * M_LN2 + 1e-9;
            return err / ulp_of(ref);
        }
        case LOG2F: case LOG2F_I:  // lg2.approx: absolute 2^-22 in (0.5, 2), relative 2^-22 outside
            if (x > 0.5 && x < 2.0) {
                *kind = "absolute in (0.5, 2)";
                *bound = ldexp(1.0, -22);
                return err;
            }
            *kind = "relative outside (0.5, 2)";
            *bound = ldexp(1.0, -22);
            return rel;
        case LOGF: case LOGF_I:  // lg2.approx times ln 2 in fp32: the lg2 bound plus the product's rounding
            if (x > 0.5 && x < 2.0) {
                *kind = "absolute in (0.5, 2)";
                *bound = ldexp(1.0, -22) * M_LN2 + ldexp(1.0, -24);  // the product's and ln 2's roundings
                return err;
            }
            *kind = "relative outside (0.5, 2)";
            *bound = ldexp(1.0, -22) + ldexp(1.0, -24) + ldexp(1.0, -25);
            return rel;
        case SINF: case COSF: case SINF_I: case COSF_I: case SINCOSF_S: case SINCOSF_C:
            // sin/cos.approx: absolute 2^-20.5 in [-2pi, 2pi], 2^-14.7 in [-100pi, 100pi]
            if (fabs(x) <= 2 * M_PI) {
                *kind = "absolute in [-2pi, 2pi]";
                *bound = exp2(-20.5);
            } else {
                *kind = "absolute in [-100pi, 100pi]";
                *bound = exp2(-14.7);
            }
            return err;
        case POWF: case POWF_I: {
            // ex2(y * lg2(x)): ex2's 2.5 ulp, lg2's error times |y|, the product's rounding
            double l = log2(x);
            double lg2_err = (x > 0.5 && x < 2.0) ? ldexp(1.0, -22) : ldexp(fabs(l), -22);
            *kind = "relative (ex2, lg2 and product errors)";
            *bound = 2.5 * ldexp(1.0, -23) + M_LN2 * (fabs(y) * lg2_err + ldexp(fabs(y * l), -24)) * 1.01;
            return rel;
        }
        case SQRTF:  // sqrt.approx: relative 2^-23
            *kind = "relative";
            *bound = ldexp(1.0, -23);
            return rel;
        case RSQRTF:  // rsqrt.approx: relative 2^-22.9
            *kind = "relative";
            *bound = exp2(-22.9);
            return rel;
        case FDIVIDEF:  // div.approx: 2 ulp for |y| in [2^-126, 2^126]
            *kind = "ulp";
            *bound = 2.0;
            return err / ulp_of(ref);
    }
    *bound = 0;
    return 0;
}
#endif

static void test_function(int f) {
    static float x[N], y[N], got[N], again[N];
    rng = 0x1234567ull + (uint64_t)f * 7919;
    int n = make_inputs(f, x, y);
    run_device(f, x, y, got, n);
    run_device(f, x, y, again, n);
    check(memcmp(got, again, n * sizeof(float)) == 0, "%s: results differ between two identical launches", fn_name[f]);
#ifdef __CUCC__
    // host code of the same program: the exact libm result, bit for bit, whatever the build
    int host_bad = 0;
    for (int i = 0; i < n; i++)
        if (bits(apply(f, x[i], y[i])) != bits(exact_libm(f, x[i], y[i]))) host_bad++;
    check(host_bad == 0, "%s: %d of %d host-side results differ from libm's", fn_name[f], host_bad, n);
#endif
#if CUCC_FAST_MATH
    double worst = 0.0, worst_bound = 0.0, worst_x = 0.0;
    const char* worst_kind = "";
    int over = 0;
    // the largest fraction of the bound reached, per error measure (a function may have two regions)
    double reach[2] = {0, 0};
    const char* reach_kind[2] = {nullptr, nullptr};
    for (int i = 0; i < n; i++) {
        double bound;
        const char* kind;
        double e = error_and_bound(f, x[i], y[i], got[i], &bound, &kind);
        if (!(e <= bound)) {
            if (over < 3)
                printf("  %s(%.9g, %.9g) = %.9g, reference %.12g: error %.3g over the bound %.3g (%s)\n", fn_name[f],
                       x[i], y[i], got[i], reference(f, x[i], y[i]), e, bound, kind);
            over++;
        }
        if (e / bound > worst / (worst_bound ? worst_bound : 1)) {
            worst = e;
            worst_bound = bound;
            worst_kind = kind;
            worst_x = x[i];
        }
        int slot = (reach_kind[0] == nullptr || strcmp(reach_kind[0], kind) == 0) ? 0 : 1;
        reach_kind[slot] = kind;
        if (e / bound > reach[slot]) reach[slot] = e / bound;
    }
    check(over == 0, "%s: %d of %d results outside the documented bound", fn_name[f], over, n);
    // the region beyond [-2pi, 2pi] has no reachable bound to speak of (the reduction error only grows to it at
    // 100pi); every other region must reach half of its bound
    for (int s = 0; s < 2; s++) {
        if (!reach_kind[s] || strstr(reach_kind[s], "100pi")) continue;
        check(reach[s] >= 0.5, "%s: the largest error reaches only %.3f of the bound (%s)", fn_name[f], reach[s],
              reach_kind[s]);
    }
    printf("  %-16s max error %.3g of bound %.3g (%s) at x = %.6g; reach %.2f / %.2f\n", fn_name[f], worst, worst_bound,
           worst_kind, worst_x, reach[0], reach[1]);
#else
    // other numerics flags without --use_fast_math (-ftz=true alone, ...): the intrinsics are emulated, the
    // standard functions stay exact (sqrtf too unless -prec-sqrt=false)
#if CUCC_NUMERICS
    int intrinsic = f == TANHF_I || f == EXPF_I || f == EXP10F_I || f == LOGF_I || f == LOG2F_I || f == SINF_I ||
                    f == COSF_I || f == SINCOSF_S || f == SINCOSF_C || f == POWF_I || f == RSQRTF || f == FDIVIDEF ||
                    (f == SQRTF && !CUCC_PREC_SQRT);
    if (intrinsic) return;
#endif
    int bad = 0;
    for (int i = 0; i < n; i++)
        if (bits(got[i]) != bits(exact_libm(f, x[i], y[i]))) bad++;
    check(bad == 0, "%s: %d of %d device results differ from libm's exact result (no numerics flags)", fn_name[f], bad,
          n);
#endif
}

// Edge inputs with documented results (PTX ISA corner-case tables), fast-math build only.
static void test_edges(void) {
#if CUCC_FAST_MATH
    struct { int f; float x, y; float want; int nan; } cases[] = {
        {TANHF, INFINITY, 1, 1.0f, 0}, {TANHF, -INFINITY, 1, -1.0f, 0}, {TANHF, 0.0f, 1, 0.0f, 0},
        {TANHF, NAN, 1, 0, 1}, {EXP2F, -INFINITY, 1, 0.0f, 0}, {EXP2F, INFINITY, 1, INFINITY, 0},
        {EXP2F, 0.0f, 1, 1.0f, 0}, {LOG2F, 0.0f, 1, -INFINITY, 0}, {LOG2F, INFINITY, 1, INFINITY, 0},
        {LOG2F, -1.0f, 1, 0, 1}, {SINF, INFINITY, 1, 0, 1}, {SINF, 0.0f, 1, 0.0f, 0}, {SQRTF, 0.0f, 1, 0.0f, 0},
        {SQRTF, INFINITY, 1, INFINITY, 0}, {RSQRTF, 0.0f, 1, INFINITY, 0}, {RSQRTF, INFINITY, 1, 0.0f, 0},
        // __fdividef: 2^126 < |y| < 2^128 gives a zero, or NaN for an infinite x; |y| = 2^126 is still divided
        {FDIVIDEF, 1.0f, 0x1p127f, 0.0f, 0}, {FDIVIDEF, -3.0f, 0x1.8p126f, -0.0f, 0},
        {FDIVIDEF, INFINITY, 0x1p127f, 0, 1}, {FDIVIDEF, 0x1p100f, 0x1p126f, 0x1p-26f, 0},
        {EXPF, -INFINITY, 1, 0.0f, 0}, {EXPF, INFINITY, 1, INFINITY, 0},
    };
    int n = sizeof(cases) / sizeof(cases[0]);
    for (int i = 0; i < n; i++) {
        float x = cases[i].x, y = cases[i].y, got;
        run_device(cases[i].f, &x, &y, &got, 1);
        int ok = cases[i].nan ? isnan(got) : bits(got) == bits(cases[i].want);
        check(ok, "%s(%g, %g) = %g (0x%08x), want %g", fn_name[cases[i].f], x, y, got, bits(got), cases[i].want);
    }
#endif
}

static void test_subnormals(void) {
    const int n = 4096;  // enough blocks for every OpenMP thread to run some
    static float x[n], y[n], out[2 * n];
    for (int i = 0; i < n; i++) {
        x[i] = i % 2 ? 1e-20f : 3e-40f;  // a normal number whose square is subnormal, or a subnormal input
        y[i] = i % 2 ? 1e-20f : 1.0f;
    }
    float *dx, *dy, *dout;
    cudaMalloc(&dx, n * sizeof(float));
    cudaMalloc(&dy, n * sizeof(float));
    cudaMalloc(&dout, 2 * n * sizeof(float));
    cudaMemcpy(dx, x, sizeof(x), cudaMemcpyHostToDevice);
    cudaMemcpy(dy, y, sizeof(y), cudaMemcpyHostToDevice);
    subnormal_kernel<<<n / 32, 32>>>(dx, dy, dout, n);
    cudaMemcpy(out, dout, sizeof(out), cudaMemcpyDeviceToHost);
    int flushed = 0, kept = 0;
    // every product is subnormal (1e-40 input times 1, or 1e-20 squared); x + 0 is for the subnormal inputs
    int total = 0;
    for (int i = 0; i < 2 * n; i++) {
        if (i >= n && (i - n) % 2) continue;
        total++;
        if (out[i] == 0.0f) flushed++;
        else if (fpclassify(out[i]) == FP_SUBNORMAL) kept++;
    }
#if CUCC_FTZ
    check(flushed == total, "-ftz=true: %d of %d subnormal inputs and results flushed in kernels", flushed, total);
#else
    check(kept == total, "no -ftz: %d of %d subnormal inputs and results kept in kernels", kept, total);
#endif
    // host code after the kernel keeps IEEE subnormals (the flush bits are restored)
    volatile float a = 1e-20f, b = 3e-40f;
    float prod = a * a, pass = b + 0.0f;
    check(fpclassify(prod) == FP_SUBNORMAL && fpclassify(pass) == FP_SUBNORMAL,
          "host code after a kernel keeps subnormals (%g, %g)", prod, pass);
    cudaFree(dx);
    cudaFree(dy);
    cudaFree(dout);
}

int main(void) {
#if CUCC_FAST_MATH
    printf("test_fast_math: --use_fast_math build (CUCC_FTZ=%d CUCC_PREC_SQRT=%d)\n", CUCC_FTZ, CUCC_PREC_SQRT);
#else
    printf("test_fast_math: exact build\n");
#endif
    for (int f = 0; f < NFN; f++) test_function(f);
    test_edges();
    test_subnormals();
    return test_summary("test_fast_math");
}
