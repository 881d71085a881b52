// A few rows times a weight that streams from memory: y[b, o] = (sum_i x[b, i] * w[o, i]) * scale[o] + bias[o]
// for x (B, in) fp32, B <= 8, and w (out, in) row-major in fp32, bf16 or int8 (scale: int8's per-row scales); or
// int4 (modules/quant.py's Int4Weight): y[b, o] = sum_i x[b, i] * q[o, i] * scale[o, i / group] + bias[o]. And int8 and
// int4 times activations quantized to int8 (quantize="w8a8" / "w4a8"): integer products, below.
//
// Decoding multiplies one to eight token rows by every weight matrix: the work is reading the weights, and torch's
// kernels for these shapes read them well below the memory's speed (docs/performance.md). Here each weight row is
// read once for all B input rows, converted to fp32 in registers (bf16: shift into the high half; int8: sign-extend
// and convert; int4: in the AVX512 build the nibble indexes a table of its group's 16 dequantized values, in the AVX2
// one it is shifted to the top of a 32-bit lane and back, which sign-extends it, converted and multiplied by its
// group's scale), and multiplied into B accumulators; R weight rows at a time keep R x B independent sums in flight.
// Sums are fp32 in a different order from torch's, so results agree to float rounding, not bit for bit.
//
// Built by modules/rows.py with -march=native on the machine that runs it: the AVX512 or AVX2 path is chosen by the
// compiler from the CPU at hand. Threads: OpenMP over blocks of output rows, the same libgomp torch uses.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <type_traits>
#include <utility>
#include <vector>

// The sum of 8 floats (the AVX2 form's vsum; the integer products and the step's attention use it in either form).
static inline float hsum256(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 8 values as fp32: fp32, or bf16 (as uint16 bits: shifted into the high half, exactly) -- the AVX2 build's weight
// loads and, in either build, the decode step's reads of a fp32 or bf16 cache.
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

#if defined(__AVX512F__)
constexpr int64_t kWidth = 16;
using vf = __m512;
static inline vf vzero() { return _mm512_setzero_ps(); }
static inline vf xload(const float* p) { return _mm512_loadu_ps(p); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
static inline vf wload(const float* p) { return _mm512_loadu_ps(p); }
static inline vf wload(const uint16_t* p) {
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
static inline vf wload(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
static inline vf vset1(float v) { return _mm512_set1_ps(v); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline void vstore(float* p, vf a) { _mm512_storeu_ps(p, a); }
// int4 through a table: a group's 16 values, scale x (0..7, -8..-1), the weights a nibble's bits stand for (two's
// complement), which _mm512_permutexvar_ps picks by each 32-bit lane's low 4 bits; so a block's 16 bytes widened
// to 32-bit lanes give its low nibbles' weights as they are and its high nibbles' after a shift. Each weight is
// q x scale rounded once (as Int4Weight.dequantize gives it); fewer operations a weight than sign-extending,
// converting and scaling (the int4 product is bound by its unpacking on a 2-core Zen 4: an interleaved A/B of the
// one-row products, gpt2's 3072 x 768, 768 x 3072 and 2304 x 768: 1.06-1.14x on 2 threads, 1.07-1.11x on 1).
constexpr bool kInt4Plus8 = false;  // the one-row products read the weights as they are (see the AVX2 form)
static inline vf int4_table(float scale) {
  return _mm512_mul_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1), _mm512_set1_ps(scale));
}
static inline __m512i int4_lanes(const uint8_t* block) {  // a block's 16 bytes, one a 32-bit lane
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block)));
}
// Vector v (0, 1) of an int4 block of 32 weights (16 bytes, byte k: weight k in the low nibble, weight 16 + k in the
// high one), each times its group's scale: weights 16v .. 16v + 15.
static inline vf int4_scaled(const uint8_t* block, int v, vf table) {
  const __m512i lanes = int4_lanes(block);
  return _mm512_permutexvar_ps(v == 0 ? lanes : _mm512_srli_epi32(lanes, 4), table);
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kWidth = 8;
using vf = __m256;
static inline vf vzero() { return _mm256_setzero_ps(); }
static inline vf xload(const float* p) { return _mm256_loadu_ps(p); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vf a) { return hsum256(a); }
static inline vf wload(const float* p) { return _mm256_loadu_ps(p); }
static inline vf wload(const uint16_t* p) { return load8(p); }
static inline vf wload(const int8_t* p) {
  // a full 8-byte load, sign-extended in register (no partial vector load through memory)
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
static inline vf vset1(float v) { return _mm256_set1_ps(v); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline void vstore(float* p, vf a) { _mm256_storeu_ps(p, a); }
// Vector v (0..3) of an int4 block of 32 weights (16 bytes, byte k: weight k low, weight 16 + k high): 8 bytes
// (0-7 for v = 0 and 2, 8-15 for v = 1 and 3), their low (v < 2) or high nibbles shifted to the lane's top and
// arithmetically back, which sign-extends them; weights 8v .. 8v + 7.
static inline vf int4_load(const uint8_t* block, int v) {
  const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 8 * (v & 1))));
  return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(bytes, v < 2 ? 28 : 24), 28));
}
// The same weights plus 8 (0..15): each nibble's top bit flipped (XOR 0x88 on the bytes), then masked or shifted
// down; cheaper than sign-extending (the one-row products take 8 x the group's input sum off once per group).
static inline vf int4_load_plus8(const uint8_t* block, int v) {
  const __m128i raw = _mm_xor_si128(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 8 * (v & 1))),
                                    _mm_set1_epi8(static_cast<char>(0x88)));
  const __m256i bytes = _mm256_cvtepu8_epi32(raw);
  return _mm256_cvtepi32_ps(v < 2 ? _mm256_and_si256(bytes, _mm256_set1_epi32(0x0F)) : _mm256_srli_epi32(bytes, 4));
}
// AVX2 has no 16-entry table lookup in one instruction (two 8-entry permutes and a blend cost more than converting):
// the weights are sign-extended and scaled, and the one-row products read them plus 8 (int4_load_plus8).
constexpr bool kInt4Plus8 = true;
static inline vf int4_table(float scale) { return vset1(scale); }
static inline vf int4_scaled(const uint8_t* block, int v, vf scale) { return vmul(int4_load(block, v), scale); }
#else
#error "rows.cpp needs AVX2 and FMA (modules/rows.py builds it only where torch reports AVX2 or AVX512)"
#endif

static inline float to_float(float v) { return v; }
static inline float to_float(int8_t v) { return static_cast<float>(v); }
static inline float to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
// bf16 rounding of an fp32 value (to nearest, ties to even, as torch converts; NaN stays NaN): the rule on a float's
// bits, its low 16 bits left zero (branch-free, so loops of it vectorize), and `bf16_bits` the 16 bits kept.
static inline uint32_t bf16_rounded(uint32_t b) {
  const uint32_t nearest = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u, nan = (b & 0xFFFF0000u) | 0x00400000u;
  return (b & 0x7FFFFFFFu) > 0x7F800000u ? nan : nearest;  // a NaN stays a (quiet) NaN
}
static inline uint16_t bf16_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return static_cast<uint16_t>(bf16_rounded(b) >> 16);
}
// A vector of fp32 values stored as bf16, each rounded as bf16_bits rounds it (to nearest even; NaN stays NaN).
#if defined(__AVX512F__)
static inline void store_bf16(uint16_t* p, vf v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i one = _mm512_set1_epi32(1);
  const __m512i nearest = _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)),
                                           _mm512_and_si512(_mm512_srli_epi32(b, 16), one));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(b, _mm512_set1_epi32(0x7FFFFFFF)),
                                                _mm512_set1_epi32(0x7F800000));
  const __m512i kept = _mm512_mask_or_epi32(nearest, nan, b, _mm512_set1_epi32(0x00400000));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(kept, 16)));
}
#else
static inline void store_bf16(uint16_t* p, vf v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i nearest = _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)),
                                           _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1)));
  // |b| > infinity's bits, as signed 32-bit values (the sign bit cleared: both sides positive)
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7FFFFFFF)),
                                         _mm256_set1_epi32(0x7F800000));
  const __m256i kept = _mm256_blendv_epi8(nearest, _mm256_or_si256(b, _mm256_set1_epi32(0x00400000)), nan);
  const __m256i halves = _mm256_srli_epi32(kept, 16);  // 0..65535: packus keeps them exactly
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(halves, halves), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
#endif

// How far ahead each weight row is prefetched with several input rows (products alone, GB/s, docs/performance.md):
// int8: the same place in the next group of R rows: 24-32 GB/s of int8 against 19-28 with a fixed 1024-byte distance
// and 14-25 without. fp32 and bf16: the same place two groups on: 4 rows 26.7-48.1 against 22.7-35.7 with the fixed
// distance, 8 rows 16.6-33.8 against 18.2-23.3 (the hardware prefetcher alone: 15-22). One input row: row_dot.

// The weight as rows_at reads it. Dense: fp32, bf16 or int8 rows of `in` values (scale: int8's per-row scales, else
// null). Int4: rows of in / 2 bytes in blocks of 32 weights (int4_scaled), scale (out, in / group) row-major, group a
// multiple of 32 that divides in (rows_product checks).
template <typename T>
struct Dense {
  const T* w;
  const float* scale;
};
struct Int4 {
  const uint8_t* w;
  const float* scale;
  int64_t group;
};
constexpr int64_t kMaxRows = 8;  // the most input rows of rows_product (modules/rows.py MAX_ROWS)
constexpr int64_t kBlock = 32;  // int4 weights per packed block (16 bytes): kBlock / kWidth vectors

// R weight rows starting at o, times all B input rows.
template <int B, int R, typename T>
static inline void rows_at(const float* x, int64_t in, Dense<T> weight, const float* bias, float* y, int64_t out,
                           int64_t o) {
  const T* w = weight.w;
  vf acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = vzero();
  vf wv[R];
  int64_t i = 0;
  for (; i + kWidth <= in; i += kWidth) {
    for (int r = 0; r < R; ++r) {
      if constexpr (sizeof(T) == 1)  // int8: the same place in the next group of R rows
        _mm_prefetch(reinterpret_cast<const char*>(w + (o + R + r) * in + i), _MM_HINT_T0);
      else  // several rows: the same place two groups on (one row: row_dot below)
        _mm_prefetch(reinterpret_cast<const char*>(w + (o + 2 * R + r) * in + i), _MM_HINT_T0);
      wv[r] = wload(w + (o + r) * in + i);
    }
    for (int b = 0; b < B; ++b) {  // each input vector loaded once for the R weight rows
      const vf xv = xload(x + b * in + i);
      for (int r = 0; r < R; ++r) acc[r][b] = vfma(xv, wv[r], acc[r][b]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const T* row = w + (o + r) * in;
    for (int b = 0; b < B; ++b) {
      float s = vsum(acc[r][b]);
      for (int64_t j = i; j < in; ++j) s += x[b * in + j] * to_float(row[j]);
      if (weight.scale) s *= weight.scale[o + r];
      if (bias) s += bias[o + r];
      y[b * out + o + r] = s;
    }
  }
}

// int4: the same product, a group at a time. Each weight vector is its values times its group's scale before the FMAs
// (int4_scaled: a table lookup or a multiply), so the sums are those of x times the dequantized weight (q * scale, as
// Int4Weight.dequantize gives it), in another order; in is whole groups of whole blocks, so no tail is left.
// Prefetched like int8: the next group of R rows.
template <int B, int R>
static inline void rows_at(const float* x, int64_t in, Int4 weight, const float* bias, float* y, int64_t out,
                           int64_t o) {
  const int64_t row_bytes = in / 2, groups = in / weight.group;
  vf acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = vzero();
  vf wv[R], sv[R];
  for (int64_t g = 0; g < groups; ++g) {
    for (int r = 0; r < R; ++r) sv[r] = int4_table(weight.scale[(o + r) * groups + g]);
    for (int64_t i = g * weight.group; i < (g + 1) * weight.group; i += kBlock) {
      for (int r = 0; r < R; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(weight.w + (o + R + r) * row_bytes + i / 2), _MM_HINT_T0);
#pragma GCC unroll 4
      for (int v = 0; v < kBlock / kWidth; ++v) {
        for (int r = 0; r < R; ++r) wv[r] = int4_scaled(weight.w + (o + r) * row_bytes + i / 2, v, sv[r]);
        for (int b = 0; b < B; ++b) {
          const vf xv = xload(x + b * in + i + v * kWidth);
          for (int r = 0; r < R; ++r) acc[r][b] = vfma(xv, wv[r], acc[r][b]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) {
      float s = vsum(acc[r][b]);
      if (bias) s += bias[o + r];
      y[b * out + o + r] = s;
    }
}

// One input row (decoding at batch 1): each thread reads its contiguous block of weight rows as one stream, a row at
// a time, with two accumulators so neither the FMA's latency nor the conversions (int8, int4) bind, prefetching
// its kind's distance (kAhead) ahead in that stream (the next row follows the last in memory). Read cold from
// memory (gpt2's LM head, 154 MB, caches flushed between calls), one stream a thread measured 21.5 GB/s against 15.5
// for four rows in lockstep (four streams 3 KB apart) and 16.8 for ONNX Runtime's MatMul on a 2-core Zen 4. How far
// ahead pays depends on the core and on the weight kind: 1024 bytes by default, another distance per kind where the
// decode plan (modules/rows.py) timed it faster on this machine (rows_prefetch_kind below; an Ice Lake Xeon read
// 5-13% faster at 4096; a Zen 4 read int4 1.12-1.40x faster at 4096, int8's LM head 0.89x).
// Indexed by weight kind: 0 fp32, 1 bf16, 2 int8, 3 int4, 4 int8 x int8 activations, 5 int4 x int8 activations.
static int64_t kAhead[6] = {1024, 1024, 1024, 1024, 1024, 1024};
template <typename T>
constexpr int kind_of() {
  return std::is_same_v<T, float> ? 0 : std::is_same_v<T, uint16_t> ? 1 : 2;
}

template <typename T>
static inline float row_dot(const float* x, int64_t in, Dense<T> weight, int64_t o, const float* /* int4's */) {
  const T* row = weight.w + o * in;
  vf a0 = vzero(), a1 = vzero();
  int64_t i = 0;
  for (; i + 2 * kWidth <= in; i += 2 * kWidth) {
    for (int64_t p = 0; p < 2 * kWidth * static_cast<int64_t>(sizeof(T)); p += 64)
      _mm_prefetch(reinterpret_cast<const char*>(row + i) + kAhead[kind_of<T>()] + p, _MM_HINT_T0);
    a0 = vfma(xload(x + i), wload(row + i), a0);
    a1 = vfma(xload(x + i + kWidth), wload(row + i + kWidth), a1);
  }
  for (; i + kWidth <= in; i += kWidth) a0 = vfma(xload(x + i), wload(row + i), a0);
  float s = vsum(a0) + vsum(a1);
  for (; i < in; ++i) s += x[i] * to_float(row[i]);
  return weight.scale ? s * weight.scale[o] : s;
}

#if defined(__AVX512F__)
// bf16 in the AVX512 build: a 64-byte load holds 32 weights, each 32-bit lane a pair; shifted left 16 bits the lanes
// are the even-indexed weights as fp32, masked to their high halves the odd-indexed ones: no widening shuffle. `pairs`
// holds x in the same order (per block of 32 values, the 16 even-indexed, then the 16 odd-indexed; product<1> makes
// it once per call), so the sum is of the same products, in another order.
static inline float row_dot(const float* x, int64_t in, Dense<uint16_t> weight, int64_t o, const float* pairs) {
  const uint16_t* row = weight.w + o * in;
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  vf a0 = vzero(), a1 = vzero();
  int64_t i = 0;
  for (; i + 32 <= in; i += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(row + i) + kAhead[1], _MM_HINT_T0);
    const __m512i v = _mm512_loadu_si512(row + i);
    a0 = vfma(xload(pairs + i), _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), a0);
    a1 = vfma(xload(pairs + i + 16), _mm512_castsi512_ps(_mm512_and_si512(v, high)), a1);
  }
  float s = vsum(a0) + vsum(a1);
  for (; i < in; ++i) s += x[i] * to_float(row[i]);
  return weight.scale ? s * weight.scale[o] : s;
}
#endif

// int4's correction for reading its weights plus 8: the row's group scales times the input's group sums.
static inline float int4_offset(const float* scale, const float* gsum, int64_t groups) {
  vf off = vzero();
  int64_t k = 0;
  for (; k + kWidth <= groups; k += kWidth) off = vfma(xload(scale + k), xload(gsum + k), off);
  float s = vsum(off);
  for (; k < groups; ++k) s += scale[k] * gsum[k];
  return s;
}

// int4 in the AVX512 build: the dequantized weights from the group's table. In the AVX2 build: the group's products
// summed unscaled from the weights plus 8, scaled once per group, and 8 x the scale x the group's input sum (gsum,
// once per product) taken off: the same sum as the dequantized weights', in another order, with fewer operations a
// weight than scaling each (int4 is bound by its unpacking on 2 cores, not by the memory).
static inline float row_dot(const float* x, int64_t in, Int4 weight, int64_t o, const float* gsum) {
  const int64_t row_bytes = in / 2, groups = in / weight.group;
  const uint8_t* row = weight.w + o * row_bytes;
  const float* scale = weight.scale + o * groups;
  vf acc = vzero();
#if defined(__AVX512F__)
  (void)gsum;
  vf part = vzero();
  for (int64_t g = 0; g < groups; ++g) {
    const vf table = int4_table(scale[g]);
    for (int64_t i = g * weight.group; i < (g + 1) * weight.group; i += kBlock) {
      _mm_prefetch(reinterpret_cast<const char*>(row + i / 2) + kAhead[3], _MM_HINT_T0);
      acc = vfma(xload(x + i), int4_scaled(row + i / 2, 0, table), acc);
      part = vfma(xload(x + i + kWidth), int4_scaled(row + i / 2, 1, table), part);
    }
  }
  return vsum(vadd(acc, part));
#else
  for (int64_t g = 0; g < groups; ++g) {
    vf part[2] = {vzero(), vzero()};
    for (int64_t i = g * weight.group; i < (g + 1) * weight.group; i += kBlock) {
      _mm_prefetch(reinterpret_cast<const char*>(row + i / 2) + kAhead[3], _MM_HINT_T0);
#pragma GCC unroll 4
      for (int v = 0; v < kBlock / kWidth; ++v)
        part[v & 1] = vfma(xload(x + i + v * kWidth), int4_load_plus8(row + i / 2, v), part[v & 1]);
    }
    acc = vfma(vadd(part[0], part[1]), vset1(scale[g]), acc);
  }
  return vsum(acc) - 8.0f * int4_offset(scale, gsum, groups);
#endif
}

// int4 in groups of 32 (one 16-byte block a group, the default), one input row: two weight rows at a time, two groups
// a step. Each input vector is loaded once for both rows; each block's bytes are widened to 32-bit lanes once for
// both nibble halves; each row keeps one accumulator a group parity, so four sums are in flight. AVX512: the
// weights from the group's table (int4_scaled), FMAs straight into the row's sum. AVX2: a group's products start with
// a multiply (no zeroed partial) and are scaled once; the 8 x scale x group sum correction is a vector product. The
// same sum as row_dot's, in another order. An interleaved A/B of the two ways' one-row products (Ice Lake Xeon, 2
// threads, gpt2's 3072 x 768, 768 x 3072 and 2304 x 768, before the table): 1.15-1.35x row_dot's speed in the AVX512
// build, 1.25-1.6x in the AVX2 one (docs/cpu-decoding.md, "Weight-only int4 decoding").
#if defined(__AVX512F__)
static inline void int4_group(const float* x, const uint8_t* block, vf& acc, float scale) {
  const vf table = int4_table(scale);
  const __m512i lanes = int4_lanes(block);
  acc = vfma(xload(x), _mm512_permutexvar_ps(lanes, table), acc);
  acc = vfma(xload(x + 16), _mm512_permutexvar_ps(_mm512_srli_epi32(lanes, 4), table), acc);
}
#else
static inline void int4_group(const float* x, const uint8_t* block, vf& acc, float scale) {
  const __m128i m = _mm_set1_epi8(static_cast<char>(0x88));
  const __m256i lo = _mm256_cvtepu8_epi32(_mm_xor_si128(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block)), m));
  const __m256i hi = _mm256_cvtepu8_epi32(_mm_xor_si128(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 8)),
                                                         m));
  const __m256i low4 = _mm256_set1_epi32(0x0F);
  vf p = vmul(xload(x), _mm256_cvtepi32_ps(_mm256_and_si256(lo, low4)));
  p = vfma(xload(x + 8), _mm256_cvtepi32_ps(_mm256_and_si256(hi, low4)), p);
  p = vfma(xload(x + 16), _mm256_cvtepi32_ps(_mm256_srli_epi32(lo, 4)), p);
  p = vfma(xload(x + 24), _mm256_cvtepi32_ps(_mm256_srli_epi32(hi, 4)), p);
  acc = vfma(p, vset1(scale), acc);
}
#endif

