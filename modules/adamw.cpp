// One AdamW step over a contiguous fp32 tensor in a single pass (optimizer.AdamW(fused=True), modules/adamw.py).
//
// torch's CPU AdamW makes one pass over memory per operation (decay, lerp, mul, addcmul, sqrt, div, add, addcdiv):
// eight reads and writes of 124M floats a step for gpt2, so the step is bound by memory traffic. Here each element is
// read once (p, g, m, v) and written once (p, m, v). The arithmetic is torch's, operation for operation and in its
// order, with a fused multiply-add exactly where torch's vectorised kernels use one (lerp, addcmul): the moments equal
// torch's to the bit. The parameters differ only through the square root: this one is IEEE's, correctly rounded;
// torch's vectorised sqrt is one ulp away in about one entry in six, which moves the update by a float32 rounding
// (tests/tolerances.py: ADAMW_FUSED_VS_TORCH).
//
// Chunks of 16384 elements go to the threads as they free up (a core taken by another process then takes fewer)
// rather than in two fixed halves that wait for the slower one.
//
// Built with -ffp-contract=off (the compiler must not fuse a multiply and an add that torch keeps apart) and
// -fno-math-errno (so that sqrt vectorises; it is still the correctly rounded one).
#include <cmath>
#include <cstdint>
#include <cstring>

extern "C" void adamw_step_f32(int64_t n, float* __restrict p, const float* __restrict g, float* __restrict m,
                               float* __restrict v, float decay, float one_minus_beta1, float beta2,
                               float one_minus_beta2, float bias_correction2_sqrt, float eps, float step_size,
                               int threads) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 16384) if (threads > 1)
    for (int64_t i = 0; i < n; ++i) {
        const float gi = g[i];
        const float pi = p[i] * decay;                                  // p.mul_(1 - lr * weight_decay)
        const float mi = std::fma(one_minus_beta1, gi - m[i], m[i]);    // m.lerp_(g, 1 - beta1), weight < 0.5
        const float vi = std::fma(one_minus_beta2 * gi, gi, v[i] * beta2);  // v.mul_(beta2).addcmul_(g, g, 1-beta2)
        const float denom = std::sqrt(vi) / bias_correction2_sqrt + eps;  // (v.sqrt() / bc2_sqrt).add_(eps)
        m[i] = mi;
        v[i] = vi;
        p[i] = pi + step_size * mi / denom;                             // p.addcdiv_(m, denom, -lr / bc1)
    }
}

// The same step for a bf16 parameter with an fp32 master copy (optimizer.AdamW(master_weights=True)): the update of
// the master from the bf16 gradient (widened exactly), as torch's AdamW on the master with grad.float() computes it;
// then the parameter is the master rounded to the nearest bf16 (ties to even, as torch's conversion). One pass:
// reads master, gradient, moments; writes master, moments and the bf16 parameter.
static inline float widen_bf16(uint16_t h) {
    const uint32_t bits = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t round_bf16(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    const uint32_t rounded = (bits + 0x7fffU + ((bits >> 16) & 1U)) >> 16;
    return uint16_t((bits & 0x7fffffffU) > 0x7f800000U ? (bits >> 16) | 0x40U : rounded);
}

extern "C" void adamw_step_bf16_master(int64_t n, float* __restrict p, uint16_t* __restrict low,
                                       const uint16_t* __restrict g, float* __restrict m, float* __restrict v,
                                       float decay, float one_minus_beta1, float beta2, float one_minus_beta2,
                                       float bias_correction2_sqrt, float eps, float step_size, int threads) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 16384) if (threads > 1)
    for (int64_t i = 0; i < n; ++i) {
        const float gi = widen_bf16(g[i]);
        const float pi = p[i] * decay;
        const float mi = std::fma(one_minus_beta1, gi - m[i], m[i]);
        const float vi = std::fma(one_minus_beta2 * gi, gi, v[i] * beta2);
        const float denom = std::sqrt(vi) / bias_correction2_sqrt + eps;
        const float updated = pi + step_size * mi / denom;
        m[i] = mi;
        v[i] = vi;
        p[i] = updated;
        low[i] = round_bf16(updated);
    }
}
