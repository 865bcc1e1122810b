// dev/cuda/copy_cast.cu: kernel lab for llmc/copy_cast.cuh copy_and_cast, the element-wise copy with a change
// of precision, in the four directions between fp32 and the 16-bit formats:
//   bf16 -> fp32   THE TRAINER'S (BF16 build): the fp32 master weights start as a copy of the bf16 parameters
//   fp16 -> fp32   the same copy in an FP16 build
//   fp32 -> bf16, fp32 -> fp16   narrowing, round to nearest with ties to even, overflow to infinity: fp32
//                  values into floatX, the header's other use (the trainer converts model files on the host today)
// Every direction is built and run whatever the build's precision (-DENABLE_FP32 only changes floatX, which
// this lab does not use), so both `make labs` builds run the same checks.
// Build and run on the CPU backend (small sizes):
//   make build/lab/copy_cast_bf16   (build/lab/copy_cast_fp32: the fp32 build)
//   build/lab/copy_cast_bf16 -s
// On a GPU: nvcc -std=c++17 -O3 --use_fast_math -arch=sm_90 -I. dev/cuda/copy_cast.cu -o copy_cast
//   ./copy_cast [variant] [-s]     (GPT-2 124M sizes by default: the 124,475,904 parameters the trainer copies)
// Variants:
//   1  llmc/copy_cast.cuh copy_and_cast (THE TRAINER'S): one thread per run of 16-byte packs (8 elements
//      between fp32 and a 16-bit format), streaming loads, an element-wise tail for a last partial run
//   2  one element per thread, scalar loads and stores
// Validation is bit-exact against a CPU reference that does not use the CUDA conversion functions: each
// format is decoded and encoded from its sign, exponent and mantissa fields, and rounding is done in double
// precision (exact there). NaN inputs must give a NaN (any payload: the trainer does not depend on it).
// The inputs cover every 16-bit pattern (widening), and for narrowing: weight-like values, random bit
// patterns around the destination's range (subnormals, underflow to zero, overflow to infinity), exact ties
// between two neighbours of the destination, the fp32 values one ulp either side of them, and special values.
// Sizes: 124,475,904 elements; -s: 65,543 = 2^16 + 7 (every 16-bit pattern once, then a partial run of 7).
// Both sizes also check 5 elements, where the only thread has a partial run.
// Floor: n * (sizeof(destination) + sizeof(source)) bytes, no flops: memory-bound.
#include <algorithm>
#include "common.h"
#include "../../llmc/copy_cast.cuh"

template <class Td, class Ts>
__global__ void copy_and_cast_scalar_kernel(Td* dst, const Ts* src, size_t n) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = (Td)(float)src[i];
}

template <class Td, class Ts>
static void run_variant(int variant, Td* dst, const Ts* src, size_t n, int block_size) {
    if (variant == 1 && block_size == 512) {
        copy_and_cast(dst, src, n, 0);  // the launcher the trainer calls (512 threads)
        return;
    }
    if (variant == 1) {
        constexpr int run = Packed128<Td>::size > Packed128<Ts>::size ? Packed128<Td>::size : Packed128<Ts>::size;
        const size_t runs = CEIL_DIV(n, (size_t)run);
        copy_and_cast_kernel<<<(unsigned int)CEIL_DIV(runs, (size_t)block_size), block_size>>>(dst, src, n);
    } else {
        copy_and_cast_scalar_kernel<<<(unsigned int)CEIL_DIV(n, (size_t)block_size), block_size>>>(dst, src, n);
    }
    cudaCheck(cudaGetLastError());
}

// ----------------------------------------------------------------------------------------------------
// CPU reference: the three formats described by their field widths, independently of cuda_bf16.h/cuda_fp16.h
template <class T>
struct Format;
template <>
struct Format<float> {
    static constexpr int exponent_bits = 8, mantissa_bits = 23;
    static constexpr const char* name = "fp32";
};
template <>
struct Format<__nv_bfloat16> {
    static constexpr int exponent_bits = 8, mantissa_bits = 7;
    static constexpr const char* name = "bf16";
};
template <>
struct Format<half> {
    static constexpr int exponent_bits = 5, mantissa_bits = 10;
    static constexpr const char* name = "fp16";
};

