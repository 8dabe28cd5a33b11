// y[M, N] = x[M, K] @ W^T in fp32, with W kept in GGUF's blocks of 32 weights along K.
// Each weight is expanded to the exact fp32 value gguf's dequantize gives:
//   nibble blocks (Q4_0, Q4_1): w = fma(q, d, m) = fl32(d*q + m), d*q exact (fp16 d, 4-bit q);
//     Q4_0 passes m = -8d, so w = fl32(d*(q-8)), also exact;
//   byte blocks (Q8_0): w = d * q, exact (fp16 d, 8-bit q).
//
// Layout: panels of 32 rows of W (n), block by block along K. Panel p, block b holds
//   bytes:   int8  [32 k][32 n]  (element (n, k) = W's quant q[p*32 + n][b*32 + k]);
//   nibbles: uint8 [16 j][32 n]  (the byte j of row n's GGUF block: low nibble element j,
//                                 high nibble element j + 16);
// and fp32 scales d (and offsets m) [32 n] per panel and block. A last panel short of 32 rows
// is padded with rows of zero scales (and offsets), whose results are never stored.
//
// Every output is accumulated one product at a time, in one fixed order of k: for byte
// blocks 0, 1, ..., K-1; for nibble blocks, per block, j then j + 16 for j = 0..15 (the order
// a byte's two nibbles come in). A loaded weight vector holds 16 outputs' weights at one k
// (an outer product: no horizontal sums). The order does not depend on M or on which path
// runs, so row i of y is bit for bit the same whatever other rows x has: a verify pass
// multiplies a token's activations exactly as a decode pass would.
//
// Up to 8 rows of x go against weights expanded in registers. More (verify, prefill): each
// panel is expanded in that order, 4 blocks of K at a time, into an L1-sized buffer, and every
// tile of up to 14 rows of x is multiplied against it, its sums kept in y between chunks. x
// is first packed in the same order of k, tile by tile ([K][rows of the tile]), so one k's
// values are one short broadcast stream. Panels are split over OpenMP threads (the process's
// libgomp: torch's, so torch.set_num_threads applies).
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include <vector>

#include "simd.h"

namespace {

constexpr int64_t kPanel = 32, kBlock = 32, kDirectRows = 8, kTileRows = 14;
constexpr int64_t kChunkBlocks = 4;  // blocks of K expanded at a time: 128 x 32 fp32, 16 KiB

// the position in k of the e-th product of a block (the accumulation order above)
template <class F>
inline int64_t order(int64_t e) {
    return F::nibbles ? (e & 1) * 16 + (e >> 1) : e;
}

struct Nibbles {
    static constexpr bool nibbles = true;
    static constexpr int64_t block_bytes = kBlock / 2 * kPanel;  // per panel
    // the weights of products 2j, 2j + 1 (k = j and j + 16) for 16 outputs (h: which 16)
    static inline void expand(const uint8_t* q, int64_t j, int h, __m512 d, __m512 m,
                              __m512& first, __m512& second) {
        const __m512i v = _mm512_cvtepu8_epi32(
            _mm_loadu_si128((const __m128i*)(q + j * kPanel + h * 16)));
        first = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15))),
                                d, m);
        second = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), d, m);
    }
};

struct Bytes {
    static constexpr bool nibbles = false;
    static constexpr int64_t block_bytes = kBlock * kPanel;
    // the weights of products 2j, 2j + 1 (k = 2j and 2j + 1) for 16 outputs (h: which 16)
    static inline void expand(const uint8_t* q, int64_t j, int h, __m512 d, __m512,
                              __m512& first, __m512& second) {
        const uint8_t* at = q + 2 * j * kPanel + h * 16;
        first = _mm512_mul_ps(_mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)at))), d);
        second = _mm512_mul_ps(_mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(at + kPanel)))), d);
    }
};

struct Panel {  // one panel's blocks
    const uint8_t* q;
    const float* d;
    const float* m;  // nullptr for bytes
};

