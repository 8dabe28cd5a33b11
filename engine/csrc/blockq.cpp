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
// (an outer product: no horizontal sums). The order does not depend on M or on which of the
// FMA paths below runs (registers or an expanded panel), so row i of y is bit for bit the
// same whatever other rows x has: a verify pass multiplies a token's activations exactly as a
// decode pass would. The AMX path (its own section below) keeps that property with sums of
// its own, which differ from these in the last bits.
//
// Up to 8 rows of x go against weights expanded in registers. More (verify, prefill): each
// panel is expanded in that order, 4 blocks of K at a time, into an L1-sized buffer, and every
// tile of up to 14 rows of x is multiplied against it, its sums kept in y between chunks. x
// is first packed in the same order of k, tile by tile ([K][rows of the tile]), so one k's
// values are one short broadcast stream. Panels are split over OpenMP threads (the process's
// libgomp: torch's, so torch.set_num_threads applies).
#include <cpuid.h>
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <strings.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
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

// ---------------------------------------------------------------------------------------
// The AMX path (Intel AMX-BF16: Sapphire Rapids and later), which serves every M where the CPU
// and the OS allow it: a weight's quants are small integers, exact in bf16, and x is split
// exactly into three bf16 planes (hi + mid + lo = x: each plane keeps the next 8 bits of the
// mantissa, truncated), so the tile unit's products are exact and its sums fp32. Per block b
// of 32 weights along K, for 16 rows of x and 16 outputs at a time,
//   C[i][n] = sum over the planes, then over k, of plane(x[i][k]) * q[n][k]   (TDPBF16PS)
//   y[i][n] = fma(C, d[n][b], y);  y = fma(s[i][b], m[n][b], y)   (s: x's sum over the block)
// which is d*q + m summed in fp32 (Q4_0's m = -8d and Q8_0's m = 0 likewise), with one fixed
// order per output whatever the other rows are: rows are independent in a tile product, and
// the blocks, planes and scalings run in one order. So a row's result still does not depend
// on its batch; it differs from the FMA path's in the last bits (another order of sums), and
// a process uses one path for every call (blockq_amx).
//
// Pair order within a tile row (the k of the two bf16 in a dword): nibble blocks pair k = j
// and j + 16 (a byte's two nibbles), byte blocks pair 2j and 2j + 1 (rows 2j, 2j + 1 of the
// block's [32 k][32 n] bytes); x is packed in the same pairs. The weights' tiles are built in
// a 2 KiB buffer per block (two tiles: outputs 0-15 and 16-31 of the panel) and used by every
// 16-row tile of x; rows of x go in groups of kGroupTiles tiles, so a group's packed x (6
// bytes per value) stays in L2 while every panel passes.

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
constexpr int64_t kPlanes = 3, kAmxRows = 16, kGroupTiles = 4;
constexpr int64_t kRing = 4;  // weight tiles built ahead: blocks b + 1 .. b + 3 while b runs
constexpr int64_t kPlaneBytes = kAmxRows * 64;  // one tile: 16 rows of 32 bf16

struct alignas(64) TileConfig {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

bool amx_supported() {
    static const bool ok = [] {
        unsigned a, b, c, d;
        if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
        if (!((d >> 24) & 1) || !((d >> 22) & 1)) return false;  // AMX-TILE, AMX-BF16
        // the kernel's permission for this process's threads to use tile data (Linux 5.16+)
        return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                       18 /* XFEATURE_XTILEDATA */) == 0;
    }();
    return ok;
}

// -1: not chosen yet (AMX where supported, unless ENGINE_CPU_AMX is 0, false, off or no);
// else 0 or 1
std::atomic<int> amx_mode{-1};

bool off(const char* value) {
    if (!value) return false;
    for (const char* word : {"0", "false", "off", "no"})
        if (strcasecmp(value, word) == 0) return true;
    return false;
}

bool use_amx() {
    int mode = amx_mode.load(std::memory_order_relaxed);
    if (mode < 0) {
        mode = amx_supported() && !off(std::getenv("ENGINE_CPU_AMX")) ? 1 : 0;
        int unset = -1;
        amx_mode.compare_exchange_strong(unset, mode);
        mode = amx_mode.load();
    }
    return mode == 1;
}

// each 32-bit lane: its high 16 bits (a value truncated to bf16, as fp32 bits)
inline __m512i high_half(__m512 v) {
    return _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32((int)0xFFFF0000u));
}