static inline void row_pair_int4(const float* x, int64_t in, Int4 weight, int64_t o, const float* gsum, float* y) {
  const int64_t row_bytes = in / 2, groups = in / kBlock;
  const uint8_t* r0 = weight.w + o * row_bytes;
  const uint8_t* r1 = r0 + row_bytes;
  const float* s0 = weight.scale + o * groups;
  const float* s1 = s0 + groups;
  vf a0 = vzero(), a1 = vzero(), c0 = vzero(), c1 = vzero();
  int64_t g = 0;
  for (; g + 2 <= groups; g += 2) {
    const int64_t i = g * kBlock;
    if ((i & 127) == 0) {  // one prefetch a 64-byte line of each row
      _mm_prefetch(reinterpret_cast<const char*>(r0 + i / 2) + kAhead[3], _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(r1 + i / 2) + kAhead[3], _MM_HINT_T0);
    }
    int4_group(x + i, r0 + i / 2, a0, s0[g]);
    int4_group(x + i + kBlock, r0 + i / 2 + 16, a1, s0[g + 1]);
    int4_group(x + i, r1 + i / 2, c0, s1[g]);
    int4_group(x + i + kBlock, r1 + i / 2 + 16, c1, s1[g + 1]);
  }
  if (g < groups) {  // an odd number of groups: the last
    int4_group(x + g * kBlock, r0 + g * kBlock / 2, a0, s0[g]);
    int4_group(x + g * kBlock, r1 + g * kBlock / 2, c0, s1[g]);
  }
  y[o] = vsum(vadd(a0, a1)) - (kInt4Plus8 ? 8.0f * int4_offset(s0, gsum, groups) : 0.0f);
  y[o + 1] = vsum(vadd(c0, c1)) - (kInt4Plus8 ? 8.0f * int4_offset(s1, gsum, groups) : 0.0f);
}

// Weight rows per step: R x B accumulators, R weight vectors and one input vector must stay in vector registers.
// AVX512 has 32, so several input rows take 3 to 8 weight rows at a time: each loaded input vector then feeds R
// FMAs, and loads no longer outnumber them (8 rows, fp32, gpt2's 768 x 3072: 24 GB/s of weights against 13 with
// one weight row at a time, bench/rows_kernel.py). AVX2 has 16. int4 keeps R group scales beside them (at most 31).
template <int B>
constexpr int rows_per_step() {
  if constexpr (kWidth == 16)
    return B == 1 ? 4 : B == 2 ? 8 : B == 3 ? 6 : B == 4 ? 5 : B <= 6 ? 4 : 3;
  else
    return B <= 2 ? 4 : B <= 4 ? 2 : 1;
}

#if defined(__AVX512BF16__)
// bf16 weights times 2-8 rows that are bf16 numbers (a bf16 model's activations), on a CPU with AVX512-BF16:
// vdpbf16ps multiplies 32 bf16 pairs into 16 fp32 lanes an instruction (each lane adds x[2j] w[2j] and x[2j + 1]
// w[2j + 1], the products exact in fp32): twice the FMA form's products an instruction, and the weights not widened.
// The same sums of the same exact products in another order; input and output denormals count as 0 (the
// instruction's rule: no bf16 activation of a model is one). Rows of at most kPairsStream values go one weight row
// at a time, each thread's rows one stream prefetched kAhead[1] bytes ahead (the B input rows stay in L1); longer
// rows R at a time in lockstep (each input vector loaded once for R weight rows), prefetched as rows_at. GB/s of
// weights, 8 rows, Zen 4, 2 threads, interleaved (2026-11-30), one row a stream (1024 / 4096 bytes ahead) against
// R in lockstep: 48 768 x 768 weights 22 / 25 against 18, 12 3072 x 768 18 / 23 against 19, the 50257 x 768 LM
// head 28 against 21 (the FMA form 15-16); 12 768 x 3072 14-15 against 23. At 4 rows the same choice measured
// best for every shape; at 2, for all but 3072 x 768 (within 2%). gpt2 greedy batch 8 of a
// bf16 model, whole decodes (64 new tokens, two in-process runs of 7 interleaved rounds): 536-550 tok/s against
// 409-427 in the FMA form, the same tokens.
constexpr int64_t kPairsStream = 1024;
template <int B, int R>
static inline void rows_at_pairs(const uint16_t* xb, int64_t in, const uint16_t* w, const float* bias, float* y,
                                 int64_t out, int64_t o) {
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  __m512bh wv[R];
  for (int64_t i = 0; i < in; i += 32) {  // in: a multiple of 32 (product's check)
    for (int r = 0; r < R; ++r) {
      if constexpr (R == 1)  // one row: kAhead[1] bytes on in the stream of rows
        _mm_prefetch(reinterpret_cast<const char*>(w + o * in + i) + kAhead[1], _MM_HINT_T0);
      else  // the same place two groups on, as rows_at
        _mm_prefetch(reinterpret_cast<const char*>(w + (o + 2 * R + r) * in + i), _MM_HINT_T0);
      wv[r] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + (o + r) * in + i));
    }
    for (int b = 0; b < B; ++b) {
      const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(xb + b * in + i));
      for (int r = 0; r < R; ++r) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xv, wv[r]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) y[b * out + o + r] = _mm512_reduce_add_ps(acc[r][b]) + (bias ? bias[o + r] : 0.0f);
}

// x's n values as bf16 bits into xb where every one is a bf16 number (its low 16 bits zero), else false.
static bool bf16_numbers(const float* x, int64_t n, std::vector<uint16_t>& xb) {
  xb.resize(n);
  uint32_t low = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, x + i, sizeof bits);
    low |= bits & 0xFFFFu;
    xb[i] = static_cast<uint16_t>(bits >> 16);
  }
  return low == 0;
}
#endif

template <int B, typename W>
static void product(const float* x, int64_t in, W w, const float* bias, float* y, int64_t out, int threads) {
  if constexpr (B == 1) {
    // what each row's product reads of the input besides x, made once a call: int4 read plus 8 (the AVX2 build) the
    // input's sum over each group of columns; bf16 in the AVX512 build x in its row_dot's pairs order
    std::vector<float> gsum;
    if constexpr (std::is_same_v<W, Int4> && kInt4Plus8) {
      gsum.assign(in / w.group, 0.0f);
      for (int64_t i = 0; i < in; ++i) gsum[i / w.group] += x[i];
    }
    if constexpr (std::is_same_v<W, Dense<uint16_t>> && kWidth == 16) {  // bf16, AVX512: x in row_dot's pairs order
      gsum.resize(in / 32 * 32);
      for (int64_t k = 0; k + 32 <= in; k += 32)
        for (int j = 0; j < 16; ++j) {
          gsum[k + j] = x[k + 2 * j];
          gsum[k + 16 + j] = x[k + 2 * j + 1];
        }
    }
    if constexpr (std::is_same_v<W, Int4>) {
      if (w.group == kBlock) {  // two rows at a time (row_pair_int4), the last of an odd count alone
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t p = 0; p < out / 2; ++p) row_pair_int4(x, in, w, 2 * p, gsum.data(), y);
        if (out % 2) y[out - 1] = row_dot(x, in, w, out - 1, gsum.data());
        if (bias)
          for (int64_t o = 0; o < out; ++o) y[o] += bias[o];
        return;
      }
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < out; ++o) y[o] = row_dot(x, in, w, o, gsum.data()) + (bias ? bias[o] : 0.0f);
    return;
  }
  constexpr int R = rows_per_step<B>();
  const int64_t steps = out / R;  // whole steps of R rows; the rows left over go one at a time below
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<W, Dense<uint16_t>>) {
    std::vector<uint16_t> xb;
    if (in % 32 == 0 && bf16_numbers(x, B * in, xb)) {
      if (in <= kPairsStream) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t o = 0; o < out; ++o) rows_at_pairs<B, 1>(xb.data(), in, w.w, bias, y, out, o);
        return;
      }
#pragma omp parallel for num_threads(threads) schedule(static)
      for (int64_t s = 0; s < steps; ++s) rows_at_pairs<B, R>(xb.data(), in, w.w, bias, y, out, s * R);
      for (int64_t o = steps * R; o < out; ++o) rows_at_pairs<B, 1>(xb.data(), in, w.w, bias, y, out, o);
      return;
    }
  }
#endif
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t s = 0; s < steps; ++s) rows_at<B, R>(x, in, w, bias, y, out, s * R);
  for (int64_t o = steps * R; o < out; ++o) rows_at<B, 1>(x, in, w, bias, y, out, o);
}

template <typename W>
static int dispatch(int64_t rows, const float* x, int64_t in, W w, const float* bias, float* y, int64_t out,
                    int threads) {
  switch (rows) {
    case 1: product<1>(x, in, w, bias, y, out, threads); return 0;
    case 2: product<2>(x, in, w, bias, y, out, threads); return 0;
    case 3: product<3>(x, in, w, bias, y, out, threads); return 0;
    case 4: product<4>(x, in, w, bias, y, out, threads); return 0;
    case 5: product<5>(x, in, w, bias, y, out, threads); return 0;
    case 6: product<6>(x, in, w, bias, y, out, threads); return 0;
    case 7: product<7>(x, in, w, bias, y, out, threads); return 0;
    case 8: product<8>(x, in, w, bias, y, out, threads); return 0;
    default: return -1;
  }
}

// More than 8 input rows (a short prompt's pass, a decode step of 9+ rows; fp32: modules/linear.py): a GEMM whose
// inner product runs the other way from rows_at's. The input rows are packed first, transposed, in blocks of MB rows
// (xt[k][j] = x[m0 + j][k], zero past the last row); then each weight element is broadcast into a vector and
// multiplied into MB accumulators, one a lane per input row: y[m0 .. m0 + MB, o] accumulates w[o, k] * xt[k] over k.
// R weight rows at a time give R x MV independent sums (MV = MB / kWidth vectors a row block) and each loaded input
// vector feeds R FMAs; no horizontal sums remain at the end (rows_at reduces every accumulator across its lanes).
// Every thread takes a run of R-row blocks of the weight and multiplies each against all the input blocks while it
// sits in the core's cache (12 rows of 3072 floats, 144 KB), so the weight streams through once. The sums run over k
// in chunks of kChunk, each chunk's sum added to the running total in memory (as a blocked GEMM's passes over C do):
// fp32 rounding like torch's product (rel. error ~3e-7 where one chain over 768 gave 1e-6). gpt2's 48 block weights,
// Zen 4, 2 threads (2026-12-01, medians of 9): 16 rows 21 ms against 29 in rows_at's tiles (8 input rows a pass) and
// ONNX Runtime's MatMul 21 ms; 32 rows 36 against 47; 64 rows 71 against 90; 128 rows 128 against 171 (about 160
// GFLOP/s of the ~200 its FMA units give). Blocks of 2 x kWidth rows (12 weight rows: 24 accumulators of the 32
// registers; AVX2: 6 weight rows, 12 of 16) and, for a last block of at most kWidth rows or a call of 9-16 rows,
// kWidth rows (12 weight rows).
constexpr int64_t kChunk = 256;
constexpr int kBigR = kWidth == 16 ? 12 : 6;  // weight rows a step for blocks of 2 x kWidth input rows
constexpr int kSmallR = 12;  // and for blocks of kWidth

// acc (R x MV vectors, kept in `sums`: R rows of MV x kWidth floats) = w[o .. o + R] x the packed block xt, over k.
template <int MV, int R>
static inline void gemm_block(const float* xt, int64_t in, const float* w, float* sums) {
  constexpr int64_t MB = MV * kWidth;
  for (int64_t k0 = 0; k0 < in; k0 += kChunk) {
    const int64_t k1 = std::min(in, k0 + kChunk);
    vf acc[R][MV];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < MV; ++v) acc[r][v] = vzero();
    for (int64_t k = k0; k < k1; ++k) {
      vf xv[MV];
      for (int v = 0; v < MV; ++v) xv[v] = xload(xt + k * MB + v * kWidth);
      for (int r = 0; r < R; ++r) {
        const vf wv = vset1(w[r * in + k]);
        for (int v = 0; v < MV; ++v) acc[r][v] = vfma(wv, xv[v], acc[r][v]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < MV; ++v) {
        float* to = sums + r * MB + v * kWidth;
        vstore(to, k0 == 0 ? acc[r][v] : vadd(acc[r][v], xload(to)));
      }
  }
}

// Weight rows o .. o + R (R = rows or the rest: 1 at a time) times every packed input block, into y with the bias.
template <int R>
static inline void gemm_rows(const float* xt, const int64_t* blocks, int64_t nblocks, int64_t rows, int64_t in,
                             const float* w, const float* bias, float* y, int64_t out, int64_t o) {
  alignas(64) float sums[R * 2 * kWidth];
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t m0 = blocks[2 * b], mb = blocks[2 * b + 1];  // the block's first row and its width (kWidth or 2x)
    const float* block = xt + m0 * in;
    if (mb == kWidth)
      gemm_block<1, R>(block, in, w + o * in, sums);
    else
      gemm_block<2, R>(block, in, w + o * in, sums);
    const int64_t m1 = std::min(rows, m0 + mb);
    for (int r = 0; r < R; ++r) {
      const float add = bias ? bias[o + r] : 0.0f;
      for (int64_t m = m0; m < m1; ++m) y[m * out + o + r] = sums[r * mb + (m - m0)] + add;
    }
  }
}

