// cpu/include/cooperative_groups/reduce.h: cg::reduce over a thread_block_tile for the CPU backend,
// with the plus, less and greater operators (less yields the minimum, greater the maximum, as in CUDA).
// A butterfly of xor-shuffles, so every thread of the tile gets the same result.
#pragma once
#include "../cooperative_groups.h"

namespace cooperative_groups {

template <typename T>
struct plus {
    T operator()(const T& a, const T& b) const { return a + b; }
};
template <typename T>
struct less {
    T operator()(const T& a, const T& b) const { return b < a ? b : a; }
};
template <typename T>
struct greater {
    T operator()(const T& a, const T& b) const { return a < b ? b : a; }
};

template <unsigned int N, typename T, typename Op>
inline T reduce(const thread_block_tile<N>& tile, T value, Op op, const char* file = __builtin_FILE(),
                int line = __builtin_LINE()) {
    for (unsigned offset = N / 2; offset > 0; offset /= 2) value = op(value, tile.shfl_xor(value, offset, file, line));
    return value;
}

}  // namespace cooperative_groups
