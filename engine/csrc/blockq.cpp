// y[M, N] = x[M, K] @ W^T in fp32, with W kept in GGUF's blocks of 32 weights along K.
// Each weight is expanded in registers to the exact fp32 value gguf's dequantize gives:
//   nibble blocks (Q4_0, Q4_1): w = fma(q, d, m) = fl32(d*q + m), d*q exact (fp16 d, 4-bit q);
//     Q4_0 passes m = -8d, so w = fl32(d*(q-8)), also exact;
//   byte blocks (Q8_0): w = d * q, exact (fp16 d, 8-bit q).
// Layout: nibbles [N, K/2] (per block, 16 bytes: low nibbles are elements 0..15, high nibbles
// 16..31), bytes [N, K] int8, d and m [N, K/32] fp32. Rows of W are split over OpenMP threads
// (the process's libgomp: torch's, so torch.set_num_threads applies). Up to 8 x rows (decode)
// go in one tile against blocks expanded in registers; more (verify, prefill) against groups
// of 4 W rows expanded once into an L1-sized buffer.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include <vector>

#include "simd.h"

namespace {

struct Nibbles {
    static constexpr int64_t row_bytes(int64_t k) { return k / 2; }
    static inline void expand(const uint8_t* q, float d, float m, __m512& w0, __m512& w1) {
        const __m512i all = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)q));
        const __m512 vd = _mm512_set1_ps(d), vm = _mm512_set1_ps(m);
        w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(all, _mm512_set1_epi32(15))),
                             vd, vm);
        w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(all, 4)), vd, vm);
    }
};

struct Bytes {
    static constexpr int64_t row_bytes(int64_t k) { return k; }
    static inline void expand(const uint8_t* q, float d, float, __m512& w0, __m512& w1) {
        const __m512 vd = _mm512_set1_ps(d);
        w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)q))), vd);
        w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + 16)))), vd);
    }
};

// NR rows of W (from row n) against MT rows of x: NR * MT dot products of length K.
template <class F, int MT, int NR>
inline void tile(const float* x, int64_t K, const uint8_t* q, const float* d, const float* m,
                 float* y, int64_t N) {
    __m512 acc[NR][MT];
    for (int r = 0; r < NR; ++r)
        for (int i = 0; i < MT; ++i) acc[r][i] = _mm512_setzero_ps();
    const int64_t blocks = K / 32, row = F::row_bytes(K), block_bytes = F::row_bytes(32);
    for (int64_t b = 0; b < blocks; ++b) {
        const float* xb = x + b * 32;
        for (int r = 0; r < NR; ++r) {
            __m512 w0, w1;
            F::expand(q + r * row + b * block_bytes, d[r * blocks + b],
                      m ? m[r * blocks + b] : 0.0f, w0, w1);
            for (int i = 0; i < MT; ++i) {
                acc[r][i] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xb + i * K), acc[r][i]);
                acc[r][i] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + i * K + 16), acc[r][i]);
            }
        }
    }
    engine_cpu::store_sums<NR, MT>(acc, y, N);
}

// The next tile's weights, asked for while this tile computes: the blocks stream from memory,
// and a tile's quants, scales and offsets are three short streams the hardware prefetchers
// pick up late.
inline void prefetch_rows(const uint8_t* q, int64_t bytes, const float* d, const float* m,
                          int64_t scales) {
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch((const char*)(q + b), _MM_HINT_T0);
    for (int64_t i = 0; i < scales; i += 16) {
        _mm_prefetch((const char*)(d + i), _MM_HINT_T0);
        if (m) _mm_prefetch((const char*)(m + i), _MM_HINT_T0);
    }
}

// rows [n, n + count) of W against MT rows of x; few x rows take several W rows at once so
// that the accumulation chains overlap
template <class F, int MT>
void rows(const float* x, int64_t K, const uint8_t* q, const float* d, const float* m,
          float* y, int64_t N, int64_t n, int64_t count) {
    constexpr int NR = MT <= 2 ? 4 : 2;
    const int64_t row = F::row_bytes(K), blocks = K / 32;
    int64_t r = n;
    for (; r + NR <= n + count; r += NR) {
        const int64_t ahead = N - (r + NR) < NR ? N - (r + NR) : NR;  // rows after this tile
        prefetch_rows(q + (r + NR) * row, ahead * row, d + (r + NR) * blocks,
                      m ? m + (r + NR) * blocks : nullptr, ahead * blocks);
        tile<F, MT, NR>(x, K, q + r * row, d + r * blocks, m ? m + r * blocks : nullptr,
                        y + r, N);
    }
    for (; r < n + count; ++r)
        tile<F, MT, 1>(x, K, q + r * row, d + r * blocks, m ? m + r * blocks : nullptr,
                       y + r, N);
}

// MT rows of x (held in registers) against NR rows of W already expanded to fp32 (w: NR rows
// of K floats): each loaded weight vector feeds MT accumulators, each x vector NR of them.
template <int MT, int NR>
inline void dense_tile(const float* x, int64_t K, const float* w, float* y, int64_t N) {
    __m512 acc[NR][MT];
    for (int r = 0; r < NR; ++r)
        for (int i = 0; i < MT; ++i) acc[r][i] = _mm512_setzero_ps();
    for (int64_t e = 0; e < K; e += 16) {
        __m512 xv[MT];
        for (int i = 0; i < MT; ++i) xv[i] = _mm512_loadu_ps(x + i * K + e);
        for (int r = 0; r < NR; ++r) {
            const __m512 wv = _mm512_loadu_ps(w + r * K + e);
            for (int i = 0; i < MT; ++i) acc[r][i] = _mm512_fmadd_ps(wv, xv[i], acc[r][i]);
        }
    }
    engine_cpu::store_sums<NR, MT>(acc, y, N);
}