// rows [i0, i0 + rows) of x, block by block, as tiles: out [blocks][planes][16 rows][32
// bf16], rows [rows, fill) zero, and their sums per block: sums [blocks][16]
template <class F>
void pack_planes(const float* x, int64_t K, int64_t i0, int64_t rows, int64_t fill,
                 uint16_t* out, float* sums) {
    const int64_t blocks = K / kBlock;
    // bytes: the high halves of lanes 0-15 of a and then of b, in order (words 1, 3, ...)
    alignas(64) static const uint16_t odd[32] = {
        1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31,
        33, 35, 37, 39, 41, 43, 45, 47, 49, 51, 53, 55, 57, 59, 61, 63};
    const __m512i pick = _mm512_load_si512(odd);
    for (int64_t b = 0; b < blocks; ++b) {
        uint16_t* tile = out + b * kPlanes * kPlaneBytes / 2;
        for (int64_t i = 0; i < fill; ++i) {
            __m512 v0 = _mm512_setzero_ps(), v1 = _mm512_setzero_ps();
            if (i < rows) {
                v0 = _mm512_loadu_ps(x + (i0 + i) * K + b * kBlock);
                v1 = _mm512_loadu_ps(x + (i0 + i) * K + b * kBlock + 16);
            }
            sums[b * kAmxRows + i] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
            for (int64_t p = 0; p < kPlanes; ++p) {
                const __m512i h0 = high_half(v0), h1 = high_half(v1);
                const __m512i row = F::nibbles
                    ? _mm512_or_si512(_mm512_srli_epi32(h0, 16), h1)  // (x[j], x[j + 16])
                    : _mm512_permutex2var_epi16(h0, pick, h1);         // (x[2j], x[2j + 1])
                _mm512_store_si512(tile + p * kPlaneBytes / 2 + i * 32, row);
                v0 = _mm512_sub_ps(v0, _mm512_castsi512_ps(h0));  // exact: the bits below
                v1 = _mm512_sub_ps(v1, _mm512_castsi512_ps(h1));
            }
        }
    }
}

// block b of a panel as two tiles of B (outputs 0-15, 16-31): out [2][16 pairs][16 n] dwords
template <class F>
inline void expand_tiles(Panel w, int64_t b, uint32_t* out) {
    const uint8_t* q = w.q + b * F::block_bytes;
    for (int h = 0; h < 2; ++h) {
        for (int64_t j = 0; j < kBlock / 2; ++j) {
            __m512i row;
            if constexpr (F::nibbles) {
                // bf16 of 0..15, looked up by each word's nibble
                alignas(64) static const uint16_t bf16_of[32] = {
                    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
                    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
                const __m512i v = _mm512_cvtepu8_epi32(
                    _mm_loadu_si128((const __m128i*)(q + j * kPanel + h * 16)));
                // low nibble in the low word, high nibble in the high word: (v | v << 12) & mask
                const __m512i nib = _mm512_ternarylogic_epi32(
                    v, _mm512_slli_epi32(v, 12), _mm512_set1_epi32(0x000F000F), 0xA8);
                row = _mm512_permutexvar_epi16(nib, _mm512_load_si512(bf16_of));
            } else {
                const uint8_t* at = q + 2 * j * kPanel + h * 16;
                const __m512i f0 = _mm512_castps_si512(_mm512_cvtepi32_ps(
                    _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)at))));
                const __m512i f1 = _mm512_castps_si512(_mm512_cvtepi32_ps(
                    _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(at + kPanel)))));
                // (bf16 of q[2j], bf16 of q[2j + 1]): f0 >> 16 | (f1 & 0xFFFF0000), exact
                row = _mm512_ternarylogic_epi32(_mm512_srli_epi32(f0, 16), f1,
                                                _mm512_set1_epi32((int)0xFFFF0000u), 0xF8);
            }
            _mm512_store_si512(out + (h * kBlock / 2 + j) * 16, row);
        }
    }
}

// acc [rows][32] += block b's products c [16][32] (the first `rows`) scaled by its d, plus
// the rows' sums s [16] times its m (none for byte blocks); the first block starts acc
inline void scale_block(const float* c, const float* s, const float* d, const float* m,
                        bool first, int64_t rows, float* acc) {
    const __m512 d0 = _mm512_loadu_ps(d), d1 = _mm512_loadu_ps(d + 16);
    const __m512 m0 = m ? _mm512_loadu_ps(m) : _mm512_setzero_ps();
    const __m512 m1 = m ? _mm512_loadu_ps(m + 16) : _mm512_setzero_ps();
    for (int64_t i = 0; i < rows; ++i) {
        __m512 y0 = first ? _mm512_setzero_ps() : _mm512_load_ps(acc + i * kPanel);
        __m512 y1 = first ? _mm512_setzero_ps() : _mm512_load_ps(acc + i * kPanel + 16);
        y0 = _mm512_fmadd_ps(_mm512_load_ps(c + i * kPanel), d0, y0);
        y1 = _mm512_fmadd_ps(_mm512_load_ps(c + i * kPanel + 16), d1, y1);
        if (m) {
            const __m512 sv = _mm512_set1_ps(s[i]);
            y0 = _mm512_fmadd_ps(sv, m0, y0);
            y1 = _mm512_fmadd_ps(sv, m1, y1);
        }
        _mm512_store_ps(acc + i * kPanel, y0);
        _mm512_store_ps(acc + i * kPanel + 16, y1);
    }
}

