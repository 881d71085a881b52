// RMSNorm forward and backward in one pass each over a row (modules/rmsnorm.py), float32.
//
// torch's CPU rms_norm is a composite: forward pow, mean, add, rsqrt, mul, mul (six passes over the input), and
// autograd's backward through each of them (about a dozen more). On the race's model (4 x 128, 12 x 64 tokens) each
// of a step's 17 norms cost 0.8 ms forward and backward against LayerNorm's 0.22. Here a row of `dim` values is read
// once to find its reciprocal RMS and once to write the output (the row stays in L1), and backward reads dy, x and
// the saved reciprocal RMS once to write dx; the weight's gradient is summed per chunk of rows, then across chunks.
//
//   forward:  r = 1 / sqrt(mean(x^2) + eps),  y = x * r * w            (w = 1 without a weight)
//   backward: g = dy * w,  dx = r * (g - x * r^2 * mean(g * x)),  dw = sum over rows of dy * x * r
//
// Row sums in float32 over vector lanes (as torch's own reductions); the weight's gradient is summed over rows in
// double. The results agree with torch's composite to float32 rounding (tests/test_rmsnorm.py states the tolerance).
#include <cmath>
#include <cstdint>
#include <vector>

extern "C" void rmsnorm_forward(int64_t rows, int64_t dim, const float* __restrict x, const float* __restrict w,
                                float eps, float* __restrict y, float* __restrict rstd, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t i = 0; i < rows; ++i) {
        const float* xs = x + i * dim;
        float* ys = y + i * dim;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < dim; ++j) sum += xs[j] * xs[j];
        const float r = 1.0f / std::sqrt(sum / float(dim) + eps);
        rstd[i] = r;
        if (w) {
            for (int64_t j = 0; j < dim; ++j) ys[j] = xs[j] * r * w[j];
        } else {
            for (int64_t j = 0; j < dim; ++j) ys[j] = xs[j] * r;
        }
    }
}

// dw (dim values, or null: no weight, or no gradient asked for it) is written, not accumulated (zeros for no rows). The rows go in chunks of kChunk, each
// chunk's share of dw summed in double on its own, then the chunks in order: the same sums whatever the thread count.
constexpr int64_t kChunk = 32;

extern "C" void rmsnorm_backward(int64_t rows, int64_t dim, const float* __restrict dy, const float* __restrict x,
                                 const float* __restrict w, const float* __restrict rstd, float* __restrict dx,
                                 float* __restrict dw, int threads) {
    const int64_t chunks = (rows + kChunk - 1) / kChunk;
    const bool weighted = w && dw;
    std::vector<double> partial(weighted ? size_t(chunks) * size_t(dim) : 0, 0.0);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t c = 0; c < chunks; ++c) {
        double* mine = weighted ? partial.data() + size_t(c) * size_t(dim) : nullptr;
        const int64_t stop = (c + 1) * kChunk < rows ? (c + 1) * kChunk : rows;
        for (int64_t i = c * kChunk; i < stop; ++i) {
            const float* dys = dy + i * dim;
            const float* xs = x + i * dim;
            float* dxs = dx + i * dim;
            const float r = rstd[i];
            float dot = 0.0f;  // sum of g * x
            if (w) {
#pragma omp simd reduction(+ : dot)
                for (int64_t j = 0; j < dim; ++j) dot += dys[j] * w[j] * xs[j];
            } else {
#pragma omp simd reduction(+ : dot)
                for (int64_t j = 0; j < dim; ++j) dot += dys[j] * xs[j];
            }
            const float k = dot / float(dim) * r * r;
            if (w) {
                for (int64_t j = 0; j < dim; ++j) dxs[j] = r * (dys[j] * w[j] - xs[j] * k);
            } else {
                for (int64_t j = 0; j < dim; ++j) dxs[j] = r * (dys[j] - xs[j] * k);
            }
            if (mine) {
                for (int64_t j = 0; j < dim; ++j) mine[j] += double(dys[j]) * double(xs[j] * r);
            }
        }
    }
    if (weighted) {
        for (int64_t j = 0; j < dim; ++j) {
            double sum = 0.0;
            for (int64_t c = 0; c < chunks; ++c) sum += partial[size_t(c) * size_t(dim) + size_t(j)];
            dw[j] = float(sum);
        }
    }
}