template <int NR>
void dense_rows(const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t N) {
    for (int64_t i = 0; i < M; i += 4) {
        const float* xi = x + i * K;
        float* yi = y + i * N;
        switch (M - i < 4 ? M - i : 4) {
            case 1: dense_tile<1, NR>(xi, K, w, yi, N); break;
            case 2: dense_tile<2, NR>(xi, K, w, yi, N); break;
            case 3: dense_tile<3, NR>(xi, K, w, yi, N); break;
            default: dense_tile<4, NR>(xi, K, w, yi, N); break;
        }
    }
}

// row r of W expanded to fp32: out[0..K)
template <class F>
inline void expand_row(const uint8_t* q, const float* d, const float* m, int64_t r, int64_t K,
                       float* out) {
    const int64_t row = F::row_bytes(K), blocks = K / 32;
    for (int64_t b = 0; b < blocks; ++b) {
        __m512 w0, w1;
        F::expand(q + r * row + b * F::row_bytes(32), d[r * blocks + b],
                  m ? m[r * blocks + b] : 0.0f, w0, w1);
        _mm512_storeu_ps(out + b * 32, w0);
        _mm512_storeu_ps(out + b * 32 + 16, w1);
    }
}

template <class F>
void linear(const float* x, int64_t M, int64_t K, const uint8_t* q, const float* d,
            const float* m, int64_t N, float* y, int64_t threads) {
    constexpr int64_t kRowsPerTask = 16, kGroup = 4, kDirectRows = 8;
    const int64_t tasks = (N + kRowsPerTask - 1) / kRowsPerTask;
#pragma omp parallel num_threads(threads)
    {
        // Past one tile of 8 x rows (verify, prefill), each group of 4 W rows is expanded once
        // into this buffer (L1 sized) and multiplied dense against every tile of 4 x rows:
        // ~1.2x faster at 13 rows on one thread, ~1.3x at 64. Up to 8 rows, expanding in
        // registers per tile is faster.
        std::vector<float> expanded(M > kDirectRows ? kGroup * K : 0);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; ++t) {
            const int64_t n = t * kRowsPerTask;
            const int64_t count = N - n < kRowsPerTask ? N - n : kRowsPerTask;
            if (M <= kDirectRows) {
                for (int64_t i = 0; i < M; i += 8) {
                    const float* xi = x + i * K;
                    float* yi = y + i * N;
                    switch (M - i < 8 ? M - i : 8) {
                        case 1: rows<F, 1>(xi, K, q, d, m, yi, N, n, count); break;
                        case 2: rows<F, 2>(xi, K, q, d, m, yi, N, n, count); break;
                        case 3: rows<F, 3>(xi, K, q, d, m, yi, N, n, count); break;
                        case 4: rows<F, 4>(xi, K, q, d, m, yi, N, n, count); break;
                        case 5: rows<F, 5>(xi, K, q, d, m, yi, N, n, count); break;
                        case 6: rows<F, 6>(xi, K, q, d, m, yi, N, n, count); break;
                        case 7: rows<F, 7>(xi, K, q, d, m, yi, N, n, count); break;
                        default: rows<F, 8>(xi, K, q, d, m, yi, N, n, count); break;
                    }
                }
                continue;
            }
            for (int64_t r0 = n; r0 < n + count; r0 += kGroup) {
                const int64_t group = n + count - r0 < kGroup ? n + count - r0 : kGroup;
                for (int64_t r = 0; r < group; ++r)
                    expand_row<F>(q, d, m, r0 + r, K, expanded.data() + r * K);
                if (group == kGroup) {
                    dense_rows<kGroup>(x, M, K, expanded.data(), y + r0, N);
                } else {
                    for (int64_t r = 0; r < group; ++r)
                        dense_rows<1>(x, M, K, expanded.data() + r * K, y + r0 + r, N);
                }
            }
        }
    }
}

// every weight of W, expanded to fp32 [N, K] (for a large product handed to a dense GEMM)
template <class F>
void expand_all(const uint8_t* q, const float* d, const float* m, int64_t N, int64_t K,
                float* out, int64_t threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < N; ++r) expand_row<F>(q, d, m, r, K, out + r * K);
}

}  // namespace

extern "C" {
// K must be a multiple of 32; every pointer is to contiguous memory of the layout above.
// threads: the caller's torch.get_num_threads() (an OpenMP thread count is per calling
// thread, and the engine may run in a thread of its own).
void blockq_nibbles_linear(const float* x, int64_t M, int64_t K, const uint8_t* q,
                           const float* d, const float* m, int64_t N, float* y,
                           int64_t threads) {
    linear<Nibbles>(x, M, K, q, d, m, N, y, threads);
}
void blockq_bytes_linear(const float* x, int64_t M, int64_t K, const uint8_t* q,
                         const float* d, int64_t N, float* y, int64_t threads) {
    linear<Bytes>(x, M, K, q, d, nullptr, N, y, threads);
}
void blockq_nibbles_expand(const uint8_t* q, const float* d, const float* m, int64_t N,
                           int64_t K, float* out, int64_t threads) {
    expand_all<Nibbles>(q, d, m, N, K, out, threads);
}
void blockq_bytes_expand(const uint8_t* q, const float* d, int64_t N, int64_t K, float* out,
                         int64_t threads) {
    expand_all<Bytes>(q, d, nullptr, N, K, out, threads);
}
}