template <class T>
struct FormatFields {
    static constexpr int M = Format<T>::mantissa_bits;
    static constexpr int E = Format<T>::exponent_bits;
    static constexpr int bias = (1 << (E - 1)) - 1;
    static constexpr int min_exponent = 1 - bias;  // of the smallest normal; subnormals share its quantum
    static constexpr uint32_t exponent_ones = (1u << E) - 1;
};

template <class T>
static uint32_t bits_of(T value) {
    uint32_t bits = 0;
    memcpy(&bits, &value, sizeof(T));  // little-endian: the low sizeof(T) bytes
    return bits;
}

template <class T>
static bool is_nan_bits(uint32_t bits) {
    using F = FormatFields<T>;
    return ((bits >> F::M) & F::exponent_ones) == F::exponent_ones && (bits & ((1u << F::M) - 1)) != 0;
}

template <class T>
static double decode(uint32_t bits) {
    using F = FormatFields<T>;
    const uint32_t mantissa = bits & ((1u << F::M) - 1);
    const uint32_t biased_exponent = (bits >> F::M) & F::exponent_ones;
    const double sign = (bits >> (F::E + F::M)) & 1 ? -1.0 : 1.0;
    if (biased_exponent == F::exponent_ones) return mantissa ? NAN : sign * INFINITY;
    if (biased_exponent == 0) return sign * ldexp((double)mantissa, F::min_exponent - F::M);
    return sign * ldexp((double)(mantissa | (1u << F::M)), (int)biased_exponent - F::bias - F::M);
}

// the bits of a value of T (one round_to returned: representable, infinite or NaN)
template <class T>
static uint32_t encode(double value) {
    using F = FormatFields<T>;
    if (std::isnan(value)) return (F::exponent_ones << F::M) | (1u << (F::M - 1));
    const uint32_t sign = std::signbit(value) ? 1u << (F::E + F::M) : 0u;
    const double magnitude = fabs(value);
    if (std::isinf(value)) return sign | (F::exponent_ones << F::M);
    if (magnitude < ldexp(1.0, F::min_exponent)) return sign | (uint32_t)ldexp(magnitude, F::M - F::min_exponent);
    int frexp_exponent;
    frexp(magnitude, &frexp_exponent);  // magnitude = m * 2^frexp_exponent, m in [0.5, 1)
    const int exponent = frexp_exponent - 1;
    return sign | ((uint32_t)(exponent + F::bias) << F::M) |
           ((uint32_t)ldexp(magnitude, F::M - exponent) - (1u << F::M));
}

// The spacing of T's values around value (finite, non-zero).
template <class T>
static double quantum_of(double value) {
    using F = FormatFields<T>;
    int frexp_exponent;
    frexp(value, &frexp_exponent);
    return ldexp(1.0, std::max(frexp_exponent - 1, F::min_exponent) - F::M);
}

// value rounded to T: to nearest, ties to even, overflow to infinity. Exact in double: value / quantum is an
// integer-plus-fraction of at most 24 significant bits, nearbyint rounds it with ties to even (the default
// rounding mode), and multiplying back by a power of two is exact. A rounding up to 2^(bias + 1) is past the
// largest finite value (including the tie just above it: the largest value has an odd mantissa).
template <class T>
static double round_to(double value) {
    using F = FormatFields<T>;
    if (!std::isfinite(value) || value == 0.0) return value;
    const double quantum = quantum_of<T>(value);
    const double rounded = nearbyint(value / quantum) * quantum;
    return fabs(rounded) >= ldexp(1.0, F::bias + 1) ? copysign(INFINITY, value) : rounded;
}

// ----------------------------------------------------------------------------------------------------
// inputs

static uint32_t random_bits(int count) { return (uint32_t)(lab_rand_uniform(0.0f, 1.0f) * (float)(1u << count)); }

static float float_from_bits(uint32_t bits) {
    float value;
    memcpy(&value, &bits, sizeof(value));
    return value;
}