// one panel against a group of tiles of packed x (tiles t0..t1 of xp, their sums), the sums of
// products kept in acc [tiles][16][32] between blocks, then stored to y. Software-pipelined
// through memory: weight tiles are built kRing - 1 blocks ahead of their tile products, and
// block b - 1's products are scaled into acc after block b's run (a tile load or store waits
// for the vector stores or loads of its buffer, which are then an iteration or more old).
template <class F>
void amx_panel(Panel w, int64_t blocks, const uint16_t* xp, const float* sums, int64_t t0,
               int64_t t1, int64_t M, float* y, int64_t N, int64_t cols, float* acc,
               float* c) {
    constexpr int64_t kTileWords = 2 * kBlock / 2 * 16, kTileFloats = kAmxRows * kPanel;
    alignas(64) uint32_t wt[kRing][kTileWords];
    const int64_t group = t1 - t0;
    auto rows_of = [&](int64_t t) { return M - t * kAmxRows < kAmxRows ? M - t * kAmxRows
                                                                       : kAmxRows; };
    auto scale = [&](int64_t b) {
        for (int64_t t = t0; t < t1; ++t)
            scale_block(c + ((b & 1) * group + t - t0) * kTileFloats,
                        sums + (t * blocks + b) * kAmxRows, w.d + b * kPanel,
                        w.m ? w.m + b * kPanel : nullptr, b == 0, rows_of(t),
                        acc + (t - t0) * kTileFloats);
    };
    for (int64_t b = 0; b < kRing - 1 && b < blocks; ++b) expand_tiles<F>(w, b, wt[b]);
    for (int64_t b = 0; b < blocks; ++b) {
        prefetch_block<F>(w, b);
        _tile_loadd(3, wt[b % kRing], 64);
        _tile_loadd(4, wt[b % kRing] + kTileWords / 2, 64);
        for (int64_t t = t0; t < t1; ++t) {
            const uint16_t* a = xp + (t * blocks + b) * kPlanes * kPlaneBytes / 2;
            float* out = c + ((b & 1) * group + t - t0) * kTileFloats;
            _tile_zero(5);
            _tile_zero(6);
            _tile_loadd(0, a, 64);
            _tile_loadd(1, a + kPlaneBytes / 2, 64);
            _tile_loadd(2, a + kPlaneBytes, 64);
            _tile_dpbf16ps(5, 0, 3);
            _tile_dpbf16ps(6, 0, 4);
            _tile_dpbf16ps(5, 1, 3);
            _tile_dpbf16ps(6, 1, 4);
            _tile_dpbf16ps(5, 2, 3);
            _tile_dpbf16ps(6, 2, 4);
            _tile_stored(5, out, kPanel * 4);
            _tile_stored(6, out + 16, kPanel * 4);
        }
        if (b + kRing - 1 < blocks)
            expand_tiles<F>(w, b + kRing - 1, wt[(b + kRing - 1) % kRing]);
        if (b > 0) scale(b - 1);
    }
    scale(blocks - 1);
    const __mmask16 lo = engine_cpu::tail_mask(cols), hi = engine_cpu::tail_mask(cols - 16);
    for (int64_t t = t0; t < t1; ++t) {
        const float* at = acc + (t - t0) * kTileFloats;
        for (int64_t i = 0; i < rows_of(t); ++i) {
            float* out = y + (t * kAmxRows + i) * N;
            _mm512_mask_storeu_ps(out, lo, _mm512_load_ps(at + i * kPanel));
            _mm512_mask_storeu_ps(out + 16, hi, _mm512_load_ps(at + i * kPanel + 16));
        }
    }
}

