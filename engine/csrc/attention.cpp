// Attention of a few new tokens per request over the paged K/V pool, in fp32 on the CPU
// (q [T, Hq, D] with token stride q_stride, heads contiguous; out [T, Hq, D] contiguous):
// decode (one token) and tree verify (a draft tree), reading each key and value where it lies
// in the pool (no gather). Token t of request i (new tokens qo_indptr[i]..qo_indptr[i+1]) sees
// key j of its row (slots kv_indices[kv_indptr[i] + j]) when
//   causal (tree_bits == nullptr): j <= prefix_lens[i] + (t - qo_indptr[i]);
//   tree: j < prefix_lens[i], or bit (j - prefix_lens[i]) of tree_bits[t] is set.
// Scores, softmax and the weighted sum are fp32; exp is a vector polynomial (simd.h).
// Head sizes 64 and 128 take a register-blocked path; others a generic one.
// Work is split over (token, kv head) pairs with OpenMP; q heads h = kv * G + g share K/V.
// A tree verify with head size 64 or 128 instead takes a request's tokens together per kv
// head, up to 16 queries (tokens x heads) per task (tree_chunk): 13 tree tokens over 600
// keys were 1.5x faster, over 2000 keys 1.9x (one-off, 1 thread).
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "simd.h"

namespace {

using engine_cpu::exp512;
using engine_cpu::tail_mask;

// scores[0..n) -> exp(scores - max) in place; returns 1 / their sum (0 for no keys)
inline float softmax_unnormalised(float* scores, int64_t n) {
    float top = -INFINITY;
    for (int64_t j = 0; j < n; ++j) top = scores[j] > top ? scores[j] : top;
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 m = tail_mask(n - j);
        const __m512 e = _mm512_maskz_mov_ps(m, exp512(_mm512_sub_ps(
            _mm512_maskz_loadu_ps(m, scores + j), _mm512_set1_ps(top))));
        _mm512_mask_storeu_ps(scores + j, m, e);
        total = _mm512_add_ps(total, e);
    }
    return n ? 1.0f / _mm512_reduce_add_ps(total) : 0.0f;
}

// The pool's layout, in one place: the row of `slot` and kv head `kvh` in a cache
// [slots][num_kv_heads][d]
inline const float* slot_row(const float* cache, int32_t slot, int64_t num_kv_heads,
                             int64_t kvh, int64_t d) {
    return cache + ((int64_t)slot * num_kv_heads + kvh) * d;
}

// a row of 16 * C floats: asked for into L1, or loaded into registers
template <int C>
inline void prefetch_row(const float* row) {
    for (int c = 0; c < C; ++c) engine_cpu::prefetch(row + 16 * c);
}

template <int C>
inline void load_row(const float* row, __m512 (&v)[C]) {
    for (int c = 0; c < C; ++c) v[c] = _mm512_loadu_ps(row + 16 * c);
}

// K/V rows sit at scattered slots, mostly outside the caches: the kernels fetch this many
// keys ahead
constexpr int64_t kAhead = 8;

inline float dot(const float* a, const float* b, int64_t d) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t e = 0; e < d; e += 16) {
        const __mmask16 m = tail_mask(d - e);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + e), _mm512_maskz_loadu_ps(m, b + e),
                              acc);
    }
    return _mm512_reduce_add_ps(acc);
}


// The same for one (token, kv head) with head_dim = 16 * C and at most kMaxGroup q heads per
// kv head: q in registers, each key and value row loaded once for all G heads, and G * C
// independent accumulators (the generic loop below is latency-bound on one chain).
constexpr int kMaxGroup = 8;