template <int R>
static void gemm_over(const float* xt, const int64_t* blocks, int64_t nblocks, int64_t rows, int64_t in,
                      const float* w, const float* bias, float* y, int64_t out, int threads) {
  const int64_t steps = out / R;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t s = 0; s <= steps; ++s) {
    if (s < steps) {
      gemm_rows<R>(xt, blocks, nblocks, rows, in, w, bias, y, out, s * R);
    } else {  // the weight's last rows, fewer than R
      for (int64_t o = steps * R; o < out; ++o) gemm_rows<1>(xt, blocks, nblocks, rows, in, w, bias, y, out, o);
    }
  }
}

static void product_many(int64_t rows, const float* x, int64_t in, const float* w, const float* bias, float* y,
                         int64_t out, int threads) {
  // the input blocks: 2 x kWidth rows each, the last kWidth where no more rows are left for it
  std::vector<int64_t> blocks;
  for (int64_t m0 = 0; m0 < rows;) {
    const int64_t mb = rows - m0 <= kWidth ? kWidth : 2 * kWidth;
    blocks.push_back(m0);
    blocks.push_back(mb);
    m0 += mb;
  }
  const int64_t nblocks = static_cast<int64_t>(blocks.size() / 2);
  const int64_t padded = blocks[2 * (nblocks - 1)] + blocks[2 * nblocks - 1];
  std::vector<float> xt(padded * in);  // block b at xt + m0 * in: (in, mb), rows past the last zero
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t m0 = blocks[2 * b], mb = blocks[2 * b + 1];
    float* block = xt.data() + m0 * in;
    for (int64_t k = 0; k < in; ++k)
      for (int64_t j = 0; j < mb; ++j) block[k * mb + j] = m0 + j < rows ? x[(m0 + j) * in + k] : 0.0f;
  }
  if (rows <= kWidth)  // one block of kWidth rows: its own weight rows a step
    gemm_over<kSmallR>(xt.data(), blocks.data(), nblocks, rows, in, w, bias, y, out, threads);
  else
    gemm_over<kBigR>(xt.data(), blocks.data(), nblocks, rows, in, w, bias, y, out, threads);
}

// ---- integer products: int8 or int4 weights times int8 activations (quantize="w8a8" / "w4a8") -------------------
// The input rows are quantized first, in blocks of 32 columns: d = max|x of the block| / 127 (0 for an all-zero
// block), qx = round(x / d) to nearest even, in -127..127 (modules/quant.py: quantize_activations, the same rule).
// Each weight row's block of 32 then multiplies in integers: AVX2's vpmaddubsw multiplies unsigned by signed bytes
// and adds pairs into 16 bits, vpmaddwd adds those pairs into 32-bit lanes, exact (int8: |w| <= 128 and |qx| <= 127,
// a pair at most 32512; int4: w + 8 <= 15); the block's 32-bit sum is converted once and multiplied by d (and by
// int4's group scale); int8's per-row scale is applied once at the end. So the result is the fp32 product of the
// quantized activations and the dequantized weights, to float rounding. Written with 256-bit integer operations
// only, except where the CPU has AVX512-VNNI (the native build of an Ice Lake or later Xeon, a Zen 4): there
// vpdpbusd does the unsigned x signed multiply and the adds into 32-bit lanes in one instruction, with no 16-bit
// step, and the blocks go two at a time through 512-bit registers (ROWS_VNNI below). The AVX2 build of the same CPU
// (GPT2_DECODE_PLAN=avx2, the tests' second form) keeps the vpmaddubsw code, so both are tested on such a machine.
constexpr int64_t kQBlock = 32;  // activation columns per scale
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ROWS_VNNI 1
#endif

struct QuantRows {  // B rows of `in` activations, quantized
  std::vector<int8_t> q;   // (B, in)
  std::vector<float> d;    // (B, in / 32): each block's scale
  std::vector<int32_t> s;  // (B, in / 32): each block's sum of q (int4 takes 8 x it off)
#ifdef ROWS_VNNI
  // (B, in / 64, 16): for each pair of blocks (2p, 2p + 1), lanes 0-7 block 2p's and 8-15 block 2p + 1's d and -s,
  // the 512-bit products' per-lane scale and int4's starting sums (made once per call, read for every weight row)
  std::vector<float> dpair;
  std::vector<int32_t> spair;
#endif
};

static void quantize_rows(const float* x, int64_t rows, int64_t in, QuantRows& out) {
  const int64_t blocks = in / kQBlock;
  out.q.resize(rows * in);
  out.d.resize(rows * blocks);
  out.s.resize(rows * blocks);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < rows * blocks; ++b) {
    const float* xb = x + b * kQBlock;
    __m256 v[4];
    __m256 top = _mm256_setzero_ps();
    for (int k = 0; k < 4; ++k) top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[k] = _mm256_loadu_ps(xb + 8 * k)));
    __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    t = _mm_max_ps(t, _mm_movehl_ps(t, t));
    t = _mm_max_ss(t, _mm_movehdup_ps(t));
    const float amax = _mm_cvtss_f32(t), d = amax / 127.0f;
    out.d[b] = d;
    __m256i packed = _mm256_setzero_si256();
    if (d > 0) {
      const __m256 dv = _mm256_set1_ps(d);
      __m256i i32[4];
      for (int k = 0; k < 4; ++k) i32[k] = _mm256_cvtps_epi32(_mm256_div_ps(v[k], dv));  // nearest even (MXCSR)
      // pack 4 x 8 int32 into 32 int8 (the packs interleave 128-bit lanes; the permutation restores column order)
      const __m256i i16 = _mm256_packs_epi32(i32[0], i32[1]), j16 = _mm256_packs_epi32(i32[2], i32[3]);
      packed = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(i16, j16), order);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.q.data() + b * kQBlock), packed);
    // the block's sum of q: bytes widened to 16 bits by pairs (vpmaddubsw by 1s is unsigned x signed), then 32
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_set1_epi8(1), packed);
    const __m256i quads = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(quads), _mm256_extracti128_si256(quads, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    out.s[b] = _mm_cvtsi128_si32(s4);
  }
#ifdef ROWS_VNNI
  const int64_t pairs = blocks / 2;
  out.dpair.resize(rows * pairs * 16);
  out.spair.resize(rows * pairs * 16);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t p = 0; p < pairs; ++p)
      for (int lane = 0; lane < 16; ++lane) {
        const int64_t k = r * blocks + 2 * p + lane / 8;
        out.dpair[(r * pairs + p) * 16 + lane] = out.d[k];
        out.spair[(r * pairs + p) * 16 + lane] = -out.s[k];
      }
#endif
}

// 32 int8 weights times 32 int8 activations -> 8 lanes of 32-bit sums: vpmaddubsw wants an unsigned operand, so
// |w| (vpsignb of w by itself: -128 gives 0x80, 128 unsigned) times qx with w's sign moved onto it.
static inline __m256i dot32(const int8_t* w, const int8_t* qx) {
  const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx));
#ifdef ROWS_VNNI
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
#else
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
}

// An int4 block (16 bytes, Int4's layout) times 32 int8 activations: the nibbles plus 8 (0..15: XOR 0x88 flips
// each nibble's top bit), low nibbles in bytes 0-15 and high ones in 16-31, the columns' order, so vpmaddubsw takes
// them as the unsigned operand; the block's 8 x sum(qx) is taken off as -sum(qx) in each of the 8 lanes.
static inline __m256i dot32_int4(const uint8_t* block, const int8_t* qx, int32_t qsum) {
  const __m128i raw = _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block)),
                                    _mm_set1_epi8(static_cast<char>(0x88)));
  const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx));
#ifdef ROWS_VNNI
  const __m256i sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, xv);
#else
  const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), _mm256_set1_epi16(1));
#endif
  return _mm256_sub_epi32(sums, _mm256_set1_epi32(qsum));
}

// Row o of the weight times quantized input row b, two blocks at a time in two accumulators, prefetching kAhead[4]
// bytes ahead in the row's stream (as row_dot).
static inline float qrow_dot(const QuantRows& x, int64_t b, int64_t in, Dense<int8_t> weight, int64_t o) {
  const int64_t blocks = in / kQBlock;
  const int8_t* row = weight.w + o * in;
  const int8_t* qx = x.q.data() + b * in;
  const float* d = x.d.data() + b * blocks;
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 2 <= blocks; k += 2) {
    _mm_prefetch(reinterpret_cast<const char*>(row + k * kQBlock) + kAhead[4], _MM_HINT_T0);
    a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(row + k * kQBlock, qx + k * kQBlock)), _mm256_set1_ps(d[k]), a0);
    a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(row + (k + 1) * kQBlock, qx + (k + 1) * kQBlock)),
                         _mm256_set1_ps(d[k + 1]), a1);
  }
  if (k < blocks) a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(row + k * kQBlock, qx + k * kQBlock)),
                                       _mm256_set1_ps(d[k]), a0);
  return hsum256(_mm256_add_ps(a0, a1)) * weight.scale[o];
}

static inline __m256 int4_block(const uint8_t* row, const int8_t* qx, const float* d, const int32_t* s, int64_t k,
                                float scale, __m256 acc) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32_int4(row + k * kQBlock / 2, qx + k * kQBlock, s[k])),
                         _mm256_set1_ps(d[k] * scale), acc);
}

static inline float qrow_dot(const QuantRows& x, int64_t b, int64_t in, Int4 weight, int64_t o) {
  const int64_t blocks = in / kQBlock, per_group = weight.group / kQBlock, groups = in / weight.group;
  const uint8_t* row = weight.w + o * (in / 2);
  const float* scale = weight.scale + o * groups;
  const int8_t* qx = x.q.data() + b * in;
  const float* d = x.d.data() + b * blocks;
  const int32_t* s = x.s.data() + b * blocks;
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  if (per_group == 1) {  // groups of 32 (the default): a scale a block
    int64_t k = 0;
    for (; k + 2 <= blocks; k += 2) {  // 32 bytes a step: the line kAhead[5] bytes on prefetched every other step
      if (!(k & 2)) _mm_prefetch(reinterpret_cast<const char*>(row + k * kQBlock / 2) + kAhead[5], _MM_HINT_T0);
      a0 = int4_block(row, qx, d, s, k, scale[k], a0);
      a1 = int4_block(row, qx, d, s, k + 1, scale[k + 1], a1);
    }
    if (k < blocks) a0 = int4_block(row, qx, d, s, k, scale[k], a0);
  } else {
    for (int64_t g = 0, k = 0; g < groups; ++g) {
      const int64_t end = k + per_group;
      for (; k + 2 <= end; k += 2) {
        _mm_prefetch(reinterpret_cast<const char*>(row + k * kQBlock / 2) + kAhead[5], _MM_HINT_T0);
        a0 = int4_block(row, qx, d, s, k, scale[g], a0);
        a1 = int4_block(row, qx, d, s, k + 1, scale[g], a1);
      }
      if (k < end) {
        _mm_prefetch(reinterpret_cast<const char*>(row + k * kQBlock / 2) + kAhead[5], _MM_HINT_T0);
        a0 = int4_block(row, qx, d, s, k++, scale[g], a0);
      }
    }
  }
  return hsum256(_mm256_add_ps(a0, a1));
}

#ifdef ROWS_VNNI
// With VNNI, weight row o times all R input rows at once, two blocks (64 columns) a step in 512-bit registers:
// the weight's 64 values are prepared once a step and multiplied into each row's accumulator (lanes 0-7 block 2p,
// 8-15 block 2p + 1, each lane's 32-bit sum converted and scaled by its block's d); an odd last block goes through
// the 256-bit dot32 / dot32_int4 above. int8: AVX512 has no vpsignb, so |w| (vpabsb: -128 gives 0x80, 128
// unsigned) times qx with w's sign moved onto it by a masked negation (qx is in -127..127, so -qx fits).
template <int R>
static void qrows(const QuantRows& x, int64_t in, Dense<int8_t> weight, int64_t o, const float* bias, float* y,
                  int64_t out) {
  const int64_t blocks = in / kQBlock, pairs = blocks / 2;
  const int8_t* row = weight.w + o * in;
  __m512 acc[R];
  for (int b = 0; b < R; ++b) acc[b] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {  // 64 bytes (one line) a step: the line kAhead[4] bytes on prefetched
    _mm_prefetch(reinterpret_cast<const char*>(row + 64 * p) + kAhead[4], _MM_HINT_T0);
    const __m512i wv = _mm512_loadu_si512(row + 64 * p);
    const __m512i magnitude = _mm512_abs_epi8(wv);
    const __mmask64 negative = _mm512_movepi8_mask(wv);
    for (int b = 0; b < R; ++b) {
      const __m512i xv = _mm512_loadu_si512(x.q.data() + b * in + 64 * p);
      const __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), magnitude,
                                               _mm512_mask_sub_epi8(xv, negative, _mm512_setzero_si512(), xv));
      acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_loadu_ps(x.dpair.data() + (b * pairs + p) * 16),
                               acc[b]);
    }
  }
  for (int b = 0; b < R; ++b) {
    float sum = _mm512_reduce_add_ps(acc[b]);
    if (blocks & 1) {
      const int64_t k = blocks - 1;
      sum += hsum256(_mm256_cvtepi32_ps(dot32(row + k * kQBlock, x.q.data() + b * in + k * kQBlock))) *
             x.d[b * blocks + k];
    }
    y[b * out + o] = sum * weight.scale[o] + (bias ? bias[o] : 0.0f);
  }
}

// int4: a pair of blocks is 32 bytes; each 16-byte block duplicated into two 128-bit lanes (vpermq), the second
// copy shifted down 4 bits (vpsrlvw), then low nibbles kept and their top bit flipped in one vpternlogd ((a & 0x0F)
// ^ 0x08): lanes of 16 values, block 2p's low nibbles, its high ones, then block 2p + 1's, the columns' order, each
// plus 8. Each row's sums start at -sum(qx) a lane (8 lanes: 8 x sum(qx) a block, taken off in the same vpdpbusd),
// are converted and scaled by d times the group's scale.
static inline __m512i int4_pair(const uint8_t* p) {
  const __m512i dup = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3),
                                               _mm512_castsi256_si512(_mm256_loadu_si256(
                                                   reinterpret_cast<const __m256i*>(p))));
  const __m512i shifted = _mm512_srlv_epi16(dup, _mm512_setr_epi64(0, 0, 0x0004000400040004LL, 0x0004000400040004LL,
                                                                    0, 0, 0x0004000400040004LL, 0x0004000400040004LL));
  return _mm512_ternarylogic_epi32(shifted, _mm512_set1_epi8(0x0F), _mm512_set1_epi8(0x08), 0x6A);
}

template <int R>
static void qrows(const QuantRows& x, int64_t in, Int4 weight, int64_t o, const float* bias, float* y,
                  int64_t out) {
  const int64_t blocks = in / kQBlock, pairs = blocks / 2, per_group = weight.group / kQBlock;
  const int64_t groups = in / weight.group;
  const uint8_t* row = weight.w + o * (in / 2);
  const float* scale = weight.scale + o * groups;
  const __m512i halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  __m512 acc[R];
  for (int b = 0; b < R; ++b) acc[b] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {  // 32 bytes a step: the line kAhead[5] bytes on prefetched every other step
    if (!(p & 1)) _mm_prefetch(reinterpret_cast<const char*>(row + 32 * p) + kAhead[5], _MM_HINT_T0);
    const __m512i w = int4_pair(row + 32 * p);
    __m512 group_scale;  // block 2p's group scale in lanes 0-7, block 2p + 1's in 8-15
    if (per_group == 1) {
      group_scale = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(_mm_castpd_ps(
                                                      _mm_load_sd(reinterpret_cast<const double*>(scale + 2 * p)))));
    } else {
      const float lo = scale[2 * p / per_group], hi = scale[(2 * p + 1) / per_group];
      group_scale = _mm512_castsi512_ps(_mm512_inserti64x4(_mm512_castps_si512(_mm512_set1_ps(lo)),
                                                           _mm256_castps_si256(_mm256_set1_ps(hi)), 1));
    }
    for (int b = 0; b < R; ++b) {
      const int64_t at = (b * pairs + p) * 16;
      const __m512i sums = _mm512_dpbusd_epi32(_mm512_loadu_si512(x.spair.data() + at), w,
                                               _mm512_loadu_si512(x.q.data() + b * in + 64 * p));
      acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(_mm512_loadu_ps(x.dpair.data() + at),
                                                                        group_scale), acc[b]);
    }
  }
  for (int b = 0; b < R; ++b) {
    float sum = _mm512_reduce_add_ps(acc[b]);
    if (blocks & 1) {
      const int64_t k = blocks - 1;
      sum += hsum256(int4_block(row, x.q.data() + b * in, x.d.data() + b * blocks, x.s.data() + b * blocks, k,
                                scale[k / per_group], _mm256_setzero_ps()));
    }
    y[b * out + o] = sum + (bias ? bias[o] : 0.0f);
  }
}