// A random fp32 whose exponent lies in or just around Td's range: from below Td's smallest subnormal (it
// rounds to zero) to one binade past its largest value (it overflows); within fp32's own range, so fp32
// subnormals too for bf16. Bit-built, so every mantissa bit is random.
template <class Td>
static float random_float_around() {
    using F = FormatFields<Td>;
    const int lowest = std::max(F::min_exponent - F::M - 2, -127);  // -127: fp32 subnormals
    const int highest = std::min(F::bias + 1, 127);
    const int exponent = lowest + (int)(lab_rand_uniform(0.0f, 1.0f) * (highest - lowest + 1));
    const uint32_t sign = random_bits(1) << 31;
    const uint32_t mantissa = random_bits(23);
    return float_from_bits(sign | ((uint32_t)(exponent + 127) << 23) | mantissa);
}

// fp32 inputs for a narrowing to Td: special values first, then four kinds in turn (see the header)
template <class Td>
static std::vector<float> narrowing_inputs(size_t n) {
    using F = FormatFields<Td>;
    const double largest = ldexp(2.0 - ldexp(1.0, -F::M), F::bias);
    const double smallest_subnormal = ldexp(1.0, F::min_exponent - F::M);
    const double specials[] = {0.0, -0.0, INFINITY, -INFINITY, NAN, -NAN, FLT_MAX, -FLT_MAX,
                               largest, -largest,
                               largest + ldexp(1.0, F::bias - F::M - 1),  // tie between the largest and 2^(bias+1)
                               nextafterf((float)(largest + ldexp(1.0, F::bias - F::M - 1)), 0.0f),
                               smallest_subnormal, -smallest_subnormal,
                               smallest_subnormal / 2,       // tie between 0 and the smallest: to 0 (even)
                               smallest_subnormal * 0.75,    // nearer the smallest
                               smallest_subnormal * 1.5,     // tie between the first two subnormals: to the second
                               ldexp(1.0, F::min_exponent),  // the smallest normal
                               float_from_bits(1),           // fp32's smallest subnormal
                               1.0, -1.0, 1.0 + ldexp(1.0, -F::M - 1), 1.0 + 3 * ldexp(1.0, -F::M - 1)};
    const size_t num_specials = sizeof(specials) / sizeof(specials[0]);
    std::vector<float> inputs(n);
    for (size_t i = 0; i < n; i++) {
        if (i < num_specials) {
            inputs[i] = (float)specials[i];
            continue;
        }
        const int kind = (int)(i % 4);
        if (kind == 0) {
            inputs[i] = lab_rand_uniform(-1.0f, 1.0f);  // weight-like
            continue;
        }
        const float x = random_float_around<Td>();
        if (kind == 1 || x == 0.0f || std::isinf(x)) {
            inputs[i] = x;
            continue;
        }
        // the midpoint of the two values of Td around x: at most M + 2 significant bits, exact in fp32
        const double quantum = quantum_of<Td>(x);
        const float tie = (float)copysign((floor(fabs((double)x) / quantum) + 0.5) * quantum, (double)x);
        inputs[i] = kind == 2 ? tie : nextafterf(tie, random_bits(1) ? INFINITY : -INFINITY);
    }
    return inputs;
}

// ----------------------------------------------------------------------------------------------------

