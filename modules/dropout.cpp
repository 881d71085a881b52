// Dropout's mask and scale in one pass, the mask drawn from a counter-based hash (modules/dropout.py).
//
// torch's CPU dropout draws a Bernoulli mask element by element from its generator (aten::bernoulli_, one thread),
// then multiplies input, mask and scale in two more passes, and keeps the mask for backward: on a gpt2 training step
// 4 x 128 on a 2-core Zen 4 the 37 dropouts cost about a tenth of the step. Here element i of a call is kept when
// hash(seed, i) >= threshold, a pure function of the call's seed (drawn from torch's generator) and the index: the
// same call recomputes the mask for backward instead of storing it, and every thread draws its part independently.
//
// The hash is two rounds of a 32-bit integer finaliser (lowbias32: xor-shift, multiply, xor-shift, multiply,
// xor-shift; each a bijection with full avalanche) with the seed's halves mixed in between; the top index bits (past
// 2^32 elements) are mixed into the second round's key. Integer arithmetic throughout, so the loop vectorises
// (AVX2: 8 lanes, AVX512: 16).
//
// y = x * (keep ? scale : 0): a dropped NaN or infinity gives NaN, as torch's x * mask * scale does.
#include <cstdint>
#include <cstring>

namespace {

inline uint32_t finalise(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352dU;
    x ^= x >> 15;
    x *= 0x846ca68bU;
    x ^= x >> 16;
    return x;
}

constexpr int64_t BLOCK = 1 << 14;  // elements per unit of work given to a thread

// The mask of a call, block by block: the block's key mixes the seed's high half with the index's high bits, and
// element j of the block (index start + j) is kept when draw(...) >= threshold.
inline uint32_t block_key(uint64_t seed, int64_t start) {
    return uint32_t(seed >> 32) ^ finalise(uint32_t(uint64_t(start) >> 32) + 0x9e3779b9U);
}

inline uint32_t draw(uint64_t seed, uint32_t key, int64_t start, uint32_t j) {
    return finalise(finalise(uint32_t(start) + j + uint32_t(seed)) ^ key);
}

inline float bf16_to_float(uint16_t h) {
    uint32_t bits = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch's conversion; NaN stays a quiet NaN
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    const uint32_t rounded = (bits + 0x7fffU + ((bits >> 16) & 1U)) >> 16;
    const uint32_t quiet = (bits >> 16) | 0x40U;
    return uint16_t((bits & 0x7fffffffU) > 0x7f800000U ? quiet : rounded);  // a select, so the loop vectorises
}

template <typename T, typename Load, typename Store>
void apply(int64_t n, const T* __restrict x, T* __restrict y, uint64_t seed, uint32_t threshold, float scale,
           int threads, Load load, Store store) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t start = 0; start < n; start += BLOCK) {
        const int64_t stop = start + BLOCK < n ? start + BLOCK : n;
        const uint32_t key = block_key(seed, start);
        const int len = int(stop - start);
        const T* xs = x + start;
        T* ys = y + start;
        for (int j = 0; j < len; ++j) {
            const float factor = draw(seed, key, start, uint32_t(j)) >= threshold ? scale : 0.0f;
            ys[j] = store(load(xs[j]) * factor);
        }
    }
}

}  // namespace

extern "C" void dropout_f32(int64_t n, const float* x, float* y, uint64_t seed, uint32_t threshold, float scale,
                            int threads) {
    apply(n, x, y, seed, threshold, scale, threads, [](float v) { return v; }, [](float v) { return v; });
}

extern "C" void dropout_bf16(int64_t n, const uint16_t* x, uint16_t* y, uint64_t seed, uint32_t threshold,
                             float scale, int threads) {
    apply(n, x, y, seed, threshold, scale, threads, [](uint16_t v) { return bf16_to_float(v); },
          [](float v) { return float_to_bf16(v); });
}

// The keep decision alone, one byte per element (tests and the statistics of the mask).
extern "C" void dropout_mask(int64_t n, uint8_t* keep, uint64_t seed, uint32_t threshold) {
    for (int64_t start = 0; start < n; start += BLOCK) {
        const int64_t stop = start + BLOCK < n ? start + BLOCK : n;
        const uint32_t key = block_key(seed, start);
        for (int64_t i = start; i < stop; ++i) keep[i] = draw(seed, key, start, uint32_t(i - start)) >= threshold;
    }
}