template <int R, typename W>
static void qproduct_rows(const QuantRows& qx, int64_t in, W w, const float* bias, float* y, int64_t out,
                          int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t o = 0; o < out; ++o) qrows<R>(qx, in, w, o, bias, y, out);
}
#endif

// B rows (1..8) by the weight: the rows quantized once, then each thread takes its block of weight rows as one
// stream and multiplies each row by every input row (the row read from memory once, from L1 for the others).
template <typename W>
static int qproduct(int64_t rows, const float* x, int64_t in, W w, const float* bias, float* y, int64_t out,
                    int threads) {
  if (rows < 1 || rows > kMaxRows) return -1;
  if (in % kQBlock != 0) return -2;
  QuantRows qx;
  quantize_rows(x, rows, in, qx);
#ifdef ROWS_VNNI
  switch (rows) {
    case 1: qproduct_rows<1>(qx, in, w, bias, y, out, threads); break;
    case 2: qproduct_rows<2>(qx, in, w, bias, y, out, threads); break;
    case 3: qproduct_rows<3>(qx, in, w, bias, y, out, threads); break;
    case 4: qproduct_rows<4>(qx, in, w, bias, y, out, threads); break;
    case 5: qproduct_rows<5>(qx, in, w, bias, y, out, threads); break;
    case 6: qproduct_rows<6>(qx, in, w, bias, y, out, threads); break;
    case 7: qproduct_rows<7>(qx, in, w, bias, y, out, threads); break;
    default: qproduct_rows<8>(qx, in, w, bias, y, out, threads); break;
  }
#else
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t o = 0; o < out; ++o)
    for (int64_t b = 0; b < rows; ++b) y[b * out + o] = qrow_dot(qx, b, in, w, o) + (bias ? bias[o] : 0.0f);
#endif
  return 0;
}

// x (rows, in) quantized as qproduct does: q (rows, in) int8, d (rows, in / 32) fp32 (the tests' view of it).
extern "C" int rows_quantize(const float* x, int64_t rows, int64_t in, int8_t* q, float* d) {
  if (in % kQBlock != 0) return -2;
  QuantRows qx;
  quantize_rows(x, rows, in, qx);
  std::memcpy(q, qx.q.data(), qx.q.size());
  std::memcpy(d, qx.d.data(), qx.d.size() * sizeof(float));
  return 0;
}

// The prompt's activations quantized per tensor (modules/quant.py, quantize_prompt_activations): the least and
// greatest of n >= 1 floats into lo_hi[0..1]; returns 1 (lo_hi unset) if any is NaN or infinite, else 0.
extern "C" int rows_minmax(const float* x, int64_t n, float* lo_hi, int threads) {
  float lo = x[0], hi = x[0], nan = 0.0f;  // nan: a sum of x * 0, NaN once any x is NaN or infinite
#pragma omp parallel for simd num_threads(threads) reduction(min : lo) reduction(max : hi) reduction(+ : nan) \
    schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    lo = x[i] < lo ? x[i] : lo;
    hi = x[i] > hi ? x[i] : hi;
    nan += x[i] * 0.0f;
  }
  if (nan != nan) return 1;
  lo_hi[0] = lo;
  lo_hi[1] = hi;
  return 0;
}

// q[i] = clamp(round(x[i] * inv) + zp, 0, 127), rounding to nearest with ties to even (torch.round's rule) on the
// fp32 product: 7-bit unsigned values, so that vpmaddubsw's pairs of u8 x s8 products cannot saturate 16 bits.
extern "C" void rows_quantize_u7(const float* x, int64_t n, float inv, int zp, uint8_t* q, int threads) {
  const float z = static_cast<float>(zp);
#pragma omp parallel for simd num_threads(threads) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float r = std::nearbyint(x[i] * inv) + z;
    q[i] = static_cast<uint8_t>(std::min(std::max(r, 0.0f), 127.0f));
  }
}

// ---- the prompt's integer products: many rows of per-tensor quantized activations (quantize="w8a8" / "w4a8") -----
// A prompt of 2 or more tokens multiplies its rows quantized per tensor (modules/quant.py, "the prompt's int8
// products": q = clamp(round(x / scale) + zp, 0, 127)) by an int8 weight with per-row scales:
// y[b, o] = (sum_i q[b, i] w[o, i] - zp colsum[o]) * scale * wscale[o] + bias[o], the integer sum exact, so the
// numbers are oneDNN's int8 linear's (the layers' path) to the rounding of that last line. The weight is packed once
// (rows_qgemm_pack) in tiles of 16 output rows: for each 4 inputs, 64 bytes, output j's 4 bytes at 4j, so one vector
// load holds 16 outputs' next 4 weights and one instruction adds 4 products into each output's 32-bit lane for one
// input row (its 4 bytes broadcast): VNNI's vpdpbusd (AVX512-VNNI builds), else vpmaddubsw (pairs into 16 bits:
// 7-bit activations keep the pair within 32512) and vpmaddwd by 1s. The tiles go in pairs (32 outputs; the last pair
// may hold one tile), a pair's two tiles interleaved: its 4 inputs' 64 bytes of the first tile, then of the second,
// then the next 4 inputs', so a pass over a pair reads one stream. A thread takes a block of pairs and runs every
// input row through each pair (kQRows rows a pass), so the weight is read from memory once per call and from the
// core's cache after. Against oneDNN's int8 linear through torch on a 2-core Zen 4 (gpt2's four shapes, x12 layers,
// weights from memory, 2026-12-02, docs/cpu-decoding.md): 9-512 rows 1.05-2.1x faster, the AVX2 form 2.5x faster
// at 16 rows than oneDNN held to AVX2 (ONEDNN_MAX_CPU_ISA=AVX2), 1.09x at 512. The pairs interleaved against their
// tiles apart (one stream a thread against two; gpt2's 48 weights, 85 MB read from memory, interleaved A/B, Zen 4, 2
// threads, 2026-12-02, two runs): 8 rows 4.0-4.8 -> 3.2-3.5 ms, 16 rows 5.8-7.5 -> 5.1-6.9, 128 rows 30.3-31.5 ->
// 29.9-30.1; the AVX2 build, 4 rows over a whole pair against one tile: 2 rows 5.5 -> 3.6 ms, 16 rows 11.2 -> 9.3.
// One tile with 16 rows a pass (one stream too, but a broadcast per vpdpbusd) ran 1.2-1.4x slower, and software
// prefetching gained nothing.
constexpr int64_t kQTile = 16;  // output rows of a packed tile
constexpr int64_t kQPair = 2;  // tiles interleaved in a packed pair
// the quantized activations are kept in whole blocks of 16 rows, zeros past the last row (quantize_prompt), which the
// AMX form's activation tiles read whole
constexpr int64_t kQRowBlock = 16;

static inline int64_t qgemm_weight_bytes(int64_t out, int64_t in) { return (out + kQTile - 1) / kQTile * kQTile * in; }

#ifdef ROWS_VNNI
// A tile's 16 int32 sums of one input row into its outputs from o: (sum - zp colsum) xscale wscale + bias, the
// outputs past `out` masked off (the VNNI and the AMX forms alike, so they give the same bits).
struct QTileOut {
  int64_t o;
  __mmask16 m;
  __m512i correction;
  __m512 scale, b;
  QTileOut(int64_t o_, int64_t out, const int32_t* colsum, const float* wscale, float xscale, int zp,
           const float* bias)
      : o(o_), m(out - o_ >= kQTile ? 0xFFFF : static_cast<__mmask16>((1u << (out - o_)) - 1)) {
    correction = _mm512_mullo_epi32(_mm512_set1_epi32(zp), _mm512_maskz_loadu_epi32(m, colsum + o));
    scale = _mm512_mul_ps(_mm512_set1_ps(xscale), _mm512_maskz_loadu_ps(m, wscale + o));
    b = bias ? _mm512_maskz_loadu_ps(m, bias + o) : _mm512_setzero_ps();
  }
  void store(__m512i sums, float* yrow) const {
    const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(sums, correction));
    _mm512_mask_storeu_ps(yrow + o, m, _mm512_fmadd_ps(v, scale, b));
  }
};

constexpr int kQRows = 8;  // input rows a pass: 8 rows x 2 tiles, 16 accumulators
// R input rows (x: R rows of `in` quantized bytes) times the pair at wt, whose nb (1, 2) tiles start at output o0.
template <int R>
static void qgemm_tiles(const uint8_t* x, int64_t in, const int8_t* wt, int64_t nb, const int32_t* colsum,
                        const float* wscale, float xscale, int zp, const float* bias, float* y, int64_t o0,
                        int64_t out) {
  __m512i acc[R][kQPair];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < kQPair; ++n) acc[r][n] = _mm512_setzero_si512();
  const int64_t quads = in / 4;
  for (int64_t k = 0; k < quads; ++k) {
    const int8_t* wk = wt + k * nb * 64;
    __m512i w[kQPair];
    for (int n = 0; n < kQPair; ++n)
      if (n < nb) w[n] = _mm512_loadu_si512(wk + n * 64);
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, x + r * in + 4 * k, 4);
      const __m512i xb = _mm512_set1_epi32(four);
      for (int n = 0; n < kQPair; ++n)
        if (n < nb) acc[r][n] = _mm512_dpbusd_epi32(acc[r][n], xb, w[n]);
    }
  }
  for (int n = 0; n < nb; ++n) {
    const QTileOut t(o0 + n * kQTile, out, colsum, wscale, xscale, zp, bias);
    for (int r = 0; r < R; ++r) t.store(acc[r][n], y + r * out);
  }
}
#else
// input rows a pass: 4 rows x 4 halves of 8 outputs, 16 accumulators, as many as there are registers (the compiler
// keeps some in the cache); 2 or 3 rows a pass ran 2-25% slower on gpt2's weights (Zen 4, the AVX2 build)
constexpr int kQRows = 4;
template <int R>
static void qgemm_tiles(const uint8_t* x, int64_t in, const int8_t* wt, int64_t nb, const int32_t* colsum,
                        const float* wscale, float xscale, int zp, const float* bias, float* y, int64_t o0,
                        int64_t out) {
  constexpr int H = 2 * kQPair;  // halves of 8 outputs in a pair
  __m256i acc[R][H];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < H; ++h) acc[r][h] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t halves = 2 * nb;
  for (int64_t k = 0; k < in / 4; ++k) {
    const int8_t* wk = wt + k * nb * 64;
    __m256i w[H];
    for (int h = 0; h < H; ++h)
      if (h < halves) w[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk + 32 * h));
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, x + r * in + 4 * k, 4);
      const __m256i xb = _mm256_set1_epi32(four);
      for (int h = 0; h < H; ++h)
        if (h < halves)
          acc[r][h] = _mm256_add_epi32(acc[r][h], _mm256_madd_epi16(_mm256_maddubs_epi16(xb, w[h]), ones));
    }
  }
  for (int h = 0; h < halves && o0 + 8 * h < out; ++h) {
    const int64_t o = o0 + 8 * h;
    alignas(32) int32_t sums[R][8];
    for (int r = 0; r < R; ++r) _mm256_store_si256(reinterpret_cast<__m256i*>(sums[r]), acc[r][h]);
    for (int64_t j = 0; j < 8 && o + j < out; ++j) {
      const float scale = xscale * wscale[o + j], b = bias ? bias[o + j] : 0.0f;
      for (int r = 0; r < R; ++r)
        y[r * out + o + j] = std::fma(static_cast<float>(sums[r][j] - zp * colsum[o + j]), scale, b);
    }
  }
}
#endif

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(ROWS_VNNI)
#define ROWS_AMX
// AMX-INT8 (Sapphire Rapids and later Xeons): the same integer products in tile registers. One tdpbusd adds a 16 x
// 64-byte tile of activations times a 64-byte x 16-output tile of weights into 16 x 16 int32 sums, and the weight
// tile is the packing above as it stands: 16 consecutive 4-input groups of one tile, 64 bytes each, a stride of
// nb x 64 bytes apart in the interleaved pair. A pass takes 32 input rows (two activation tiles) over a pair (two
// weight tiles, four sums); the sums go through the VNNI form's epilogue, so its outputs are the VNNI form's to the
// bit. Taken for inputs in multiples of 64 (a tile's depth) where Linux grants the tile state
// (arch_prctl(ARCH_REQ_XCOMP_PERM)); GPT2_PROMPT_AMX=0 keeps the VNNI form.
// gpt2's 48 weights, 2-core Xeon (2026-12-02, interleaved medians of 9): 16 rows 4.8-4.9 ms against VNNI's 7.2 and
// oneDNN's int8 linear's 9.1-9.3, 128 rows 13.8-15.4 / 26.0-26.4 / 18.2-18.3 (docs/cpu-decoding.md).
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdlib>

constexpr int64_t kARows = kQRowBlock;  // input rows of an activation tile
static bool amx_granted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return granted;
}
static bool amx_on(int64_t in) {
  const char* setting = std::getenv("GPT2_PROMPT_AMX");
  return in % 64 == 0 && !(setting && std::strcmp(setting, "0") == 0) && amx_granted();
}
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
// tiles 0-3: the sums (row block b, weight tile n at 2b + n), 4-5: the activations, 6-7: the weights
static void amx_configure() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = 16;
  _tile_loadconfig(&c);
}
// Activation rows r0.. (x in whole blocks of kARows rows, zeros past `rows`: quantize_prompt's) times the pair at wt
// (nb tiles from output o0): the sums into y's rows r0 .. rows - 1.
static void amx_pass(const uint8_t* x, int64_t r0, int64_t rows, int64_t in, const int8_t* wt, int64_t nb,
                     const int32_t* colsum, const float* wscale, float xscale, int zp, const float* bias, float* y,
                     int64_t o0, int64_t out) {
  const bool two = rows - r0 > kARows;  // a second activation tile
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const uint8_t* xa = x + r0 * in;
  const int64_t stride = nb * 64;
  for (int64_t k = 0; k < in; k += 64) {
    const int8_t* wk = wt + (k / 4) * stride;  // the weight tile's first 4-input group
    _tile_loadd(4, xa + k, in);
    if (two) _tile_loadd(5, xa + kARows * in + k, in);
    _tile_loadd(6, wk, stride);
    _tile_dpbusd(0, 4, 6);
    if (two) _tile_dpbusd(2, 5, 6);
    if (nb > 1) {
      _tile_loadd(7, wk + 64, stride);
      _tile_dpbusd(1, 4, 7);
      if (two) _tile_dpbusd(3, 5, 7);
    }
  }
  alignas(64) int32_t sums[4][kARows][16];
  _tile_stored(0, sums[0], 64);
  _tile_stored(1, sums[1], 64);
  _tile_stored(2, sums[2], 64);
  _tile_stored(3, sums[3], 64);
  for (int n = 0; n < nb; ++n) {
    const QTileOut t(o0 + n * kQTile, out, colsum, wscale, xscale, zp, bias);
    for (int64_t r = r0; r < std::min(rows, r0 + 2 * kARows); ++r)
      t.store(_mm512_load_si512(sums[2 * ((r - r0) / kARows) + n][(r - r0) % kARows]), y + r * out);
  }
}

static void qgemm_amx(int64_t rows, const uint8_t* x, int64_t in, const int8_t* packed, const int32_t* colsum,
                      int64_t tiles, int64_t pairs, const float* wscale, float xscale, int zp, const float* bias,
                      float* y, int64_t out, int threads) {
#pragma omp parallel num_threads(threads)
  {
    amx_configure();
#pragma omp for schedule(static)
    for (int64_t g = 0; g < pairs; ++g) {
      const int64_t t0 = g * kQPair, nb = std::min<int64_t>(kQPair, tiles - t0);
      for (int64_t r0 = 0; r0 < rows; r0 += 2 * kARows)
        amx_pass(x, r0, rows, in, packed + t0 * kQTile * in, nb, colsum, wscale, xscale, zp, bias, y, t0 * kQTile,
                 out);
    }
    _tile_release();
  }
}
#endif

