// One sampled token per row, the token torch.multinomial(probs, 1, generator=g) draws (modules/draw.py).
//
// For one sample torch's CPU multinomial takes the exponential race: q = empty_like(probs).exponential_(1, g),
// then argmax(probs / q) along the row. exponential_ fills q element by element from the generator, a Mersenne
// Twister (MT19937): for each element two 32-bit words a, b, u = ((a << 32 | b) & (2^53 - 1)) * 2^-53, and
// q = (float)(-1.0 * log1p(-u)). That is about 1 ms of a sampled gpt2 token on a Zen 4 (50,257 logarithms, one
// thread). Here the same words are drawn from the same state, so the generator ends where torch's would, but the
// logarithm is taken only where it can change the answer: not where probs == 0 (probs / q is 0 whatever q is, except
// where u == 0: q == 0, 0 / 0 is NaN, which torch's argmax takes, kept as it is), nor where probs / u, a bound of
// probs / q, cannot pass the best ratio so far (after the first few elements, nearly everywhere). The ratio and the
// argmax are torch's: float division, the first NaN if any, else the first of the largest.
//
// The state is the generator's get_state() bytes (CPUGeneratorImplState: a uint64 seed, int32 left, int32 seeded,
// uint64 next, 624 uint64 state words, then the normal samples' fields, untouched), read and written in place.
// Built without FMA contraction; log1p is the C library's, as torch's (modules/draw.py checks both against torch).
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int N = 624, M = 397;

struct Twister {
    uint32_t state[N];
    uint32_t out[N];  // the state's words tempered, drawn in order (the tempering vectorises over the block)
    int next;  // the index of the next word; N: twist first

    void twist() {
        auto mix = [](uint32_t u, uint32_t v) {
            return (((u & 0x80000000U) | (v & 0x7fffffffU)) >> 1) ^ ((v & 1U) ? 0x9908b0dfU : 0U);
        };
        int i = 0;
        for (; i < N - M; ++i) state[i] = state[i + M] ^ mix(state[i], state[i + 1]);
        for (; i < N - 1; ++i) state[i] = state[i + M - N] ^ mix(state[i], state[i + 1]);
        state[N - 1] = state[M - 1] ^ mix(state[N - 1], state[0]);
        temper(0);
        next = 0;
    }

    void temper(int from) {
        for (int j = from; j < N; ++j) {
            uint32_t y = state[j];
            y ^= y >> 11;
            y ^= (y << 7) & 0x9d2c5680U;
            y ^= (y << 15) & 0xefc60000U;
            y ^= y >> 18;
            out[j] = y;
        }
    }

    uint32_t word() {
        if (next == N) twist();
        return out[next++];
    }
};

constexpr int64_t kLeft = 8, kNext = 16, kState = 24;  // byte offsets in the generator's state

}  // namespace

extern "C" {

// probs: rows x V floats, row r at probs + r * stride. Writes each row's token to out. Returns 0; 1 where a row has a
// NaN, an infinity, a negative value or no positive one (torch.multinomial raises there: the caller lets it); 2 where
// the state's position is not one torch leaves (nothing written then).
int draw_tokens(const float* probs, int64_t rows, int64_t V, int64_t stride, unsigned char* state, int64_t* out) {
    int32_t left;
    uint64_t next;
    std::memcpy(&left, state + kLeft, 4);
    std::memcpy(&next, state + kNext, 8);
    Twister mt;
    // torch twists when a draw finds left == 1; otherwise left + next == N + 1 (see at::mt19937's operator())
    if (left == 1) {
        mt.next = N;
    } else if (left > 1 && left <= N && int64_t(next) + left == N + 1) {
        mt.next = int(next);
    } else {
        return 2;
    }
    for (int64_t r = 0; r < rows; ++r) {  // on the bits, so the loop vectorises: torch takes -0.0 (>= 0)
        const float* p = probs + r * stride;
        uint32_t bad = 0, positive = 0;
        for (int64_t i = 0; i < V; ++i) {
            uint32_t b;
            std::memcpy(&b, p + i, 4);
            bad |= uint32_t(b > 0x7f7fffffU) & uint32_t(b != 0x80000000U);  // negative, infinite or NaN
            positive |= uint32_t(b - 1U < 0x7f7fffffU);  // finite and > 0
        }
        if (bad || !positive) return 1;
    }
    for (int i = 0; i < N; ++i) {
        uint64_t word;
        std::memcpy(&word, state + kState + 8 * i, 8);
        mt.state[i] = uint32_t(word);
    }
    if (mt.next < N) mt.temper(mt.next);
    for (int64_t r = 0; r < rows; ++r) {
        const float* p = probs + r * stride;
        int64_t best = -1, nan_at = -1;
        float best_ratio = 0.0f;
        for (int64_t i = 0; i < V; ++i) {
            uint64_t high = mt.word();
            uint64_t bits = ((high << 32) | mt.word()) & ((uint64_t(1) << 53) - 1);
            if (p[i] == 0.0f) {
                if (bits == 0 && nan_at < 0) nan_at = i;  // q == 0: 0 / 0
                continue;  // ratio 0: the largest is positive (a row has a positive probability)
            }
            double u = double(bits) * (1.0 / 9007199254740992.0);
            // q >= u (-log(1 - u) >= u), so p / q <= p / u: where even p / u cannot pass the best ratio (with a
            // margin of 1e-6 over the roundings of log1p, the float q and the division, ~2.4e-7), the logarithm is
            // not needed; on a tie the earlier index stays, as torch's argmax keeps it
            if (best >= 0 && bits != 0 && double(p[i]) * (1.0 + 1e-6) <= double(best_ratio) * u) continue;
            float q = float(-1.0 * std::log1p(-u));
            float ratio = p[i] / q;  // q == 0 gives infinity, as torch's division does
            if (best < 0 || ratio > best_ratio) {
                best = i;
                best_ratio = ratio;
            }
        }
        out[r] = nan_at >= 0 ? nan_at : best;
    }
    // the position torch keeps: after a draw at index n - 1, next == n and left == N + 1 - n
    int32_t new_left = N + 1 - mt.next;
    uint64_t new_next = uint64_t(mt.next);
    std::memcpy(state + kLeft, &new_left, 4);
    std::memcpy(state + kNext, &new_next, 8);
    for (int i = 0; i < N; ++i) {
        uint64_t word = mt.state[i];
        std::memcpy(state + kState + 8 * i, &word, 8);
    }
    return 0;
}

}  // extern "C"