template <class F>
inline Panel panel(const uint8_t* q, const float* d, const float* m, int64_t K, int64_t p) {
    const int64_t blocks = K / kBlock;
    return {q + p * blocks * F::block_bytes, d + p * blocks * kPanel,
            m ? m + p * blocks * kPanel : nullptr};
}

// Block b + kAhead of the stream, asked for while block b computes. A panel's blocks (and the
// next panel's, which follow them) are one sequential stream per array, which a decode pass
// reads from memory, but the hardware prefetchers stop at every 4 KiB page. A prefetch past
// the end of the arrays is harmless.
constexpr int64_t kAhead = 8;
template <class F>
inline void prefetch_block(Panel w, int64_t b) {
    const uint8_t* q = w.q + (b + kAhead) * F::block_bytes;
    for (int64_t at = 0; at < F::block_bytes; at += 64) engine_cpu::prefetch(q + at);
    for (int64_t at = 0; at < kPanel; at += 16) {
        engine_cpu::prefetch(w.d + (b + kAhead) * kPanel + at);
        if (w.m) engine_cpu::prefetch(w.m + (b + kAhead) * kPanel + at);
    }
}

// acc[i] (two vectors: 32 outputs) to row i of y, the first `cols` outputs
template <int MT>
inline void store(__m512 (&acc)[MT][2], float* y, int64_t N, int64_t cols) {
    const __mmask16 lo = engine_cpu::tail_mask(cols);
    const __mmask16 hi = engine_cpu::tail_mask(cols - 16);
    for (int i = 0; i < MT; ++i) {
        _mm512_mask_storeu_ps(y + i * N, lo, acc[i][0]);
        _mm512_mask_storeu_ps(y + i * N + 16, hi, acc[i][1]);
    }
}

// MT rows of packed x (xt: [K][MT], in the accumulation order) against one panel, expanded in
// registers block by block
template <class F, int MT>
inline void direct(const float* xt, int64_t K, Panel w, float* y, int64_t N, int64_t cols) {
    __m512 acc[MT][2];
    for (int i = 0; i < MT; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    const int64_t blocks = K / kBlock;
    for (int64_t b = 0; b < blocks; ++b) {
        prefetch_block<F>(w, b);
        const uint8_t* q = w.q + b * F::block_bytes;
        const float* xb = xt + b * kBlock * MT;
        __m512 d[2], m[2];
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
            d[h] = _mm512_loadu_ps(w.d + b * kPanel + h * 16);
            m[h] = w.m ? _mm512_loadu_ps(w.m + b * kPanel + h * 16) : _mm512_setzero_ps();
        }
        for (int64_t j = 0; j < kBlock / 2; ++j) {
            __m512 first[2], second[2];
#pragma GCC unroll 2
            for (int h = 0; h < 2; ++h) F::expand(q, j, h, d[h], m[h], first[h], second[h]);
#pragma GCC unroll 16
            for (int i = 0; i < MT; ++i) {
                const __m512 x0 = _mm512_set1_ps(xb[2 * j * MT + i]);
                acc[i][0] = _mm512_fmadd_ps(first[0], x0, acc[i][0]);
                acc[i][1] = _mm512_fmadd_ps(first[1], x0, acc[i][1]);
            }
#pragma GCC unroll 16
            for (int i = 0; i < MT; ++i) {
                const __m512 x1 = _mm512_set1_ps(xb[(2 * j + 1) * MT + i]);
                acc[i][0] = _mm512_fmadd_ps(second[0], x1, acc[i][0]);
                acc[i][1] = _mm512_fmadd_ps(second[1], x1, acc[i][1]);
            }
        }
    }
    store<MT>(acc, y, N, cols);
}