template <class T>
static T* raw_to_device(const std::vector<T>& host) {
    T* d;
    cudaCheck(cudaMalloc(&d, host.size() * sizeof(T) + 16));
    cudaCheck(cudaMemcpy(d, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
    return d;
}

// Compares the device's output with the reference bit for bit (NaN: any NaN); prints the first mismatches and
// exits non-zero on failure.
template <class Td, class Ts>
static void validate_bits(const char* what, const Td* d_out, const std::vector<Ts>& src,
                          const std::vector<uint32_t>& expected, size_t n) {
    std::vector<Td> got(n);
    cudaCheck(cudaMemcpy(got.data(), d_out, n * sizeof(Td), cudaMemcpyDeviceToHost));
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        const uint32_t g = bits_of(got[i]);
        const bool ok = is_nan_bits<Td>(expected[i]) ? is_nan_bits<Td>(g) : g == expected[i];
        if (!ok) {
            if (bad < 5)
                printf("  %s[%zu]: %s 0x%0*x (%.9g) -> got 0x%0*x (%.9g), want 0x%0*x (%.9g)\n", what, i,
                       Format<Ts>::name, (int)(2 * sizeof(Ts)), bits_of(src[i]), decode<Ts>(bits_of(src[i])),
                       (int)(2 * sizeof(Td)), g, decode<Td>(g), (int)(2 * sizeof(Td)), expected[i],
                       decode<Td>(expected[i]));
            bad++;
        }
    }
    if (bad) {
        printf("FAIL %s: %zu of %zu elements differ from the reference\n", what, bad, n);
        exit(EXIT_FAILURE);
    }
    printf("  %-28s ok (bit-exact over %zu elements)\n", what, n);
}

// A kernel given count elements must leave the ones after them as they were (the 0xff poison).
template <class Td>
static void check_untouched(const Td* d_out, size_t count, size_t end) {
    std::vector<Td> got(end - count);
    cudaCheck(cudaMemcpy(got.data(), d_out + count, got.size() * sizeof(Td), cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < got.size(); i++) {
        if (bits_of(got[i]) != (sizeof(Td) == 2 ? 0xffffu : 0xffffffffu)) {
            printf("FAIL dst[%zu] written, past the %zu elements asked for\n", count + i, count);
            exit(EXIT_FAILURE);
        }
    }
}

template <class Td, class Ts>
static void lab_direction(const LabArgs& args, size_t n) {
    std::vector<Ts> src(n);
    if constexpr (sizeof(Ts) == 2) {
        for (size_t i = 0; i < n; i++) {
            const uint16_t pattern = (uint16_t)i;  // every 16-bit pattern in turn
            memcpy(&src[i], &pattern, sizeof(pattern));
        }
    } else {
        src = narrowing_inputs<Td>(n);
    }
    std::vector<uint32_t> expected(n);
    for (size_t i = 0; i < n; i++) expected[i] = encode<Td>(round_to<Td>(decode<Ts>(bits_of(src[i]))));

    char name[64], sizes[96];
    snprintf(name, sizeof(name), "copy_and_cast %s->%s", Format<Ts>::name, Format<Td>::name);
    snprintf(sizes, sizeof(sizes), "%zu elements", n);
    printf("%s: %s\n", name, sizes);
    Ts* d_src = raw_to_device(src);
    Td* d_dst = lab_poisoned<Td>(n);
    const size_t tiny = 5;
    for (int variant = 1; variant <= 2; variant++) {
        if (args.variant != 0 && args.variant != variant) continue;
        printf("variant %d\n", variant);
        for (size_t count : {n, tiny}) {
            cudaCheck(cudaMemset(d_dst, 0xff, n * sizeof(Td)));
            run_variant(variant, d_dst, d_src, count, 512);
            cudaCheck(cudaDeviceSynchronize());
            validate_bits(count == n ? "dst" : "dst, 5 elements", d_dst, src, expected, count);
            if (count == tiny) check_untouched(d_dst, tiny, 2 * tiny);
        }
    }

    lab_print_header(name, sizes);
    const int repeats = args.small ? 3 : 20;
    const double bytes = (double)n * (sizeof(Td) + sizeof(Ts));
    const int block_sizes[] = {128, 256, 512, 1024};
    for (int variant = 1; variant <= 2; variant++) {
        if (args.variant != 0 && args.variant != variant) continue;
        for (int block_size : block_sizes) {
            float ms = lab_time_ms(repeats, [&]() { run_variant(variant, d_dst, d_src, n, block_size); });
            lab_print_row(variant, block_size, ms, bytes, 0.0);
        }
    }
    cudaCheck(cudaFree(d_src));
    cudaCheck(cudaFree(d_dst));
}

int main(int argc, char** argv) {
    LabArgs args = lab_parse_args(argc, argv);
    const size_t n = args.small ? 65536 + 7 : 124475904;
    lab_direction<float, __nv_bfloat16>(args, n);
    lab_direction<float, half>(args, n);
    lab_direction<__nv_bfloat16, float>(args, n);
    lab_direction<half, float>(args, n);
    return 0;
}