// x: quantize_prompt's rows (whole blocks of kQRowBlock rows).
static void qgemm(int64_t rows, const uint8_t* x, int64_t in, const int8_t* packed, const float* wscale, float xscale,
                  int zp, const float* bias, float* y, int64_t out, int threads) {
  const int32_t* colsum = reinterpret_cast<const int32_t*>(packed + qgemm_weight_bytes(out, in));
  const int64_t tiles = (out + kQTile - 1) / kQTile, pairs = (tiles + kQPair - 1) / kQPair;
#ifdef ROWS_AMX
  if (amx_on(in))
    return qgemm_amx(rows, x, in, packed, colsum, tiles, pairs, wscale, xscale, zp, bias, y, out, threads);
#endif
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t g = 0; g < pairs; ++g) {
    const int64_t t0 = g * kQPair, nb = std::min<int64_t>(kQPair, tiles - t0), o0 = t0 * kQTile;
    const int8_t* wt = packed + t0 * kQTile * in;
    for (int64_t r0 = 0; r0 < rows; r0 += kQRows) {
      const uint8_t* xr = x + r0 * in;
      float* yr = y + r0 * out;
      switch (std::min<int64_t>(kQRows, rows - r0)) {
        case 1: qgemm_tiles<1>(xr, in, wt, nb, colsum, wscale, xscale, zp, bias, yr, o0, out); break;
        case 2: qgemm_tiles<2>(xr, in, wt, nb, colsum, wscale, xscale, zp, bias, yr, o0, out); break;
        case 3: qgemm_tiles<3>(xr, in, wt, nb, colsum, wscale, xscale, zp, bias, yr, o0, out); break;
#ifdef ROWS_VNNI
        case 4: qgemm_tiles<4>(xr, in, wt, nb, colsum, wscale, xscale, zp, bias, yr, o0, out); break;
        case 5: qgemm_tiles<5>(xr, in, wt, nb, colsum, wscale, xscale, zp, bias, yr, o0, out); break;
        case 6: qgemm_tiles<6>(xr, in, wt, nb, colsum, wscale, xscale, zp, bias, yr, o0, out); break;
        case 7: qgemm_tiles<7>(xr, in, wt, nb, colsum, wscale, xscale, zp, bias, yr, o0, out); break;
#endif
        default: qgemm_tiles<kQRows>(xr, in, wt, nb, colsum, wscale, xscale, zp, bias, yr, o0, out); break;
      }
    }
  }
}

// modules/quant.py's prompt_scale, in the same double arithmetic: the scale and zero point of activations whose
// least and greatest values are lo and hi.
static void prompt_scale(double lo, double hi, double* scale, int* zp) {
  lo = std::min(lo, 0.0);
  hi = std::max(hi, 0.0);
  if (hi == lo) {
    *scale = 1.0;
    *zp = 0;
    return;
  }
  const double levels = 127.0;
  *zp = static_cast<int>(std::nearbyint(levels * -lo / (hi - lo)));  // Python's round: to nearest, ties to even
  *scale = std::max(*zp < 127 ? hi / (levels - *zp) : 0.0, *zp > 0 ? -lo / *zp : 0.0);
}

struct PromptRows {  // rows of activations quantized per tensor: q = clamp(round(x / scale) + zp, 0, 127)
  std::vector<uint8_t> q;  // in whole blocks of kQRowBlock rows, zeros past the last (qgemm's AMX form reads them)
  float scale;
  int zp;
};

// x (rows, in) fp32 quantized per tensor as modules/quant.py's quantize_prompt_activations does (the same bits);
// false where x holds a NaN or an infinity or its range is too small for an fp32 scale.
static bool quantize_prompt(int64_t rows, const float* x, int64_t in, int threads, PromptRows& out) {
  float lo_hi[2];
  if (rows_minmax(x, rows * in, lo_hi, threads)) return false;
  double scale;
  prompt_scale(lo_hi[0], lo_hi[1], &scale, &out.zp);
  const float inv = static_cast<float>(1.0 / scale);
  if (!std::isfinite(inv)) return false;
  out.scale = static_cast<float>(scale);
  out.q.assign((rows + kQRowBlock - 1) / kQRowBlock * kQRowBlock * in, 0);
  rows_quantize_u7(x, rows * in, inv, out.zp, out.q.data(), threads);
  return true;
}

// x (rows, in) quantized (quantize_prompt) and multiplied by a packed weight (rows_qgemm_pack's) -> y (rows, out).
// Returns 0, or -4 where x cannot be quantized (nothing written: the caller multiplies in fp32).
static int prompt_qproduct(int64_t rows, const float* x, int64_t in, const int8_t* packed, const float* wscale,
                           const float* bias, float* y, int64_t out, int threads) {
  PromptRows p;
  if (!quantize_prompt(rows, x, in, threads, p)) return -4;
  qgemm(rows, p.q.data(), in, packed, wscale, p.scale, p.zp, bias, y, out, threads);
  return 0;
}

extern "C" {

// The bytes of an (out, in) int8 weight packed for the prompt's products: its tiles, then one int32 sum a row.
int64_t rows_qgemm_bytes(int64_t out, int64_t in) { return qgemm_weight_bytes(out, in) + 4 * out; }

// w (out, in) int8 into `packed` (rows_qgemm_bytes): tiles of 16 rows as above (rows past `out` zero), then each
// row's sum of w. Returns 0, -2 where in is not a multiple of 4 (nothing written).
int rows_qgemm_pack(const int8_t* w, int64_t out, int64_t in, int8_t* packed) {
  if (in % 4 != 0 || in < 4 || out < 1) return -2;
  const int64_t quads = in / 4, tiles = (out + kQTile - 1) / kQTile;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t t0 = t / kQPair * kQPair, nb = std::min<int64_t>(kQPair, tiles - t0);  // its pair: first, tiles
    int8_t* tile = packed + t0 * quads * 64 + (t - t0) * 64;  // its first 64 bytes; the pair's tiles interleaved
    for (int64_t k = 0; k < quads; ++k)
      for (int64_t j = 0; j < kQTile; ++j) {
        const int64_t o = t * kQTile + j;
        int8_t* to = tile + k * nb * 64 + 4 * j;
        if (o < out)
          std::memcpy(to, w + o * in + 4 * k, 4);
        else
          std::memset(to, 0, 4);
      }
  }
  int32_t* colsum = reinterpret_cast<int32_t*>(packed + qgemm_weight_bytes(out, in));
  for (int64_t o = 0; o < out; ++o) {
    int32_t s = 0;
    for (int64_t i = 0; i < in; ++i) s += w[o * in + i];
    colsum[o] = s;
  }
  return 0;
}

// The prompt's product of x (rows >= 1, in) fp32 and a packed weight (wscale: its per-row scales; bias or null) ->
// y (rows, out), x quantized per tensor inside: 0, or -4 as prompt_qproduct (nothing written).
int rows_qgemm(int64_t rows, const float* x, int64_t in, const int8_t* packed, const float* wscale, const float* bias,
               float* y, int64_t out, int threads) {
  if (rows < 1 || in % 4 != 0) return -2;
  return prompt_qproduct(rows, x, in, packed, wscale, bias, y, out, threads < 1 ? 1 : threads);
}

}  // extern "C"

extern "C" {

// kind: 0 fp32, 1 bf16 (as uint16 bits), 2 int8 (needs scale), 3 int4 (needs scale (out, in / group) and group, a
// multiple of 32 dividing in; the other kinds ignore group); 4 and 5: 2 and 3 with the activations quantized to
// int8 in blocks of 32 (in a multiple of 32). scale and bias may be null otherwise. Returns 0; -1 where rows is
// outside 1..8 or kind unknown, -2 for a weight without its scale, a group or an `in` that does not fit (nothing
// written).
int rows_product(int kind, int64_t rows, const float* x, int64_t in, const void* w, const float* scale,
                 const float* bias, float* y, int64_t out, int threads, int64_t group) {
  if (threads < 1) threads = 1;
  switch (kind) {
    case 0: return dispatch(rows, x, in, Dense<float>{static_cast<const float*>(w), scale}, bias, y, out, threads);
    case 1: return dispatch(rows, x, in, Dense<uint16_t>{static_cast<const uint16_t*>(w), scale}, bias, y, out, threads);
    case 2: return dispatch(rows, x, in, Dense<int8_t>{static_cast<const int8_t*>(w), scale}, bias, y, out, threads);
    case 3:
      if (!scale || group <= 0 || group % kBlock != 0 || in % group != 0) return -2;
      return dispatch(rows, x, in, Int4{static_cast<const uint8_t*>(w), scale, group}, bias, y, out, threads);
    case 4:  // int8 weights, int8 activations
      if (!scale) return -2;
      return qproduct(rows, x, in, Dense<int8_t>{static_cast<const int8_t*>(w), scale}, bias, y, out, threads);
    case 5:  // int4 weights, int8 activations
      if (!scale || group <= 0 || group % kBlock != 0 || in % group != 0) return -2;
      return qproduct(rows, x, in, Int4{static_cast<const uint8_t*>(w), scale, group}, bias, y, out, threads);
    default: return -1;
  }
}

// fp32 products of any number of rows (product_many: the input rows packed in blocks, weight elements broadcast):
// y (rows, out) = x (rows, in) w^T + bias. Returns 0; -1 for rows < 1 (nothing written).
int rows_product_many(int64_t rows, const float* x, int64_t in, const float* w, const float* bias, float* y,
                      int64_t out, int threads) {
  if (rows < 1) return -1;
  product_many(rows, x, in, w, bias, y, out, threads < 1 ? 1 : threads);
  return 0;
}

int rows_vector_width() { return static_cast<int>(kWidth); }

// The prefetch distance of the products' weight streams, in bytes, for every weight kind: set to `bytes` where it
// is positive (before any product runs), fp32's returned either way.
int64_t rows_prefetch(int64_t bytes) {
  if (bytes > 0) std::fill(std::begin(kAhead), std::end(kAhead), bytes);
  return kAhead[0];
}

// The same for one weight kind (kAhead's index; the decode plan sets each kind's once): -1 for another kind.
int64_t rows_prefetch_kind(int kind, int64_t bytes) {
  if (kind < 0 || kind >= static_cast<int>(std::size(kAhead))) return -1;
  if (bytes > 0) kAhead[kind] = bytes;
  return kAhead[kind];
}

// 1 where the prompt's int8 products of `in` inputs take AMX's tiles here (a build with AMX-INT8, the tile state
// granted, GPT2_PROMPT_AMX not 0, `in` a multiple of 64), else 0
int rows_qgemm_amx(int64_t in) {
#ifdef ROWS_AMX
  return amx_on(in) ? 1 : 0;
#else
  (void)in;
  return 0;
#endif
}

// 1 where this build multiplies int8 activations with VNNI's vpdpbusd (ROWS_VNNI), else 0 (vpmaddubsw)
int rows_vnni() {
#ifdef ROWS_VNNI
  return 1;
#else
  return 0;
#endif
}
}

// ---- one decoding step of a plain GPT-2, for 1 to 8 rows (fp32: more) -----------------------------------------------
// Decoding one token runs a few hundred small operations; from Python each costs a dispatch (about 10 us), which at
// gpt2 size adds a third to the time the weights take to stream (docs/performance.md, "Against the CPU engines").
// Here the whole stack of blocks runs in one call for every row of the batch: LayerNorm, the q/k/v products, the new
// keys and values written into the model's cache, attention over the cache (under the padding mask, where rows were
// left-padded), the output projection, LayerNorm, the MLP with GELU (tanh), the residual adds, and the final
// LayerNorm; every product through `product` above, in the weight's own kind, all rows in one pass over the weight.
// Python keeps the embedding lookup (token + position, into x), the LM head and the logits processing.

struct StepLinear {  // one Linear: kind as rows_product's or 6 (linear), its weight, scale (int8/int4), bias, group
  int kind;
  const void* w;
  const float* scale;
  const float* bias;
  int64_t group, in, out;
};

struct StepLayer {
  const float* ln1_w;
  const float* ln1_b;
  StepLinear q, k, v, proj;
  const float* ln2_w;
  const float* ln2_b;
  StepLinear fc, out;
  float attn_scale;
};

// 1-8 rows: rows_product, in the weight's kind; more (fp32 weights only): product_many. Kind 6 (any rows): an int8
// weight packed for the prompt (rows_qgemm_pack) times the rows quantized per tensor (prompt_qproduct; -4 where they
// cannot be).
static int linear(const StepLinear& l, int64_t rows, const float* x, float* y, int threads) {
  if (l.kind == 6)
    return prompt_qproduct(rows, x, l.in, static_cast<const int8_t*>(l.w), l.scale, l.bias, y, l.out, threads);
  if (rows <= kMaxRows) return rows_product(l.kind, rows, x, l.in, l.w, l.scale, l.bias, y, l.out, threads, l.group);
  if (l.kind != 0) return -1;
  return rows_product_many(rows, x, l.in, static_cast<const float*>(l.w), l.bias, y, l.out, threads);
}

static void layer_norm(const float* x, const float* w, const float* b, float eps, int64_t n, float* y) {
  double sum = 0, sq = 0;
  for (int64_t i = 0; i < n; ++i) sum += x[i];
  const double mean = sum / n;
  for (int64_t i = 0; i < n; ++i) sq += (x[i] - mean) * (x[i] - mean);
  const float inv = static_cast<float>(1.0 / std::sqrt(sq / n + eps)), m = static_cast<float>(mean);
  for (int64_t i = 0; i < n; ++i) y[i] = (x[i] - m) * inv * (w ? w[i] : 1.0f) + (b ? b[i] : 0.0f);
}