// a panel's blocks [b0, b1), expanded to buf [(b1 - b0) * 32][32] in the accumulation order
template <class F>
inline void expand_panel(Panel w, int64_t b0, int64_t b1, float* buf) {
    for (int64_t b = b0; b < b1; ++b) {
        prefetch_block<F>(w, b);
        const uint8_t* q = w.q + b * F::block_bytes;
        float* out = buf + (b - b0) * kBlock * kPanel;
        for (int h = 0; h < 2; ++h) {
            const __m512 d = _mm512_loadu_ps(w.d + b * kPanel + h * 16);
            const __m512 m = w.m ? _mm512_loadu_ps(w.m + b * kPanel + h * 16)
                                 : _mm512_setzero_ps();
            for (int64_t j = 0; j < kBlock / 2; ++j) {
                __m512 first, second;
                F::expand(q, j, h, d, m, first, second);
                _mm512_store_ps(out + 2 * j * kPanel + h * 16, first);
                _mm512_store_ps(out + (2 * j + 1) * kPanel + h * 16, second);
            }
        }
    }
}

// MT rows of packed x (xt: [.][MT], from this chunk's first k) against `count` expanded k of
// a panel: per k, two weight vectors feed 2 * MT accumulators, each x value broadcast from
// memory. The sums start at 0 (first chunk) or from y, where the last chunk left them: fp32
// stored and reloaded exactly, so the order of the products is that of one pass.
template <int MT>
inline void dense(const float* xt, int64_t count, const float* buf, float* y, int64_t N,
                  int64_t cols, bool first) {
    const __mmask16 lo = engine_cpu::tail_mask(cols);
    const __mmask16 hi = engine_cpu::tail_mask(cols - 16);
    __m512 acc[MT][2];
    for (int i = 0; i < MT; ++i) {
        acc[i][0] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(lo, y + i * N);
        acc[i][1] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(hi, y + i * N + 16);
    }
    for (int64_t e = 0; e < count; ++e) {
        const __m512 w0 = _mm512_load_ps(buf + e * kPanel);
        const __m512 w1 = _mm512_load_ps(buf + e * kPanel + 16);
#pragma GCC unroll 16
        for (int i = 0; i < MT; ++i) {
            const __m512 xv = _mm512_set1_ps(xt[e * MT + i]);
            acc[i][0] = _mm512_fmadd_ps(w0, xv, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(w1, xv, acc[i][1]);
        }
    }
    store<MT>(acc, y, N, cols);
}

// x rows [i0, i0 + rows) packed to out [K][rows], k in the accumulation order
template <class F>
void pack(const float* x, int64_t K, int64_t i0, int64_t rows, float* out) {
    for (int64_t e = 0; e < K; ++e) {
        const int64_t k = e / kBlock * kBlock + order<F>(e % kBlock);
        for (int64_t i = 0; i < rows; ++i) out[e * rows + i] = x[(i0 + i) * K + k];
    }
}

template <class F>
void direct_rows(int64_t M, const float* xt, int64_t K, Panel w, float* y, int64_t N,
                 int64_t cols) {
    switch (M) {
        case 1: direct<F, 1>(xt, K, w, y, N, cols); break;
        case 2: direct<F, 2>(xt, K, w, y, N, cols); break;
        case 3: direct<F, 3>(xt, K, w, y, N, cols); break;
        case 4: direct<F, 4>(xt, K, w, y, N, cols); break;
        case 5: direct<F, 5>(xt, K, w, y, N, cols); break;
        case 6: direct<F, 6>(xt, K, w, y, N, cols); break;
        case 7: direct<F, 7>(xt, K, w, y, N, cols); break;
        default: direct<F, 8>(xt, K, w, y, N, cols); break;
    }
}

void dense_rows(int64_t rows, const float* xt, int64_t count, const float* buf, float* y,
                int64_t N, int64_t cols, bool first) {
    switch (rows) {
#define ENGINE_DENSE(MT) \
        case MT: dense<MT>(xt, count, buf, y, N, cols, first); break;
        ENGINE_DENSE(1) ENGINE_DENSE(2) ENGINE_DENSE(3) ENGINE_DENSE(4) ENGINE_DENSE(5)
        ENGINE_DENSE(6) ENGINE_DENSE(7) ENGINE_DENSE(8) ENGINE_DENSE(9) ENGINE_DENSE(10)
        ENGINE_DENSE(11) ENGINE_DENSE(12) ENGINE_DENSE(13)
#undef ENGINE_DENSE
        default: dense<14>(xt, count, buf, y, N, cols, first); break;
    }
}

// the calling thread's buffer for x packed, of at least `floats`, kept between calls (one for
// both formats; a fresh vector per call, zeroed and page-faulted, cost 3.8 of 34.9 ms for a
// 576 x 1536 matrix at 2000 rows)
inline float* packed_x(int64_t floats) {
    thread_local std::vector<float> memory;
    if ((int64_t)memory.size() < floats) memory.resize(floats);
    return memory.data();
}

// this thread's scratch of at least `floats`, 64-byte aligned, kept between calls
inline float* scratch(int64_t floats) {
    thread_local std::vector<float> memory;
    if ((int64_t)memory.size() < floats + 16) memory.resize(floats + 16);
    const uintptr_t at = reinterpret_cast<uintptr_t>(memory.data());
    return reinterpret_cast<float*>((at + 63) & ~uintptr_t{63});
}

template <class F>
void linear(const float* x, int64_t M, int64_t K, const uint8_t* q, const float* d,
            const float* m, int64_t N, float* y, int64_t threads) {
    const int64_t panels = (N + kPanel - 1) / kPanel, blocks = K / kBlock;
    // tiles of x: up to 8 rows in one; past that, as even as tiles of at most 14 rows allow
    const int64_t tiles = M <= kDirectRows ? 1 : (M + kTileRows - 1) / kTileRows;
    std::vector<int64_t> start(tiles + 1);
    for (int64_t t = 0; t <= tiles; ++t) start[t] = M * t / tiles;
    // x packed, tile t at xt + start[t] * K (a pointer: inside the parallel region a
    // thread_local name is each thread's own)
    float* const xt = packed_x(M * K);
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; ++t)
            pack<F>(x, K, start[t], start[t + 1] - start[t], xt + start[t] * K);
        float* buf = M > kDirectRows ? scratch(kChunkBlocks * kBlock * kPanel) : nullptr;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; ++p) {
            const Panel w = panel<F>(q, d, m, K, p);
            const int64_t cols = N - p * kPanel < kPanel ? N - p * kPanel : kPanel;
            if (M <= kDirectRows) {
                direct_rows<F>(M, xt, K, w, y + p * kPanel, N, cols);
                continue;
            }
            // chunk by chunk of K, so that the expanded weights stay in L1 for every tile
            for (int64_t b0 = 0; b0 < blocks; b0 += kChunkBlocks) {
                const int64_t b1 = b0 + kChunkBlocks < blocks ? b0 + kChunkBlocks : blocks;
                expand_panel<F>(w, b0, b1, buf);
                for (int64_t t = 0; t < tiles; ++t) {
                    const int64_t rows = start[t + 1] - start[t];
                    dense_rows(rows, xt + start[t] * K + b0 * kBlock * rows,
                               (b1 - b0) * kBlock, buf, y + start[t] * N + p * kPanel, N,
                               cols, b0 == 0);
                }
            }
        }
    }
}

}  // namespace

// A matrix is described by 6 int64 values: kind (0: nibble blocks, 1: byte blocks), the
// addresses of its quants, scales and offsets (0 for bytes), N and K (a multiple of 32); every
// array contiguous, in the layout above. threads: the caller's torch.get_num_threads() (an
// OpenMP thread count is per calling thread, and the engine may run in a thread of its own).
extern "C" void blockq_linear(const float* x, int64_t M, const int64_t* w, float* y,
                              int64_t threads) {
    if (M <= 0) return;  // nothing to multiply (a row count of 0 would pick the 8-row tile)
    const uint8_t* q = reinterpret_cast<const uint8_t*>(w[1]);
    const float* d = reinterpret_cast<const float*>(w[2]);
    if (w[0] == 0)
        linear<Nibbles>(x, M, w[5], q, d, reinterpret_cast<const float*>(w[3]), w[4], y,
                        threads);
    else
        linear<Bytes>(x, M, w[5], q, d, nullptr, w[4], y, threads);
}