template <class F>
void amx_linear(const float* x, int64_t M, int64_t K, const uint8_t* q, const float* d,
                const float* m, int64_t N, float* y, int64_t threads) {
    const int64_t panels = (N + kPanel - 1) / kPanel, blocks = K / kBlock;
    const int64_t tiles = (M + kAmxRows - 1) / kAmxRows;
    // x packed: tile t's block b at xp + (t * blocks + b) * planes * 512; a pointer for the
    // same reason as packed_x's
    thread_local std::vector<uint16_t> packed;
    thread_local std::vector<float> summed;
    const int64_t words = tiles * blocks * kPlanes * kPlaneBytes / 2;
    if ((int64_t)packed.size() < words + 32) packed.resize(words + 32);
    if ((int64_t)summed.size() < tiles * blocks * kAmxRows)
        summed.resize(tiles * blocks * kAmxRows);
    uint16_t* const xp = reinterpret_cast<uint16_t*>(
        (reinterpret_cast<uintptr_t>(packed.data()) + 63) & ~uintptr_t{63});
    float* const sums = summed.data();
    TileConfig config = {};
    config.palette_id = 1;
    const uint8_t rows = M < kAmxRows ? (uint8_t)M : (uint8_t)kAmxRows;  // a lone tile: M rows
    for (int t = 0; t < 7; ++t) {
        config.colsb[t] = 64;
        config.rows[t] = t == 3 || t == 4 ? kBlock / 2 : rows;  // 3, 4: weights; 0-2, 5, 6: x, C
    }
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; ++t)
            pack_planes<F>(x, K, t * kAmxRows, M - t * kAmxRows, rows, xp + t * blocks *
                           kPlanes * kPlaneBytes / 2, sums + t * blocks * kAmxRows);
        _tile_loadconfig(&config);
        // acc, then the products of two blocks: [3][group tiles][16][32]
        float* acc = scratch(3 * kGroupTiles * kAmxRows * kPanel);
        float* products = acc + kGroupTiles * kAmxRows * kPanel;
        for (int64_t t0 = 0; t0 < tiles; t0 += kGroupTiles) {
            const int64_t t1 = t0 + kGroupTiles < tiles ? t0 + kGroupTiles : tiles;
#pragma omp for schedule(static)
            for (int64_t p = 0; p < panels; ++p) {
                const int64_t cols = N - p * kPanel < kPanel ? N - p * kPanel : kPanel;
                amx_panel<F>(panel<F>(q, d, m, K, p), blocks, xp, sums, t0, t1, M,
                             y + p * kPanel, N, cols, acc, products);
            }
        }
        _tile_release();
    }
}

#else  // built without the AMX path (a compiler without -mamx-tile / -mamx-bf16)
bool amx_supported() { return false; }
bool use_amx() { return false; }
template <class F>
void amx_linear(const float*, int64_t, int64_t, const uint8_t*, const float*, const float*,
                int64_t, float*, int64_t) {}
#endif

}  // namespace

// Whether blockq_linear runs on AMX tiles (1) or AVX-512 FMAs (0). want: -1 asks, 0 or 1
// chooses (1 only where the CPU and OS allow it). The first call settles the default: AMX
// where supported, unless the environment sets ENGINE_CPU_AMX=0. The two paths differ in the
// last bits, so a process should choose before it multiplies.
extern "C" int64_t blockq_amx(int64_t want) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (want == 0 || (want == 1 && amx_supported())) amx_mode.store((int)want);
#endif
    return use_amx() ? 1 : 0;
}

// A matrix is described by 6 int64 values: kind (0: nibble blocks, 1: byte blocks), the
// addresses of its quants, scales and offsets (0 for bytes), N and K (a multiple of 32); every
// array contiguous, in the layout above. threads: the caller's torch.get_num_threads() (an
// OpenMP thread count is per calling thread, and the engine may run in a thread of its own).
extern "C" void blockq_linear(const float* x, int64_t M, const int64_t* w, float* y,
                              int64_t threads) {
    if (M <= 0) return;  // nothing to multiply (a row count of 0 would pick the 8-row tile)
    if (w[5] == 0) {  // K = 0: every sum is empty
        std::memset(y, 0, sizeof(float) * M * w[4]);
        return;
    }
    const uint8_t* q = reinterpret_cast<const uint8_t*>(w[1]);
    const float* d = reinterpret_cast<const float*>(w[2]);
    const bool amx = use_amx();
    if (w[0] == 0 && amx)
        amx_linear<Nibbles>(x, M, w[5], q, d, reinterpret_cast<const float*>(w[3]), w[4], y,
                            threads);
    else if (amx)
        amx_linear<Bytes>(x, M, w[5], q, d, nullptr, w[4], y, threads);
    else if (w[0] == 0)
        linear<Nibbles>(x, M, w[5], q, d, reinterpret_cast<const float*>(w[3]), w[4], y,
                        threads);
    else
        linear<Bytes>(x, M, w[5], q, d, nullptr, w[4], y, threads);
}