template <int C>
void task_fast(const float* q, const float* k_cache, const float* v_cache,
               const int32_t* keys, int64_t n, int64_t group, int64_t num_kv_heads,
               int64_t kvh, float scale, float* scores, float* out) {
    constexpr int64_t d = 16 * C;
    __m512 qv[kMaxGroup][C];
    for (int64_t g = 0; g < group; ++g) load_row<C>(q + g * d, qv[g]);
    for (int64_t j = 0; j < n && j < kAhead; ++j)
        prefetch_row<C>(slot_row(k_cache, keys[j], num_kv_heads, kvh, d));
    for (int64_t j = 0; j < n; ++j) {
        if (j + kAhead < n) {
            prefetch_row<C>(slot_row(k_cache, keys[j + kAhead], num_kv_heads, kvh, d));
            prefetch_row<C>(slot_row(v_cache, keys[j], num_kv_heads, kvh, d));
        }
        __m512 kv[C];
        load_row<C>(slot_row(k_cache, keys[j], num_kv_heads, kvh, d), kv);
        for (int64_t g = 0; g < group; ++g) {
            __m512 s = _mm512_mul_ps(qv[g][0], kv[0]);
            for (int c = 1; c < C; ++c) s = _mm512_fmadd_ps(qv[g][c], kv[c], s);
            scores[g * n + j] = _mm512_reduce_add_ps(s) * scale;
        }
    }
    float inv[kMaxGroup];
    for (int64_t g = 0; g < group; ++g) inv[g] = softmax_unnormalised(scores + g * n, n);
    __m512 acc[kMaxGroup][C];
    for (int64_t g = 0; g < group; ++g)
        for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
        __m512 vv[C];
        load_row<C>(slot_row(v_cache, keys[j], num_kv_heads, kvh, d), vv);
        for (int64_t g = 0; g < group; ++g) {
            const __m512 p = _mm512_set1_ps(scores[g * n + j]);
            for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);
        }
    }
    for (int64_t g = 0; g < group; ++g)
        for (int c = 0; c < C; ++c)
            _mm512_storeu_ps(out + g * d + 16 * c,
                             _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv[g])));
}

