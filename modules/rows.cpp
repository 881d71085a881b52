// A few rows times a weight that streams from memory: y[b, o] = (sum_i x[b, i] * w[o, i]) * scale[o] + bias[o]
// for x (B, in) fp32, B <= 8, and w (out, in) row-major in fp32, bf16 or int8 (scale: int8's per-row scales).
//
// Decoding multiplies one to eight token rows by every weight matrix: the work is reading the weights, and torch's
// kernels for these shapes read them well below the memory's speed (docs/performance.md). Here each weight row is
// read once for all B input rows, converted to fp32 in registers (bf16: shift into the high half; int8: sign-extend
// and convert), and multiplied into B accumulators; R weight rows at a time keep R x B independent sums in flight.
// Sums are fp32 in a different order from torch's, so results agree to float rounding, not bit for bit.
//
// Built by modules/rows.py with -march=native on the machine that runs it: the AVX512 or AVX2 path is chosen by the
// compiler from the CPU at hand. Threads: OpenMP over blocks of output rows, the same libgomp torch uses.
#include <immintrin.h>
#include <omp.h>

#include <cstdint>
#include <cstring>

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
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kWidth = 8;
using vf = __m256;
static inline vf vzero() { return _mm256_setzero_ps(); }
static inline vf xload(const float* p) { return _mm256_loadu_ps(p); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
static inline vf wload(const float* p) { return _mm256_loadu_ps(p); }
static inline vf wload(const uint16_t* p) {
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
static inline vf wload(const int8_t* p) {
  // a full 8-byte load, sign-extended in register (no partial vector load through memory)
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
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

// How far ahead each weight row is prefetched (products alone, GB/s, docs/performance.md). One fp32 or bf16 row:
// 1024 bytes further along the row. int8: the same place in the next group of R rows (1024 bytes on would land in
// the rows being read, a gpt2 int8 row being 768 bytes): 24-32 GB/s of int8 against 19-28 with the fixed distance
// and 14-25 without. Several fp32 rows: the same place two groups on: 4 rows 26.7-48.1 against 22.7-35.7 with the
// fixed distance, 8 rows 16.6-33.8 against 18.2-23.3 (the hardware prefetcher alone: 15-22).
constexpr int64_t kPrefetch = 1024;

// R weight rows starting at o, times all B input rows.
template <typename T, int B, int R>
static inline void rows_at(const float* x, int64_t in, const T* w, const float* scale, const float* bias, float* y,
                           int64_t out, int64_t o) {
  vf acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = vzero();
  vf wv[R];
  int64_t i = 0;
  for (; i + kWidth <= in; i += kWidth) {
    for (int r = 0; r < R; ++r) {
      if constexpr (sizeof(T) == 1)  // int8: the same place in the next group of R rows
        _mm_prefetch(reinterpret_cast<const char*>(w + (o + R + r) * in + i), _MM_HINT_T0);
      else if constexpr (B > 1)  // several rows: the same place two groups on
        _mm_prefetch(reinterpret_cast<const char*>(w + (o + 2 * R + r) * in + i), _MM_HINT_T0);
      else
        _mm_prefetch(reinterpret_cast<const char*>(w + (o + r) * in + i) + kPrefetch, _MM_HINT_T0);
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
      if (scale) s *= scale[o + r];
      if (bias) s += bias[o + r];
      y[b * out + o + r] = s;
    }
  }
}

// Weight rows per step: R x B accumulators, R weight vectors and one input vector must stay in vector registers.
// AVX512 has 32, so several input rows take 3 to 8 weight rows at a time: each loaded input vector then feeds R
// FMAs, and loads no longer outnumber them (8 rows, fp32, gpt2's 768 x 3072: 24 GB/s of weights against 13 with
// one weight row at a time, bench/rows_kernel.py). AVX2 has 16.
template <int B>
constexpr int rows_per_step() {
  if constexpr (kWidth == 16)
    return B == 1 ? 4 : B == 2 ? 8 : B == 3 ? 6 : B == 4 ? 5 : B <= 6 ? 4 : 3;
  else
    return B <= 2 ? 4 : B <= 4 ? 2 : 1;
}

template <typename T, int B>
static void product(const float* x, int64_t in, const T* w, const float* scale, const float* bias, float* y,
                    int64_t out, int threads) {
  constexpr int R = rows_per_step<B>();
  const int64_t steps = out / R;  // whole steps of R rows; the rows left over go one at a time below
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t s = 0; s < steps; ++s) rows_at<T, B, R>(x, in, w, scale, bias, y, out, s * R);
  for (int64_t o = steps * R; o < out; ++o) rows_at<T, B, 1>(x, in, w, scale, bias, y, out, o);
}

template <typename T>
static int dispatch(int64_t rows, const float* x, int64_t in, const T* w, const float* scale, const float* bias,
                    float* y, int64_t out, int threads) {
  switch (rows) {
    case 1: product<T, 1>(x, in, w, scale, bias, y, out, threads); return 0;
    case 2: product<T, 2>(x, in, w, scale, bias, y, out, threads); return 0;
    case 3: product<T, 3>(x, in, w, scale, bias, y, out, threads); return 0;
    case 4: product<T, 4>(x, in, w, scale, bias, y, out, threads); return 0;
    case 5: product<T, 5>(x, in, w, scale, bias, y, out, threads); return 0;
    case 6: product<T, 6>(x, in, w, scale, bias, y, out, threads); return 0;
    case 7: product<T, 7>(x, in, w, scale, bias, y, out, threads); return 0;
    case 8: product<T, 8>(x, in, w, scale, bias, y, out, threads); return 0;
    default: return -1;
  }
}

extern "C" {

// kind: 0 fp32, 1 bf16 (as uint16 bits), 2 int8 (needs scale). scale and bias may be null. Returns 0, or -1 where
// rows is outside 1..8 or kind unknown (nothing written).
int rows_product(int kind, int64_t rows, const float* x, int64_t in, const void* w, const float* scale,
                 const float* bias, float* y, int64_t out, int threads) {
  if (threads < 1) threads = 1;
  switch (kind) {
    case 0: return dispatch(rows, x, in, static_cast<const float*>(w), scale, bias, y, out, threads);
    case 1: return dispatch(rows, x, in, static_cast<const uint16_t*>(w), scale, bias, y, out, threads);
    case 2: return dispatch(rows, x, in, static_cast<const int8_t*>(w), scale, bias, y, out, threads);
    default: return -1;
  }
}

int rows_vector_width() { return static_cast<int>(kWidth); }
}