// exp of a vector of floats: x = n ln2 + r (|r| <= ln2 / 2; ln2 in two parts, so r is exact to float rounding), e^r
// by a degree-7 polynomial (Cephes' expf coefficients: within 2 ulp of the true value), times 2^n built in the
// exponent bits. x is clamped to [-87.3, 88.3], where 2^n and the result stay normal floats. The AVX512 form does
// the AVX2 form's operations lane by lane, so a value's exp is the same in either build.
#if defined(__AVX512F__)
static inline vf vexp(vf x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}
static inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vmaxf(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vsubf(vf a, vf b) { return _mm512_sub_ps(a, b); }
#else
static inline vf vexp(vf x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
static inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf vmaxf(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vsubf(vf a, vf b) { return _mm256_sub_ps(a, b); }
#endif

// GELU, tanh form: 0.5 v (1 + tanh(u)), u = sqrt(2 / pi) (v + 0.044715 v^3), which is v / (1 + e^(-2u)) (1 + tanh u
// = 2 / (1 + e^(-2u))): one exp and one division a value (the scalar std::tanh loop took about 1 ms a gpt2 token on
// one core). Agrees with torch's gelu(approximate="tanh") to a few float roundings (tests). Its derivative from the
// same exp: with e = e^(-2u) and s = 1 / (1 + e), GELU(v) = v s and 1 - s = e s, so GELU'(v) = s + 2 v s (e s) u',
// u' = sqrt(2 / pi) (1 + 3 0.044715 v^2). e is clamped (vexp), so e s stays finite where s underflows.
//
// Values go a vector at a time (16 in the native build of an AVX512 CPU, else 8); there, 8 more under a mask where
// 8 to 15 are left; the last n % 8 by the scalar formulas. Each vector value takes the same operations in either
// build, so its result is the same in the native and the AVX2 build.
constexpr float kGeluC = 0.7978845608028654f, kGeluA = 0.044715f;

// GELU(v), or (grad) dy GELU'(v).
static inline vf gelu_vf(vf v, vf dy, bool grad) {
  const vf v2 = vmul(v, v);
  const vf u = vmul(vset1(kGeluC), vfma(vmul(vset1(kGeluA), v), v2, v));
  const vf e = vexp(vmul(vset1(-2.0f), u));
  if (!grad) return vdiv(v, vadd(vset1(1.0f), e));
  const vf s = vdiv(vset1(1.0f), vadd(vset1(1.0f), e));
  const vf du = vmul(vset1(2.0f * kGeluC), vfma(vset1(3.0f * kGeluA), v2, vset1(1.0f)));
  return vmul(dy, vfma(vmul(vmul(v, s), vmul(e, s)), du, s));
}

// y = GELU(x) (dy null), or dx = dy GELU'(x) (dx may be dy); n values on `threads`.
static void gelu_tanh_pass(const float* x, const float* dy, float* out, int64_t n, int threads) {
  const int64_t wide = n / kWidth;
#pragma omp parallel for num_threads(threads) schedule(static) if (n >= 4096)
  for (int64_t j = 0; j < wide; ++j) {
    const vf d = dy ? xload(dy + kWidth * j) : vzero();
    vstore(out + kWidth * j, gelu_vf(xload(x + kWidth * j), d, dy != nullptr));
  }
  int64_t i = kWidth * wide;
#if defined(__AVX512F__)
  if (n - i >= 8) {  // the AVX2 build's last whole vector: half a vector here
    const __mmask16 half = 0xFF;
    const vf d = dy ? _mm512_maskz_loadu_ps(half, dy + i) : vzero();
    _mm512_mask_storeu_ps(out + i, half, gelu_vf(_mm512_maskz_loadu_ps(half, x + i), d, dy != nullptr));
    i += 8;
  }
#endif
  for (; i < n; ++i) {
    const float v = x[i];
    if (dy) {
      const float e = std::exp(std::min(-2.0f * kGeluC * (v + kGeluA * v * v * v), 88.3f));
      const float s = 1.0f / (1.0f + e);
      out[i] = dy[i] * (s + v * s * (e * s) * 2.0f * kGeluC * (1.0f + 3.0f * kGeluA * v * v));
    } else {
      out[i] = 0.5f * v * (1.0f + std::tanh(kGeluC * (v + kGeluA * v * v * v)));
    }
  }
}

static void gelu_tanh(const float* x, float* y, int64_t n, int threads) { gelu_tanh_pass(x, nullptr, y, n, threads); }

// y = GELU(x) on n values (y may be x) on `threads`: the step's GELU (tests), the quantized prompt's
// (modules/gpt2_layer.py) and training's forward (modules/gelu.py).
extern "C" void rows_gelu_tanh(const float* x, float* y, int64_t n, int threads) {
  gelu_tanh(x, y, n, threads < 1 ? 1 : threads);
}

// GELU's backward (modules/gelu.py): dx = dy GELU'(x) on n values (dx may be dy).
extern "C" void rows_gelu_tanh_backward(const float* x, const float* dy, float* dx, int64_t n, int threads) {
  gelu_tanh_pass(x, dy, dx, n, threads < 1 ? 1 : threads);
}

// The same on bf16 tensors (a `--dtype bf16-weights` training step, modules/gelu.py): a vector of values at a time
// widened to fp32 in register (wload), GELU or its derivative as above, rounded back to bf16 (store_bf16: to nearest
// even), as torch's bf16 gelu computes in fp32 and rounds once; the last n % kWidth values through gelu_tanh_pass on
// a widened copy. dy null: y = GELU(x); else out = dy GELU'(x) (out may be dy). gpt2's 512 x 3072 values a layer, 2
// threads of an AMX Xeon: 0.62 -> 0.43 ms forward, 0.78 -> 0.55 backward against widening and rounding in loops of
// their own over blocks of 2048.
extern "C" void rows_gelu_tanh_bf16(const uint16_t* x, const uint16_t* dy, uint16_t* out, int64_t n, int threads) {
  const int64_t wide = n / kWidth;
#pragma omp parallel for num_threads(threads < 1 ? 1 : threads) schedule(static) if (n >= 4096)
  for (int64_t j = 0; j < wide; ++j) {
    const int64_t i = kWidth * j;
    const vf d = dy ? wload(dy + i) : vzero();
    store_bf16(out + i, gelu_vf(wload(x + i), d, dy != nullptr));
  }
  const int64_t i0 = kWidth * wide, m = n - i0;  // the last n % kWidth values: gelu_tanh_pass's rest and tail
  alignas(64) float xf[kWidth], df[kWidth];
  for (int64_t j = 0; j < m; ++j) {
    xf[j] = to_float(x[i0 + j]);
    df[j] = dy ? to_float(dy[i0 + j]) : 0.0f;
  }
  gelu_tanh_pass(xf, dy ? df : nullptr, xf, m, 1);
  for (int64_t j = 0; j < m; ++j) out[i0 + j] = bf16_bits(xf[j]);
}

// ---- causal attention of a prompt (fp32 or bf16, no cached tokens before it: modules/prompt_attention.py) --------
// out[b, t, h * hs + d] = sum_{j <= t} softmax_j(scale q[b, h, t] . k[b, h, j]) v[b, h, j, d]. A task is one head's
// block of kWidth queries (16 in the native build of an AVX512 CPU, else 8), one query a vector lane: the block's
// queries are packed transposed (qt[d][lane], times scale), then each key's scores for all the block's queries are
// one vector, 12 keys at a time (each qt vector loaded once for 12 broadcast key values, as product_many's weights);
// only the keys up to the block's last query are read (the causal half of the work; torch's SDPA for the CPU timed
// 70-80 ms for gpt2's 12 layers at 512 tokens, this 34, Zen 4, 2 threads, 2026-12-01). The softmax runs down the
// keys a lane per query (max, exp by vexp, sum), and the weighted sum of values puts kCols value columns' sums of
// all the block's queries in kCols vectors, each score vector loaded once for kCols broadcast value elements. Rows
// of the inputs are (b, h, t) strided with d contiguous (torch's views of the fused q/k/v output or of the KV
// cache).
// bf16 (rows_attend_prompt_bf16: q, k, v and out as uint16 bits): each value read widened to fp32 exactly, every sum,
// the softmax and the weighted sum in fp32 as above, the output rounded to bf16 once (to nearest even), as torch's
// CPU SDPA computes bf16 in fp32 and rounds its output.
// Returns 0; -1 where hs is not a multiple of kWidth or over kMaxHead (nothing written).
constexpr int64_t kMaxHead = 256;
constexpr int kKeysAtOnce = 12;
constexpr int kCols = kWidth == 16 ? 16 : 8;  // value columns a pass: their sums' vectors within the registers

// a value written in the output's type: fp32 as it is, bf16 rounded (bf16_bits); the decode step's writes too
static inline void store(float* p, float v) { *p = v; }
static inline void store(uint16_t* p, float v) { *p = bf16_bits(v); }

template <typename E>
static void attend_block(const E* q, const E* k, const E* v, const int64_t* qs, const int64_t* ks,
                         const int64_t* vs, int64_t b, int64_t h, int64_t T, int64_t hs, float scale, int64_t i0,
                         float* qt, float* st, float* ot, E* out, int64_t C) {
  const int64_t i1 = std::min(T, i0 + kWidth), n = i1;  // the block's queries; keys 0 .. i1 - 1
  const E* qh = q + b * qs[0] + h * qs[1];
  const E* kh = k + b * ks[0] + h * ks[1];
  const E* vh = v + b * vs[0] + h * vs[1];
  for (int64_t d = 0; d < hs; ++d)
    for (int64_t i = 0; i < kWidth; ++i)
      qt[d * kWidth + i] = i0 + i < T ? to_float(qh[(i0 + i) * qs[2] + d]) * scale : 0.0f;
  int64_t j = 0;
  for (; j + kKeysAtOnce <= n; j += kKeysAtOnce) {
    vf acc[kKeysAtOnce];
    for (int r = 0; r < kKeysAtOnce; ++r) acc[r] = vzero();
    for (int64_t d = 0; d < hs; ++d) {
      const vf qv = xload(qt + d * kWidth);
      for (int r = 0; r < kKeysAtOnce; ++r) acc[r] = vfma(vset1(to_float(kh[(j + r) * ks[2] + d])), qv, acc[r]);
    }
    for (int r = 0; r < kKeysAtOnce; ++r) vstore(st + (j + r) * kWidth, acc[r]);
  }
  for (; j < n; ++j) {
    vf acc = vzero();
    for (int64_t d = 0; d < hs; ++d) acc = vfma(vset1(to_float(kh[j * ks[2] + d])), xload(qt + d * kWidth), acc);
    vstore(st + j * kWidth, acc);
  }
  for (int64_t key = i0 + 1; key < n; ++key)  // causal: query i0 + lane sees keys up to itself
    for (int64_t lane = 0; lane < key - i0; ++lane) st[key * kWidth + lane] = -INFINITY;
  vf top = vset1(-INFINITY);
  for (int64_t key = 0; key < n; ++key) top = vmaxf(top, xload(st + key * kWidth));
  vf sum = vzero();
  for (int64_t key = 0; key < n; ++key) {
    const vf e = vexp(vsubf(xload(st + key * kWidth), top));
    vstore(st + key * kWidth, e);
    sum = vadd(sum, e);
  }
  const vf inv = vdiv(vset1(1.0f), sum);
  for (int64_t d0 = 0; d0 < hs; d0 += kCols) {  // hs is a multiple of kWidth, so of kCols: whole passes
    vf acc[kCols];
    for (int c = 0; c < kCols; ++c) acc[c] = vzero();
    for (int64_t key = 0; key < n; ++key) {
      const vf p = xload(st + key * kWidth);
      const E* row = vh + key * vs[2] + d0;
      for (int c = 0; c < kCols; ++c) acc[c] = vfma(vset1(to_float(row[c])), p, acc[c]);
    }
    for (int c = 0; c < kCols; ++c) vstore(ot + (d0 + c) * kWidth, vmul(acc[c], inv));
  }
  for (int64_t i = i0; i < i1; ++i)
    for (int64_t d = 0; d < hs; ++d) store(out + (b * T + i) * C + h * hs + d, ot[d * kWidth + (i - i0)]);
}

template <typename E>
static int attend_prompt(const E* q, const E* k, const E* v, const int64_t* q_strides, const int64_t* k_strides,
                         const int64_t* v_strides, int64_t B, int64_t H, int64_t T, int64_t hs, float scale, E* out,
                         int threads) {
  if (hs % kWidth != 0 || hs > kMaxHead || T < 1) return -1;
  const int64_t blocks = (T + kWidth - 1) / kWidth, tasks = B * H * blocks, C = H * hs;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> st(blocks * kWidth * kWidth), qt(hs * kWidth), ot(hs * kWidth);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {  // the longest blocks (the last queries) first
      const int64_t block = blocks - 1 - task / (B * H), bh = task % (B * H);
      attend_block(q, k, v, q_strides, k_strides, v_strides, bh / H, bh % H, T, hs, scale, block * kWidth,
                   qt.data(), st.data(), ot.data(), out, C);
    }
  }
  return 0;
}

extern "C" int rows_attend_prompt(const float* q, const float* k, const float* v, const int64_t* q_strides,
                                  const int64_t* k_strides, const int64_t* v_strides, int64_t B, int64_t H,
                                  int64_t T, int64_t hs, float scale, float* out, int threads) {
  return attend_prompt(q, k, v, q_strides, k_strides, v_strides, B, H, T, hs, scale, out, threads);
}

extern "C" int rows_attend_prompt_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                       const int64_t* q_strides, const int64_t* k_strides, const int64_t* v_strides,
                                       int64_t B, int64_t H, int64_t T, int64_t hs, float scale, uint16_t* out,
                                       int threads) {
  return attend_prompt(q, k, v, q_strides, k_strides, v_strides, B, H, T, hs, scale, out, threads);
}

// bf16 rounding of fp32 values, `bf16_rounded` and `bf16_bits` above: `round_bf16` the values left in fp32 storage
// holding bf16 numbers. A bf16 model's step rounds at each point where torch's bf16 operations hand a bf16 tensor
// on, so its numbers are those of decode_step in bf16.
static inline void round_bf16(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t b;
    std::memcpy(&b, x + i, sizeof b);
    b = bf16_rounded(b);
    std::memcpy(x + i, &b, sizeof b);
  }
}
template <typename K>
static inline void round_as(float* a, int64_t n) {  // rounded to bf16 where K is a bf16 cache's type
  if constexpr (std::is_same_v<K, uint16_t>) round_bf16(a, n);
}

// One head's attention of one query over `length` cached keys and values (rows of `dim`, `cap` rows a head; K: the
// cache's type), the keys where `mask` (null: none) holds 0 left out (a left-padded row's padding): each score a
// dot product 8 columns at a time in two accumulators (a scalar sum is one dependent chain of adds, about a
// millisecond a gpt2 token at 80 tokens of context), the weighted sum of values 8 columns at a time, all in fp32.
// A bf16 cache's form weighs each value by its exp(score - max) rounded to bf16 and divides the sum by the exps'
// fp32 total at the end, as torch's bf16 SDPA on the CPU does (its exp is not ours: the two agree to a bf16 rounding
// of an exp, not bit for bit).
template <typename K>
static void attend(const float* q, const K* keys, const K* values, int64_t length, int64_t dim, float scale,
                   const uint8_t* mask, float* scores, float* y) {
  constexpr bool bf16 = std::is_same_v<K, uint16_t>;
  const int64_t wide = dim / 16 * 16;
  float top = -INFINITY;
  for (int64_t t = 0; t < length; ++t) {
    if (mask && !mask[t]) {
      scores[t] = -INFINITY;  // its exp, 0, weighs its value, as in SDPA
      continue;
    }
    const K* k = keys + t * dim;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (int64_t d = 0; d < wide; d += 16) {
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), load8(k + d + 8), a1);
    }
    float s = hsum256(_mm256_add_ps(a0, a1));
    for (int64_t d = wide; d < dim; ++d) s += q[d] * to_float(k[d]);
    scores[t] = s * scale;
    top = std::max(top, scores[t]);
  }
  float total = 0;
  for (int64_t t = 0; t < length; ++t) total += (scores[t] = std::exp(scores[t] - top));
  for (int64_t d = 0; d < dim; ++d) y[d] = 0;
  for (int64_t t = 0; t < length; ++t) {
    const float p = bf16 ? to_float(bf16_bits(scores[t])) : scores[t] / total;
    const K* v = values + t * dim;
    int64_t d = 0;
    for (; d + 8 <= dim; d += 8)
      _mm256_storeu_ps(y + d, _mm256_fmadd_ps(_mm256_set1_ps(p), load8(v + d), _mm256_loadu_ps(y + d)));
    for (; d < dim; ++d) y[d] += p * to_float(v[d]);
  }
  if constexpr (bf16)
    for (int64_t d = 0; d < dim; ++d) y[d] /= total;
}

// LayerNorm of each of R rows of x (R, C) into y.
static void norm_rows(const float* x, const float* w, const float* b, float eps, int64_t R, int64_t C, float* y) {
  for (int64_t r = 0; r < R; ++r) layer_norm(x + r * C, w, b, eps, C, y + r * C);
}

// A block's first half for R rows of x (R, C): h = LayerNorm(x), then q, k, v (R, C) = its products (rounded to
// bf16 where K is a bf16 cache's type, as decode_step's bf16 operations round them). Returns 0 or a product's error.
template <typename K>
static int block_qkv(const StepLayer& L, int64_t R, int64_t C, float eps, const float* x, float* h, float* q,
                     float* k, float* v, int threads) {
  norm_rows(x, L.ln1_w, L.ln1_b, eps, R, C, h);
  round_as<K>(h, R * C);
  int err = 0;
  if (L.q.kind == 6 && L.k.kind == 6 && L.v.kind == 6) {  // the prompt's int8 products: h quantized once for the
    PromptRows p;                                          // three (as the layers' stacked q / k / v GEMM does)
    if (!quantize_prompt(R, h, C, threads, p)) return -4;
    for (const auto& [l, y] : {std::pair{&L.q, q}, std::pair{&L.k, k}, std::pair{&L.v, v}})
      qgemm(R, p.q.data(), C, static_cast<const int8_t*>(l->w), l->scale, p.scale, p.zp, l->bias, y, l->out, threads);
  } else {
    err = linear(L.q, R, h, q, threads);
    if (!err) err = linear(L.k, R, h, k, threads);
    if (!err) err = linear(L.v, R, h, v, threads);
  }
  round_as<K>(q, R * C);
  round_as<K>(k, R * C);
  round_as<K>(v, R * C);
  return err;
}

// The rest of a block, after attention's output y (R, C): x += proj(y); x += out(GELU(fc(LayerNorm(x)))); h (R, C)
// and f (R, inner) are scratch (y is overwritten). Returns 0 or a product's error.
template <typename K>
static int block_rest(const StepLayer& L, int64_t R, int64_t C, float eps, float* x, float* y, float* h, float* f,
                      int threads) {
  const int64_t inner = L.fc.out;
  round_as<K>(y, R * C);
  int err = linear(L.proj, R, y, h, threads);
  if (err) return err;
  round_as<K>(h, R * C);
  for (int64_t i = 0; i < R * C; ++i) x[i] += h[i];
  round_as<K>(x, R * C);
  norm_rows(x, L.ln2_w, L.ln2_b, eps, R, C, h);
  round_as<K>(h, R * C);
  if ((err = linear(L.fc, R, h, f, threads))) return err;
  round_as<K>(f, R * inner);
  gelu_tanh(f, f, R * inner, threads);
  round_as<K>(f, R * inner);
  if ((err = linear(L.out, R, f, y, threads))) return err;
  round_as<K>(y, R * C);
  for (int64_t i = 0; i < R * C; ++i) x[i] += y[i];
  round_as<K>(x, R * C);
  return 0;
}

