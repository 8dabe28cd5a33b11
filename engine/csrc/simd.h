// Small AVX-512 helpers shared by the CPU kernels.
#pragma once

#include <immintrin.h>
#include <stdint.h>

namespace engine_cpu {

// Ask for the cache line at p (into L1). Not _mm_prefetch: GCC 12 at -O2 dropped every
// _mm_prefetch of a kernel's block loop as dead code (its asm had no prefetch instruction at
// all); a volatile asm cannot be dropped.
inline void prefetch(const void* p) { asm volatile("prefetcht0 %0" : : "m"(*(const char*)p)); }

// lanes [0, remaining) of a 16-lane vector (none for remaining <= 0)
inline __mmask16 tail_mask(int64_t remaining) {
    return remaining >= 16 ? (__mmask16)0xFFFF
           : remaining <= 0 ? (__mmask16)0 : (__mmask16)((1u << remaining) - 1);
}

// exp(x) within a few ulp: 2^n * p(r), n = round(x / ln2), |r| <= ln2 / 2, p of degree 6
inline __m512 exp512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

// lane j of the result = the sum of the 16 lanes of v[j] (for 16 accumulators at once: ~45
// shuffles and adds, against ~9 each for a per-vector reduction)
inline __m512 sum16(const __m512* v) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i)  // per 128-bit lane: the lane's sums of v[4i .. 4i+3]
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
    const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88),
                                    _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88),
                                    _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}

}  // namespace engine_cpu