// A tree verify's tokens [t0, t0 + count) of one request against one kv head, count * group
// <= kTreeQueries queries (u = t * group + g): each K row is loaded once for all of them
// (each V row once per few queries, as many as the accumulators' registers hold), and the
// queries' scores at a key come from one transposed sum (sum16) instead of one horizontal
// sum each. Softmax runs across the queries at once, one key at a time. Per token, keys
// [0, min(prefix, len)) are visible, and key prefix + m where bit m of its tree_bits is set
// (m < kMaxTreeNodes: keys past prefix + kMaxTreeNodes are visible to none, and skipped).
// work: this thread's scratch (kTreeQueries * d queries, then len * kTreeQueries scores;
// every score is written before it is read).
// a token's tree_bits is an int64 bit set over its tree's nodes, the sign bit unused (hence
// engine/state/batch.py's MAX_TREE_NODES)
constexpr int64_t kMaxTreeNodes = 8 * sizeof(int64_t) - 1;
constexpr int64_t kTreeQueries = 16;  // one lane of a vector, of an __mmask16, of sum16 each
template <int C>
void tree_chunk(const float* q, int64_t q_stride, const float* k_cache, const float* v_cache,
                const int32_t* keys, int64_t len, int64_t prefix, const int64_t* bits,
                int64_t count, int64_t group, int64_t num_heads, int64_t num_kv_heads,
                int64_t kvh, float scale, float* out, std::vector<float>& work) {
    constexpr int64_t d = 16 * C, Q = kTreeQueries;
    len = std::min(len, prefix + kMaxTreeNodes);  // no tree bit reaches past the last node
    const int64_t queries = count * group;
    work.resize(Q * d + len * Q);
    float* qs = work.data();
    float* scores = qs + Q * d;  // [len][Q]
    for (int64_t u = 0; u < queries; ++u)
        std::copy_n(q + (u / group) * q_stride + (kvh * group + u % group) * d, d, qs + u * d);
    for (int64_t j = 0; j < len; ++j) {
        if (j + kAhead < len)
            prefetch_row<C>(slot_row(k_cache, keys[j + kAhead], num_kv_heads, kvh, d));
        __m512 kv[C];
        load_row<C>(slot_row(k_cache, keys[j], num_kv_heads, kvh, d), kv);
        __m512 acc[Q];
        for (int u = 0; u < Q; ++u) {
            if (u >= queries) {  // lanes no query uses (a short chunk): sum zeros
                acc[u] = _mm512_setzero_ps();
                continue;
            }
            acc[u] = _mm512_mul_ps(_mm512_loadu_ps(qs + u * d), kv[0]);
            for (int c = 1; c < C; ++c)
                acc[u] = _mm512_fmadd_ps(_mm512_loadu_ps(qs + u * d + 16 * c), kv[c], acc[u]);
        }
        _mm512_storeu_ps(scores + j * Q,
                         _mm512_mul_ps(engine_cpu::sum16(acc), _mm512_set1_ps(scale)));
    }
    // the tree's keys: visible to a token only if they are its ancestors (or itself)
    __mmask16 seen[kMaxTreeNodes];  // per tree key: the queries that see it
    const int64_t tree = len > prefix ? len - prefix : 0;
    for (int64_t m = 0; m < tree; ++m) {
        seen[m] = 0;
        for (int64_t u = 0; u < queries; ++u)
            if ((bits[u / group] >> m) & 1) seen[m] |= (__mmask16)(1u << u);
    }
    auto visible = [&](int64_t j) -> __mmask16 {
        return j < prefix ? (__mmask16)0xFFFF : seen[j - prefix];
    };
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < len; ++j)
        top = _mm512_mask_max_ps(top, visible(j), top, _mm512_loadu_ps(scores + j * Q));
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < len; ++j) {
        const __m512 e = _mm512_maskz_mov_ps(
            visible(j), exp512(_mm512_sub_ps(_mm512_loadu_ps(scores + j * Q), top)));
        _mm512_storeu_ps(scores + j * Q, e);
        total = _mm512_add_ps(total, e);
    }
    alignas(64) float inv[Q];  // 0 for a query that sees no key
    _mm512_store_ps(inv, _mm512_maskz_div_ps(
        _mm512_cmp_ps_mask(total, _mm512_setzero_ps(), _CMP_GT_OQ), _mm512_set1_ps(1.0f),
        total));
    // the weighted sum of V, a few queries at a time (their accumulators fill the registers)
    constexpr int64_t R = C == 4 ? 6 : 3;
    for (int64_t u0 = 0; u0 < queries; u0 += R) {
        __m512 sums[R][C];
        for (int r = 0; r < R; ++r)
            for (int c = 0; c < C; ++c) sums[r][c] = _mm512_setzero_ps();
        for (int64_t j = 0; j < len; ++j) {
            __m512 vv[C];
            load_row<C>(slot_row(v_cache, keys[j], num_kv_heads, kvh, d), vv);
            for (int r = 0; r < R; ++r) {  // (lanes past the last: read, never stored)
                const __m512 p = _mm512_set1_ps(scores[j * Q + std::min(u0 + r, Q - 1)]);
                for (int c = 0; c < C; ++c) sums[r][c] = _mm512_fmadd_ps(p, vv[c], sums[r][c]);
            }
        }
        for (int64_t r = 0; r < R && u0 + r < queries; ++r) {
            const int64_t u = u0 + r;
            float* o = out + (u / group) * num_heads * d + (kvh * group + u % group) * d;
            for (int c = 0; c < C; ++c)
                _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(sums[r][c], _mm512_set1_ps(inv[u])));
        }
    }
}

}  // namespace