// x (rows, C): each row's token embedding (token + position), replaced by the last block's output; out (rows, C):
// the final LayerNorm of it. keys, values: the model's cache (n_layer, rows, n_head, cap, C / n_head) of K (float, or
// uint16_t for bf16), `length` tokens filled; each row's new key and value go to position `length` of each layer.
// mask: null (every cached key seen), or (rows, mask_stride) bytes, row b's key t attended where mask[b, t] is
// nonzero (generate's left padding; the new token's, at `length`, must be). scratch: gpt2_step_scratch floats. Bf16
// (a bf16 model: bf16 weights, fp32 copies of its norms and biases): every value torch would hand on in bf16 is
// rounded to bf16 there (a norm's, a product's, attention's and GELU's output, the residual sums; the final norm's
// `out` as the caller converts it). Returns 0, or the first product's error (-1: more than 8 rows of weights that
// are not fp32).
template <typename K>
static int step(const StepLayer* layers, int n_layer, int n_head, int64_t C, float eps, int64_t rows, float* x,
                const float* lnf_w, const float* lnf_b, K* keys, K* values, int64_t cap, int64_t length,
                const uint8_t* mask, int64_t mask_stride, float* scratch, float* out, int threads) {
  if (threads < 1) threads = 1;
  const int64_t dim = C / n_head, inner = layers[0].fc.out, R = rows;
  float* h = scratch;          // R x C: a LayerNorm's output
  float* q = h + R * C;        // R x C
  float* k = q + R * C;        // R x C: the new keys, then values, before they go to the cache
  float* v = k + R * C;        // R x C
  float* y = v + R * C;        // R x C: attention's output, then a projection's
  float* f = y + R * C;        // R x inner: the MLP's hidden
  float* scores = f + R * inner;  // R x n_head x (length + 1)
  const int64_t seen = length + 1, heads = R * n_head;
  for (int l = 0; l < n_layer; ++l) {
    const StepLayer& L = layers[l];
    int err = block_qkv<K>(L, R, C, eps, x, h, q, k, v, threads);
    if (err) return err;
    K* lk = keys + static_cast<int64_t>(l) * R * n_head * cap * dim;  // row r's head hd: (r n_head + hd) cap dim on
    K* lv = values + static_cast<int64_t>(l) * R * n_head * cap * dim;
    for (int64_t rh = 0; rh < heads; ++rh)  // the new key and value of row rh / n_head, head rh % n_head
      for (int64_t d = 0; d < dim; ++d) {
        store(lk + (rh * cap + length) * dim + d, k[rh * dim + d]);
        store(lv + (rh * cap + length) * dim + d, v[rh * dim + d]);
      }
#pragma omp parallel for num_threads(threads) schedule(static) if (seen * dim * heads > (1 << 16))
    for (int64_t rh = 0; rh < heads; ++rh)
      attend(q + rh * dim, lk + rh * cap * dim, lv + rh * cap * dim, seen, dim, L.attn_scale,
             mask ? mask + rh / n_head * mask_stride : nullptr, scores + rh * seen, y + rh * dim);
    if ((err = block_rest<K>(L, R, C, eps, x, y, h, f, threads))) return err;
  }
  norm_rows(x, lnf_w, lnf_b, eps, R, C, out);  // bf16: rounded by the caller, converting `out` to its dtype
  return 0;
}

// A prompt's pass of an fp32 model in one call: one sequence of T tokens (no padding) into an empty cache. x (T, C):
// the tokens' embeddings (token + position), replaced by the last block's output; keys, values: the cache (n_layer,
// 1, n_head, cap, C / n_head), positions 0 .. T - 1 of each layer written; out (C): the final LayerNorm of the last
// token's row (all a decoder reads). Each block as a step's (block_qkv, block_rest: T rows through `linear`, so 1-8
// rows in rows_product, more in product_many), with causal attention over the prompt by rows_attend_prompt. scratch:
// the step's for T rows and no cached keys (gpt2_step_scratch(n_head, C, inner, 0, T) floats: no scores). Weights:
// fp32, or (w8a8 / w4a8 prompts of 2+ tokens) kind 6's packed int8. Returns 0, the first product's error (-4:
// activations kind 6 cannot quantize; the caller runs the layers instead), or -3 for a head size attention does not
// take.
extern "C" int gpt2_prompt_pass(const StepLayer* layers, int n_layer, int n_head, int64_t C, float eps, int64_t T,
                                float* x, const float* lnf_w, const float* lnf_b, float* keys, float* values,
                                int64_t cap, float* scratch, float* out, int threads) {
  if (threads < 1) threads = 1;
  const int64_t dim = C / n_head;
  if (dim % kWidth != 0 || dim > kMaxHead || T < 1 || T > cap) return -3;
  float* h = scratch;    // T x C
  float* q = h + T * C;  // T x C
  float* k = q + T * C;  // T x C
  float* v = k + T * C;  // T x C
  float* y = v + T * C;  // T x C
  float* f = y + T * C;  // T x inner
  const int64_t strides[3] = {T * C, dim, C};  // q, k, v (T, C) read as (1, n_head, T, dim)
  for (int l = 0; l < n_layer; ++l) {
    const StepLayer& L = layers[l];
    int err = block_qkv<float>(L, T, C, eps, x, h, q, k, v, threads);
    if (err) return err;
    float* lk = keys + static_cast<int64_t>(l) * n_head * cap * dim;
    float* lv = values + static_cast<int64_t>(l) * n_head * cap * dim;
    for (int64_t hd = 0; hd < n_head; ++hd)
      for (int64_t t = 0; t < T; ++t) {
        std::memcpy(lk + (hd * cap + t) * dim, k + t * C + hd * dim, dim * sizeof(float));
        std::memcpy(lv + (hd * cap + t) * dim, v + t * C + hd * dim, dim * sizeof(float));
      }
    rows_attend_prompt(q, k, v, strides, strides, strides, 1, n_head, T, dim, L.attn_scale, y, threads);
    if ((err = block_rest<float>(L, T, C, eps, x, y, h, f, threads))) return err;
  }
  layer_norm(x + (T - 1) * C, lnf_w, lnf_b, eps, C, out);
  return 0;
}

extern "C" {

// The step of an fp32 model (fp32 cache; weights fp32 or int8 / int4 copies) and of a bf16 one (bf16 weights and
// cache); arguments as `step`'s.
int gpt2_step(const StepLayer* layers, int n_layer, int n_head, int64_t C, float eps, int64_t rows, float* x,
              const float* lnf_w, const float* lnf_b, float* keys, float* values, int64_t cap, int64_t length,
              const uint8_t* mask, int64_t mask_stride, float* scratch, float* out, int threads) {
  return step<float>(layers, n_layer, n_head, C, eps, rows, x, lnf_w, lnf_b, keys, values, cap, length, mask,
                     mask_stride, scratch, out, threads);
}

int gpt2_step_bf16(const StepLayer* layers, int n_layer, int n_head, int64_t C, float eps, int64_t rows, float* x,
                   const float* lnf_w, const float* lnf_b, uint16_t* keys, uint16_t* values, int64_t cap,
                   int64_t length, const uint8_t* mask, int64_t mask_stride, float* scratch, float* out,
                   int threads) {
  return step<uint16_t>(layers, n_layer, n_head, C, eps, rows, x, lnf_w, lnf_b, keys, values, cap, length, mask,
                        mask_stride, scratch, out, threads);
}

// The floats of scratch gpt2_step needs for `rows` rows.
int64_t gpt2_step_scratch(int n_head, int64_t C, int64_t inner, int64_t cap, int64_t rows) {
  return rows * (5 * C + inner + n_head * cap);
}

}  // extern "C"


// ---- the LM loss's rows (modules/cross_entropy.py) ----------------------------------------------------------------
// Cross-entropy over a large vocabulary needs, for each row z of V logits, its log-sum-exp lse = m + log sum_j
// e^(z_j - m) (m: the row's largest value), and in backward the gradient g_j = (e^(z_j - lse) - [j = y]) w, y the
// row's target and w its weight (the loss's gradient over the counted rows; 0 for an ignored row). torch's ops take
// several passes over a row and an fp32 copy of bf16 logits; here the forward reads a row twice (its maximum, then
// the sum of exps, while the row is in cache) and the backward once, each value widened to fp32 in register and the
// gradient rounded once to the logits' dtype. exp is vexp's (within 2 ulp; values more than 87.3 under the maximum
// count as e^-87.3, about 1e-38, where the true value is smaller still); the sums of a row go in one order whatever
// the thread count. A row holding a NaN or an infinity goes through the scalar formulas in double, so NaN and
// infinities come out as torch's logsumexp and softmax give them.

static inline float vmax_all(vf a) {
  alignas(64) float lanes[kWidth];
  vstore(lanes, a);
  float m = lanes[0];
  for (int64_t k = 1; k < kWidth; ++k) m = std::max(m, lanes[k]);
  return m;
}

static inline float lane0(vf a) {
  alignas(64) float lanes[kWidth];
  vstore(lanes, a);
  return lanes[0];
}

template <typename T>
static float row_lse_scalar(const T* z, int64_t V) {
  double m = -INFINITY;
  for (int64_t j = 0; j < V; ++j) {
    const double v = to_float(z[j]);
    if (std::isnan(v)) return NAN;
    m = std::max(m, v);
  }
  if (std::isinf(m)) return static_cast<float>(m);  // +inf: inf; every value -inf: -inf (torch's logsumexp)
  double s = 0;
  for (int64_t j = 0; j < V; ++j) s += std::exp(to_float(z[j]) - m);
  return static_cast<float>(m + std::log(s));
}

template <typename T>
static float row_lse(const T* z, int64_t V) {
  const int64_t wide = V / kWidth * kWidth;
  vf top = vset1(-INFINITY), bad = vzero();
  for (int64_t j = 0; j < wide; j += kWidth) {
    const vf v = wload(z + j);
    top = vmaxf(top, v);
    bad = vfma(v, vzero(), bad);  // 0 while every value is finite; NaN from a NaN or an infinity
  }
  float m = vmax_all(top), nonfinite = vsum(bad);
  for (int64_t j = wide; j < V; ++j) {
    m = std::max(m, to_float(z[j]));
    nonfinite += to_float(z[j]) * 0.0f;
  }
  if (nonfinite != 0.0f || V == 0) return row_lse_scalar(z, V);  // NaN != 0: a NaN or an infinity in the row
  const vf mv = vset1(m);
  vf s0 = vzero(), s1 = vzero();
  int64_t j = 0;
  for (; j + 2 * kWidth <= wide; j += 2 * kWidth) {
    s0 = vadd(s0, vexp(vsubf(wload(z + j), mv)));
    s1 = vadd(s1, vexp(vsubf(wload(z + j + kWidth), mv)));
  }
  for (; j < wide; j += kWidth) s0 = vadd(s0, vexp(vsubf(wload(z + j), mv)));
  float s = vsum(vadd(s0, s1));
  for (j = wide; j < V; ++j) s += lane0(vexp(vset1(to_float(z[j]) - m)));
  return m + std::log(s);
}

// e^x for x = z - lse <= 0, and exactly 0 under vexp's clamp (a logit of -inf, a masked vocabulary entry, gets a zero
// gradient, as torch's softmax gives it, not e^-87.3).
static inline vf softmax_term(vf x) {
#if defined(__AVX512F__)
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_GE_OQ), vexp(x));
#else
  return _mm256_and_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_GE_OQ), vexp(x));
#endif
}

// Whether a lane of v is NaN or +inf.
static inline bool unbounded(vf v) {
#if defined(__AVX512F__)
  return _mm512_cmp_ps_mask(v, _mm512_set1_ps(INFINITY), _CMP_NLT_UQ) != 0;
#else
  return _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(INFINITY), _CMP_NLT_UQ)) != 0;
#endif
}

// A vector, or one value, of fp32 results stored in the tensor's dtype (bf16: rounded to nearest even).
static inline void store_vec(float* g, vf v) { vstore(g, v); }
static inline void store_vec(uint16_t* g, vf v) { store_bf16(g, v); }
static inline void store_one(float* g, float v) { *g = v; }
static inline void store_one(uint16_t* g, float v) { *g = bf16_bits(v); }

template <typename T>
static void row_grad(const T* z, float lse, int64_t y, float w, T* g, int64_t V) {
  if (!std::isfinite(lse)) {  // a NaN or an infinity in the row: torch's softmax formulas, in double
    for (int64_t j = 0; j < V; ++j)
      store_one(g + j, static_cast<float>((std::exp(double(to_float(z[j])) - lse) - (j == y ? 1.0 : 0.0)) * w));
    return;
  }
  const int64_t wide = V / kWidth * kWidth;
  const vf l = vset1(lse), wv = vset1(w);
  for (int64_t j = 0; j < wide; j += kWidth) store_vec(g + j, vmul(softmax_term(vsubf(wload(z + j), l)), wv));
  for (int64_t j = wide; j < V; ++j) store_one(g + j, lane0(softmax_term(vset1(to_float(z[j]) - lse))) * w);
  if (y >= 0 && y < V) store_one(g + y, (lane0(softmax_term(vset1(to_float(z[y]) - lse))) - 1.0f) * w);
}

extern "C" {

// lse[i] for `rows` rows of V logits (bf16 != 0: bf16 bits, else fp32), rows split over `threads`.
void rows_ce_lse(int bf16, const void* z, int64_t rows, int64_t V, float* lse, int threads) {
#pragma omp parallel for num_threads(threads < 1 ? 1 : threads) schedule(static) if (rows > 1)
  for (int64_t i = 0; i < rows; ++i)
    lse[i] = bf16 ? row_lse(static_cast<const uint16_t*>(z) + i * V, V)
                  : row_lse(static_cast<const float*>(z) + i * V, V);
}

// g[i, j] = (e^(z[i, j] - lse[i]) - [j = y[i]]) w[i], in the logits' dtype (bf16 rounded to nearest even).
void rows_ce_grad(int bf16, const void* z, const float* lse, const int64_t* y, const float* w, void* g, int64_t rows,
                  int64_t V, int threads) {
#pragma omp parallel for num_threads(threads < 1 ? 1 : threads) schedule(static) if (rows > 1)
  for (int64_t i = 0; i < rows; ++i) {
    if (bf16)
      row_grad(static_cast<const uint16_t*>(z) + i * V, lse[i], y[i], w[i], static_cast<uint16_t*>(g) + i * V, V);
    else
      row_grad(static_cast<const float*>(z) + i * V, lse[i], y[i], w[i], static_cast<float*>(g) + i * V, V);
  }
}

// y = x rounded to bf16 by store_bf16 (whole vectors) and bf16_bits (the rest): the rounding the bf16 kernels share
// (GELU, the loss's gradient), exported so that tests/test_gelu.py holds it to torch's conversion bit for bit.
void rows_round_bf16(const float* x, uint16_t* y, int64_t n) {
  const int64_t wide = n / kWidth * kWidth;
  for (int64_t i = 0; i < wide; i += kWidth) store_bf16(y + i, xload(x + i));
  for (int64_t i = wide; i < n; ++i) y[i] = bf16_bits(x[i]);
}

}  // extern "C"

// ---- the attention's softmax in a training step (modules/attention.py's explicit path) ---------------------------
// P = softmax(scale S) over each row of raw scores S (B, H, T, K: query t's products with every key), the keys a
// query may not see left out (P = 0 there): causal (key k visible from query t when k <= t + K - T), or a bool mask
// (B or 1, T, K) shared by the heads. A row that sees no key gives 1/K everywhere, as the course's masked_fill with
// the dtype's lowest value, then softmax, gives it. Backward: dS = scale P (dP - sum_k P dP), 0 where a key is hidden
// (all of a row that sees none: masked_fill's backward); a NaN or +inf a query sees makes its row NaN, as torch's
// softmax does, so a diverging step still shows as a non-finite loss. One pass forward (the row widened to fp32 once,
// its maximum, its exps, divided by their sum, rounded once to the scores' dtype; a causal row's hidden keys neither
// read nor exponentiated, their zeros stored) and one backward, for torch's scale, masked_fill, softmax and their
// backward passes. exp is vexp's (within 2 ulp).

template <typename E>
static void softmax_rows(const E* s, E* p, const uint8_t* mask, int64_t mask_stride, int64_t B, int64_t H, int64_t T,
                         int64_t K, float scale, int threads) {
#pragma omp parallel num_threads(threads < 1 ? 1 : threads)
  {
    std::vector<float> row(static_cast<size_t>((K + kWidth - 1) / kWidth * kWidth));
    const vf sv = vset1(scale);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < B * H * T; ++r) {
      const int64_t b = r / (H * T), t = r % T;
      const uint8_t* m = mask ? mask + b * mask_stride + t * K : nullptr;
      const E* sr = s + r * K;
      E* pr = p + r * K;
      // keys [0, n) may be visible (causal: the rest are hidden); the row's vectors run to n_up, padded with -inf
      const int64_t n = m ? K : std::min(K, t + K - T + 1), nw = n / kWidth * kWidth;
      const int64_t n_up = (n + kWidth - 1) / kWidth * kWidth;
      for (int64_t k = 0; k < nw; k += kWidth) vstore(row.data() + k, vmul(sv, wload(sr + k)));
      for (int64_t k = nw; k < n; ++k) row[k] = scale * to_float(sr[k]);
      for (int64_t k = n; k < n_up; ++k) row[k] = -INFINITY;
      for (int64_t k = 0; m && k < K; ++k) row[k] = m[k] ? row[k] : -INFINITY;
      vf top = vset1(-INFINITY);
      bool nonfinite = false;  // a NaN or +inf the query sees (hidden keys are -inf by now)
      for (int64_t k = 0; k < n_up; k += kWidth) {
        const vf v = xload(row.data() + k);
        top = vmaxf(top, v);
        nonfinite |= unbounded(v);
      }
      const float most = vmax_all(top);
      if (nonfinite || most == -INFINITY) {  // torch's softmax: a NaN row; no visible key: masked_fill's uniform row
        for (int64_t k = 0; k < K; ++k) store_one(pr + k, nonfinite ? NAN : 1.0f / static_cast<float>(K));
        continue;
      }
      const vf mv = vset1(most);
      vf sum = vzero();
      for (int64_t k = 0; k < n_up; k += kWidth) {
        const vf e = softmax_term(vsubf(xload(row.data() + k), mv));
        vstore(row.data() + k, e);
        sum = vadd(sum, e);
      }
      const float total = vsum(sum);
      const vf tv = vset1(total);
      int64_t k = 0;
      for (; k + kWidth <= K; k += kWidth) store_vec(pr + k, k < n_up ? vdiv(xload(row.data() + k), tv) : vzero());
      for (; k < K; ++k) store_one(pr + k, k < n_up ? row[k] / total : 0.0f);
    }
  }
}

