// A decoder layer's elementwise work in fp32 on the CPU, one call each (the torch ops they
// replace cost ~5-10 us apiece in dispatch alone, ~40 of them per layer):
//   rms_norm: out = weight * (r * 1/sqrt(mean(r^2) + eps)), r = x (+ residual, also written);
//   rope_qkv_store: q and k heads of qkv rotated in place (rotate-half layout), then the rotated
//     k and the v of token t written to the caches at slots[t];
//   silu_mul: out = silu(gate) * up from gate_up [T, 2 * inter].
// Products and sums are rounded as the torch reference rounds them (built with
// -ffp-contract=off, so a*b + c*d is never fused). Rows are split over `threads` OpenMP
// threads only when there are enough of them to pay for it.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include <cmath>
#include <cstring>

#include "simd.h"

namespace {

using engine_cpu::exp512;
using engine_cpu::tail_mask;

constexpr int64_t kParallelElements = 1 << 15;  // below this, one thread does the whole op

}  // namespace

extern "C" {

void cpu_rms_norm(const float* x, const float* residual, const float* weight, int64_t rows,
                  int64_t width, float eps, float* out, float* residual_out, int64_t threads) {
#pragma omp parallel for if (rows * width >= kParallelElements) num_threads(threads)
    for (int64_t t = 0; t < rows; ++t) {
        const float* xt = x + t * width;
        const float* src = xt;
        if (residual != nullptr) {
            float* rt = residual_out + t * width;
            for (int64_t e = 0; e < width; e += 16) {
                const __mmask16 m = tail_mask(width - e);
                _mm512_mask_storeu_ps(rt + e, m, _mm512_add_ps(
                    _mm512_maskz_loadu_ps(m, xt + e),
                    _mm512_maskz_loadu_ps(m, residual + t * width + e)));
            }
            src = rt;
        }
        __m512 squares = _mm512_setzero_ps();
        for (int64_t e = 0; e < width; e += 16) {
            const __m512 v = _mm512_maskz_loadu_ps(tail_mask(width - e), src + e);
            squares = _mm512_add_ps(squares, _mm512_mul_ps(v, v));
        }
        const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(squares) / (float)width + eps);
        const __m512 vinv = _mm512_set1_ps(inv);
        for (int64_t e = 0; e < width; e += 16) {
            const __mmask16 m = tail_mask(width - e);
            _mm512_mask_storeu_ps(out + t * width + e, m, _mm512_mul_ps(
                _mm512_maskz_loadu_ps(m, weight + e),
                _mm512_mul_ps(_mm512_maskz_loadu_ps(m, src + e), vinv)));
        }
    }
}

void cpu_rope_qkv_store(float* qkv, int64_t stride_t, const float* cos, const float* sin,
                        int64_t stride_cs, const int64_t* slots, float* k_cache,
                        float* v_cache, int64_t tokens, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, int64_t threads) {
    const int64_t half = head_dim / 2, rotated = num_heads + num_kv_heads;
#pragma omp parallel for num_threads(threads) \
    if (tokens * (rotated + num_kv_heads) * head_dim >= kParallelElements)
    for (int64_t t = 0; t < tokens; ++t) {
        float* row = qkv + t * stride_t;
        const float* c = cos + t * stride_cs;
        const float* s = sin + t * stride_cs;
        for (int64_t h = 0; h < rotated; ++h) {
            float* first = row + h * head_dim;
            float* second = first + half;
            for (int64_t e = 0; e < half; e += 16) {
                const __mmask16 m = tail_mask(half - e);
                const __m512 a = _mm512_maskz_loadu_ps(m, first + e);
                const __m512 b = _mm512_maskz_loadu_ps(m, second + e);
                const __m512 vc = _mm512_maskz_loadu_ps(m, c + e);
                const __m512 vs = _mm512_maskz_loadu_ps(m, s + e);
                _mm512_mask_storeu_ps(first + e, m,
                                      _mm512_sub_ps(_mm512_mul_ps(a, vc), _mm512_mul_ps(b, vs)));
                _mm512_mask_storeu_ps(second + e, m,
                                      _mm512_add_ps(_mm512_mul_ps(b, vc), _mm512_mul_ps(a, vs)));
            }
        }
        const int64_t width = num_kv_heads * head_dim, slot = slots[t];
        const float* k = row + num_heads * head_dim;
        const float* v = k + width;
        std::memcpy(k_cache + slot * width, k, width * sizeof(float));
        std::memcpy(v_cache + slot * width, v, width * sizeof(float));
    }
}

void cpu_silu_mul(const float* gate_up, int64_t rows, int64_t inter, float* out,
                  int64_t threads) {
#pragma omp parallel for if (rows * inter >= kParallelElements) num_threads(threads)
    for (int64_t t = 0; t < rows; ++t) {
        const float* g = gate_up + t * 2 * inter;
        const float* u = g + inter;
        for (int64_t e = 0; e < inter; e += 16) {
            const __mmask16 m = tail_mask(inter - e);
            const __m512 vg = _mm512_maskz_loadu_ps(m, g + e);
            const __m512 denominator = _mm512_add_ps(
                _mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), vg)));
            _mm512_mask_storeu_ps(out + t * inter + e, m, _mm512_mul_ps(
                _mm512_div_ps(vg, denominator), _mm512_maskz_loadu_ps(m, u + e)));
        }
    }
}

}  // extern "C"