extern "C" void cpu_paged_attention(
        const float* q, const float* k_cache, const float* v_cache, const int32_t* kv_indices,
        const int32_t* kv_indptr, const int32_t* qo_indptr, const int32_t* prefix_lens,
        const int64_t* tree_bits, int64_t batch, int64_t num_tokens, int64_t num_heads,
        int64_t num_kv_heads, int64_t head_dim, int64_t q_stride, float scale, float* out,
        int64_t threads) {
    const int64_t group = num_heads / num_kv_heads, d = head_dim;
    if (tree_bits != nullptr && group <= kTreeQueries && (d == 64 || d == 128)) {
        // verify: tasks of (request, chunk of its tokens, kv head), kTreeQueries a chunk at most
        const int64_t per_chunk = kTreeQueries / group;
        std::vector<std::pair<int64_t, int64_t>> chunk_of;  // (first token, request)
        for (int64_t i = 0; i < batch; ++i)
            for (int64_t t = qo_indptr[i]; t < qo_indptr[i + 1]; t += per_chunk)
                chunk_of.emplace_back(t, i);
        const int64_t chunks = (int64_t)chunk_of.size();
        const auto chunk = d == 64 ? tree_chunk<4> : tree_chunk<8>;
#pragma omp parallel num_threads(threads)
        {
            std::vector<float> work;
#pragma omp for schedule(dynamic, 1)
            for (int64_t task = 0; task < chunks * num_kv_heads; ++task) {
                const auto [t0, i] = chunk_of[task / num_kv_heads];
                const int64_t kvh = task % num_kv_heads;
                const int64_t count = std::min(per_chunk, (int64_t)qo_indptr[i + 1] - t0);
                const int64_t len = kv_indptr[i + 1] - kv_indptr[i];
                const int32_t* keys = kv_indices + kv_indptr[i];
                chunk(q + t0 * q_stride, q_stride, k_cache, v_cache, keys, len, prefix_lens[i],
                      tree_bits + t0, count, group, num_heads, num_kv_heads, kvh, scale,
                      out + t0 * num_heads * d, work);
            }
        }
        return;
    }
    std::vector<int64_t> owner(num_tokens, 0);
    for (int64_t i = 0; i < batch; ++i)
        for (int64_t t = qo_indptr[i]; t < qo_indptr[i + 1]; ++t) owner[t] = i;
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> scores;
        std::vector<int32_t> tree_keys;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_tokens * num_kv_heads; ++task) {
            const int64_t t = task / num_kv_heads, kvh = task % num_kv_heads, i = owner[t];
            const int64_t prefix = prefix_lens[i], first = kv_indptr[i];
            const int64_t len = kv_indptr[i + 1] - first;
            // the slots this token sees: causal, a prefix of its row, read in place; in a
            // tree, the row's prefix and the token's ancestors, gathered
            const int32_t* keys = kv_indices + first;
            int64_t n = std::min(len, prefix + (t - qo_indptr[i]) + 1);
            if (tree_bits != nullptr) {
                tree_keys.assign(keys, keys + std::min(prefix, len));
                for (int64_t j = prefix; j < std::min(len, prefix + kMaxTreeNodes); ++j)
                    if ((tree_bits[t] >> (j - prefix)) & 1) tree_keys.push_back(keys[j]);
                keys = tree_keys.data();
                n = (int64_t)tree_keys.size();
            }
            scores.resize(n * group);
            const int64_t head0 = kvh * group * d;  // within the token's q row and out row
            const float* qt = q + t * q_stride;
            float* ot = out + t * num_heads * d;
            if (group <= kMaxGroup && d == 64) {
                task_fast<4>(qt + head0, k_cache, v_cache, keys, n, group, num_kv_heads,
                             kvh, scale, scores.data(), ot + head0);
                continue;
            }
            if (group <= kMaxGroup && d == 128) {
                task_fast<8>(qt + head0, k_cache, v_cache, keys, n, group, num_kv_heads,
                             kvh, scale, scores.data(), ot + head0);
                continue;
            }
            for (int64_t g = 0; g < group; ++g) {  // any head size and group: one chain
                const int64_t h = kvh * group + g;
                const float* qh = qt + h * d;
                float* oh = ot + h * d;
                for (int64_t j = 0; j < n; ++j)
                    scores[j] = dot(qh, slot_row(k_cache, keys[j], num_kv_heads, kvh, d), d)
                                * scale;
                const float inv = softmax_unnormalised(scores.data(), n);
                for (int64_t e = 0; e < d; e += 16) {
                    const __mmask16 m = tail_mask(d - e);
                    __m512 acc = _mm512_setzero_ps();
                    for (int64_t j = 0; j < n; ++j)
                        acc = _mm512_fmadd_ps(
                            _mm512_set1_ps(scores[j]),
                            _mm512_maskz_loadu_ps(
                                m, slot_row(v_cache, keys[j], num_kv_heads, kvh, d) + e),
                            acc);
                    _mm512_mask_storeu_ps(oh + e, m, _mm512_mul_ps(acc, _mm512_set1_ps(inv)));
                }
            }
        }
    }
}