template <typename E>
static void softmax_rows_backward(const E* p, const E* dp, E* ds, const uint8_t* mask, int64_t mask_stride, int64_t B,
                                  int64_t H, int64_t T, int64_t K, float scale, int threads) {
  const int64_t wide = K / kWidth * kWidth;
#pragma omp parallel for num_threads(threads < 1 ? 1 : threads) schedule(static)
  for (int64_t r = 0; r < B * H * T; ++r) {
    const int64_t b = r / (H * T), t = r % T;
    const uint8_t* m = mask ? mask + b * mask_stride : nullptr;
    const E *pr = p + r * K, *dpr = dp + r * K;
    E* dsr = ds + r * K;
    bool any = !m;  // a causal row always sees its own key
    for (int64_t k = 0; m && k < K && !any; ++k) any = m[t * K + k] != 0;
    if (!any) {  // every key hidden: masked_fill's backward zeroes the whole row
      for (int64_t k = 0; k < K; ++k) store_one(dsr + k, 0.0f);
      continue;
    }
    vf acc = vzero();
    for (int64_t k = 0; k < wide; k += kWidth) acc = vfma(wload(pr + k), wload(dpr + k), acc);
    float dot = vsum(acc);
    for (int64_t k = wide; k < K; ++k) dot += to_float(pr[k]) * to_float(dpr[k]);
    const vf dv = vset1(dot), sv = vset1(scale);
    for (int64_t k = 0; k < wide; k += kWidth)
      store_vec(dsr + k, vmul(sv, vmul(wload(pr + k), vsubf(wload(dpr + k), dv))));
    for (int64_t k = wide; k < K; ++k) store_one(dsr + k, scale * (to_float(pr[k]) * (to_float(dpr[k]) - dot)));
  }
}

extern "C" {

// P = the masked softmax of scale S (see above); mask: null (causal) or uint8 (B or 1, T, K), mask_stride its batch
// stride (0: shared by the batch). bf16 != 0: S and P bf16 bits, else fp32.
void rows_softmax(int bf16, const void* s, void* p, const uint8_t* mask, int64_t mask_stride, int64_t B, int64_t H,
                  int64_t T, int64_t K, float scale, int threads) {
  if (bf16)
    softmax_rows(static_cast<const uint16_t*>(s), static_cast<uint16_t*>(p), mask, mask_stride, B, H, T, K, scale,
                 threads);
  else
    softmax_rows(static_cast<const float*>(s), static_cast<float*>(p), mask, mask_stride, B, H, T, K, scale, threads);
}

// dS from P and dP (see above), the same mask and scale.
void rows_softmax_backward(int bf16, const void* p, const void* dp, void* ds, const uint8_t* mask, int64_t mask_stride,
                           int64_t B, int64_t H, int64_t T, int64_t K, float scale, int threads) {
  if (bf16)
    softmax_rows_backward(static_cast<const uint16_t*>(p), static_cast<const uint16_t*>(dp), static_cast<uint16_t*>(ds),
                          mask, mask_stride, B, H, T, K, scale, threads);
  else
    softmax_rows_backward(static_cast<const float*>(p), static_cast<const float*>(dp), static_cast<float*>(ds), mask,
                          mask_stride, B, H, T, K, scale, threads);
}

}  // extern "C"

// ---- LayerNorm in a training step (modules/layer_norm.py) ---------------------------------------------------------
// Over each row of C values: y = (x - mean) rstd w + b, rstd = 1 / sqrt(var + eps) with the biased variance, w and b
// optional (null: 1 and 0); mean and rstd kept in fp32 for backward. Backward, with xh = (x - mean) rstd and g = dy w:
// dx = rstd (g - mean(g) - xh mean(g xh)), dw = the sum over rows of dy xh, db = the sum of dy. Forward reads a row
// once into an fp32 copy (its mean, then its variance about the mean from the copy, as torch's two-pass form) and
// writes it once; backward reads dy and x once, keeping the row's g and xh in fp32 for dx. Results rounded once to
// the row's dtype (fp32 or bf16: as torch's bf16 LayerNorm, which computes in fp32). dw and db are summed in fp32 within chunks of kNormChunk rows and
// the chunks' sums added in order in double: the same sums whatever the thread count.

constexpr int64_t kNormChunk = 32;

// The weight or bias (C values, or null: empty) in fp32, widened once a call instead of once a row.
template <typename E>
static std::vector<float> widened(const E* p, int64_t C) {
  std::vector<float> out(p ? static_cast<size_t>(C) : 0);
  for (int64_t k = 0; p && k < C; ++k) out[k] = to_float(p[k]);
  return out;
}

template <typename E>
static void layernorm_rows(const E* x, const E* w, const E* b, E* y, float* mean, float* rstd, int64_t rows, int64_t C,
                           float eps, int threads) {
  const int64_t wide = C / kWidth * kWidth;
  const std::vector<float> wf = widened(w, C), bf = widened(b, C);
#pragma omp parallel num_threads(threads < 1 ? 1 : threads) if (rows > 1)
  {
    std::vector<float> row(static_cast<size_t>(C));  // the row in fp32
#pragma omp for schedule(static)
    for (int64_t i = 0; i < rows; ++i) {
      const E* xr = x + i * C;
      E* yr = y + i * C;
      vf acc = vzero();
      for (int64_t k = 0; k < wide; k += kWidth) {
        const vf v = wload(xr + k);
        vstore(row.data() + k, v);
        acc = vadd(acc, v);
      }
      float total = vsum(acc);
      for (int64_t k = wide; k < C; ++k) total += (row[k] = to_float(xr[k]));
      const float mu = total / static_cast<float>(C);
      const vf mv = vset1(mu);
      acc = vzero();
      for (int64_t k = 0; k < wide; k += kWidth) {
        const vf d = vsubf(xload(row.data() + k), mv);
        acc = vfma(d, d, acc);
      }
      float var = vsum(acc);
      for (int64_t k = wide; k < C; ++k) var += (row[k] - mu) * (row[k] - mu);
      const float r = 1.0f / std::sqrt(var / static_cast<float>(C) + eps);
      mean[i] = mu;
      rstd[i] = r;
      const vf rv = vset1(r);
      for (int64_t k = 0; k < wide; k += kWidth) {
        vf v = vmul(vsubf(xload(row.data() + k), mv), rv);
        if (w) v = vmul(v, xload(wf.data() + k));
        if (b) v = vadd(v, xload(bf.data() + k));
        store_vec(yr + k, v);
      }
      for (int64_t k = wide; k < C; ++k) {
        float v = (row[k] - mu) * r;
        if (w) v *= wf[k];
        if (b) v += bf[k];
        store_one(yr + k, v);
      }
    }
  }
}

template <typename E>
static void layernorm_rows_backward(const E* dy, const E* x, const E* w, const float* mean, const float* rstd, E* dx,
                                    E* dw, E* db, int64_t rows, int64_t C, int threads) {
  const int64_t wide = C / kWidth * kWidth, chunks = (rows + kNormChunk - 1) / kNormChunk;
  const std::vector<float> wf = widened(w, C);
  std::vector<float> part_w(dw ? static_cast<size_t>(chunks * C) : 0, 0.0f);  // each chunk's sums, C values
  std::vector<float> part_b(db ? static_cast<size_t>(chunks * C) : 0, 0.0f);
#pragma omp parallel num_threads(threads < 1 ? 1 : threads) if (chunks > 1)
  {
    std::vector<float> gs(static_cast<size_t>(C)), xhs(static_cast<size_t>(C));  // a row's g and xh in fp32
#pragma omp for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
      float* pw = dw ? part_w.data() + c * C : nullptr;
      float* pb = db ? part_b.data() + c * C : nullptr;
      for (int64_t i = c * kNormChunk; i < std::min(rows, (c + 1) * kNormChunk); ++i) {
        const E *dyr = dy + i * C, *xr = x + i * C;
        const float mu = mean[i], r = rstd[i];
        const vf mv = vset1(mu), rv = vset1(r);
        vf sg = vzero(), sgx = vzero();  // sums of g and of g xh
        for (int64_t k = 0; k < wide; k += kWidth) {
          const vf d = wload(dyr + k), xh = vmul(vsubf(wload(xr + k), mv), rv);
          const vf g = w ? vmul(d, xload(wf.data() + k)) : d;
          vstore(gs.data() + k, g);
          vstore(xhs.data() + k, xh);
          sg = vadd(sg, g);
          sgx = vfma(g, xh, sgx);
          if (pw) vstore(pw + k, vfma(d, xh, xload(pw + k)));
          if (pb) vstore(pb + k, vadd(d, xload(pb + k)));
        }
        float sum_g = vsum(sg), sum_gx = vsum(sgx);
        for (int64_t k = wide; k < C; ++k) {
          const float d = to_float(dyr[k]), xh = (to_float(xr[k]) - mu) * r, g = w ? d * wf[k] : d;
          gs[k] = g;
          xhs[k] = xh;
          sum_g += g;
          sum_gx += g * xh;
          if (pw) pw[k] += d * xh;
          if (pb) pb[k] += d;
        }
        if (!dx) continue;
        E* dxr = dx + i * C;
        const float inv = 1.0f / static_cast<float>(C), mg = sum_g * inv, mgx = sum_gx * inv;
        const vf mgv = vset1(mg), mgxv = vset1(mgx);
        for (int64_t k = 0; k < wide; k += kWidth)
          store_vec(dxr + k, vmul(rv, vsubf(vsubf(xload(gs.data() + k), mgv), vmul(xload(xhs.data() + k), mgxv))));
        for (int64_t k = wide; k < C; ++k) store_one(dxr + k, r * (gs[k] - mg - xhs[k] * mgx));
      }
    }
  }
  for (int64_t k = 0; k < C; ++k) {  // the chunks' sums, in order
    double sw = 0.0, sb = 0.0;
    for (int64_t c = 0; c < chunks; ++c) {
      if (dw) sw += part_w[c * C + k];
      if (db) sb += part_b[c * C + k];
    }
    if (dw) store_one(dw + k, static_cast<float>(sw));
    if (db) store_one(db + k, static_cast<float>(sb));
  }
}

extern "C" {

// y, mean, rstd from x (rows x C; see above); w, b: C values or null. bf16 != 0: x, w, b, y bf16 bits, else fp32.
void rows_layernorm(int bf16, const void* x, const void* w, const void* b, void* y, float* mean, float* rstd,
                    int64_t rows, int64_t C, float eps, int threads) {
  if (bf16)
    layernorm_rows(static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(w), static_cast<const uint16_t*>(b),
                   static_cast<uint16_t*>(y), mean, rstd, rows, C, eps, threads);
  else
    layernorm_rows(static_cast<const float*>(x), static_cast<const float*>(w), static_cast<const float*>(b),
                   static_cast<float*>(y), mean, rstd, rows, C, eps, threads);
}

// dx, dw, db (each null when not wanted; dw, db written, not accumulated: zeros for no rows) from dy and the forward's
// x, w, mean and rstd.
void rows_layernorm_backward(int bf16, const void* dy, const void* x, const void* w, const float* mean,
                             const float* rstd, void* dx, void* dw, void* db, int64_t rows, int64_t C, int threads) {
  if (bf16)
    layernorm_rows_backward(static_cast<const uint16_t*>(dy), static_cast<const uint16_t*>(x),
                            static_cast<const uint16_t*>(w), mean, rstd, static_cast<uint16_t*>(dx),
                            static_cast<uint16_t*>(dw), static_cast<uint16_t*>(db), rows, C, threads);
  else
    layernorm_rows_backward(static_cast<const float*>(dy), static_cast<const float*>(x), static_cast<const float*>(w),
                            mean, rstd, static_cast<float*>(dx), static_cast<float*>(dw), static_cast<float*>(db),
                            rows, C, threads);
}

}  // extern "C"

// ---- transposes of 16-bit matrices (the bf16 LM head of a training step, modules/lm_head.py) ----------------------
// dst[j * R + i] = src[i * C + j] for src (R, C) and dst (C, R), row-major. By blocks of 16 x 16 values: 16 rows of 32
// bytes loaded, transposed in registers (interleaving 16-bit, then 32-bit, then 64-bit pairs within each 128-bit half,
// then the halves exchanged) and stored as 16 rows of 32 bytes; AVX2 in both builds. A thread takes tiles of
// TRANSPOSE_TILE source rows, each tile's column blocks in turn (its source rows stay in cache while every destination
// row gets TRANSPOSE_TILE values side by side); the ragged edges (rows or columns past a multiple of 16) one value at
// a time. Measured for gpt2's 50257 x 512 bf16 logits (2 cores, AMX Xeon): about 9 ms into a reused buffer against
// torch's transpose-copy's 64 ms; the tile height made no difference past the noise (32 to 512 rows tried).
static constexpr int64_t TRANSPOSE_TILE = 256;

static inline void transpose_block16(const uint16_t* src, int64_t ss, uint16_t* dst, int64_t ds) {
  __m256i r[16], t[16];
  for (int i = 0; i < 16; i++) r[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i * ss));
  for (int i = 0; i < 8; i++) {  // t[2i]: columns 0-3 (| 8-11) of rows 2i, 2i+1 interleaved; t[2i+1]: 4-7 (| 12-15)
    t[2 * i] = _mm256_unpacklo_epi16(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi16(r[2 * i], r[2 * i + 1]);
  }
  for (int q = 0; q < 4; q++) {  // r[4q + 2h + k]: columns 4h + 2k, 4h + 2k + 1 (| +8) of rows 4q .. 4q + 3
    for (int h = 0; h < 2; h++) {
      r[4 * q + 2 * h] = _mm256_unpacklo_epi32(t[4 * q + h], t[4 * q + 2 + h]);
      r[4 * q + 2 * h + 1] = _mm256_unpackhi_epi32(t[4 * q + h], t[4 * q + 2 + h]);
    }
  }
  for (int o = 0; o < 2; o++) {  // t[8o + c]: column c (| c + 8) of rows 8o .. 8o + 7
    for (int p = 0; p < 4; p++) {
      t[8 * o + 2 * p] = _mm256_unpacklo_epi64(r[8 * o + p], r[8 * o + 4 + p]);
      t[8 * o + 2 * p + 1] = _mm256_unpackhi_epi64(r[8 * o + p], r[8 * o + 4 + p]);
    }
  }
  for (int c = 0; c < 8; c++) {  // column c of rows 0-7 and of rows 8-15 side by side; then column c + 8
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c * ds), _mm256_permute2x128_si256(t[c], t[8 + c], 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (c + 8) * ds),
                        _mm256_permute2x128_si256(t[c], t[8 + c], 0x31));
  }
}

extern "C" void rows_transpose16(const uint16_t* src, int64_t R, int64_t C, uint16_t* dst, int threads) {
  const int64_t R16 = R / 16 * 16, C16 = C / 16 * 16;
  const int64_t tiles = (R16 + TRANSPOSE_TILE - 1) / TRANSPOSE_TILE;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t tile = 0; tile < tiles; tile++) {
    const int64_t r0 = tile * TRANSPOSE_TILE, r1 = std::min(r0 + TRANSPOSE_TILE, R16);
    for (int64_t cb = 0; cb < C16; cb += 16)
      for (int64_t rb = r0; rb < r1; rb += 16) transpose_block16(src + rb * C + cb, C, dst + cb * R + rb, R);
    for (int64_t j = C16; j < C; j++)
      for (int64_t i = r0; i < r1; i++) dst[j * R + i] = src[i * C + j];
  }
  for (int64_t i = R16; i < R; i++)
    for (int64_t j = 0; j < C; j++) dst[j * R + i] = src[i * C + j];
}
