// One decoder layer of a decode or verify pass in a single call, for a layer whose four
// matrices are block weights: the same kernels, in the same order, as the per-op path
// (engine/ops/cpu.py), without ~10 Python round trips per layer.
//   normed, residual = rms_norm(hidden (+ residual))
//   qkv = normed @ W_qkv (+ qkv_bias); each q and k head rms-normed (q_norm, k_norm);
//     rotate q, k in place; store k, v at the tokens' slots
//   attn = paged attention of q over the pool
//   normed, residual = rms_norm(attn @ W_o + residual)
//   out = silu_mul(normed @ W_gate_up) @ W_down
// A matrix is described as blockq_linear takes it (engine/csrc/blockq.cpp): 6 int64 values.
// qkv_bias (Qwen2) and q_norm / k_norm (Qwen3) may be null: the layer has none.
#include <vector>

#include "kernels.h"

// The sizes come from the matrices: hidden width = W_qkv's K, qkv width = its N, inter =
// W_down's K. The scratch is this thread's, kept between calls.
extern "C" void cpu_decoder_layer(
        const float* hidden, const float* residual, int64_t tokens, const float* norm_in,
        float eps_in, const float* norm_post, float eps_post, const int64_t* weights,
        const float* cos, const float* sin, int64_t stride_cs, const int64_t* slots,
        float* k_cache, float* v_cache, const int32_t* kv_indices, const int32_t* kv_indptr,
        const int32_t* qo_indptr, const int32_t* prefix_lens, const int64_t* tree_bits,
        int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
        const float* qkv_bias, const float* q_norm, const float* k_norm, float eps_qk,
        float* out, float* residual_out, int64_t threads) {
    const int64_t width = weights[5], qkv_width = weights[4], inter = weights[18 + 5];
    thread_local std::vector<float> scratch;
    scratch.resize(tokens * (qkv_width + num_heads * head_dim + width + 3 * inter));
    float* workspace = scratch.data();
    float* qkv = workspace;
    float* attn = qkv + tokens * qkv_width;
    float* normed = attn + tokens * num_heads * head_dim;
    float* gate_up = normed + tokens * width;
    float* act = gate_up + tokens * 2 * inter;
    cpu_rms_norm(hidden, residual, norm_in, tokens, width, eps_in, normed,
                 residual ? residual_out : nullptr, threads);
    if (residual == nullptr)  // the first layer: the stream starts from hidden
        for (int64_t e = 0; e < tokens * width; ++e) residual_out[e] = hidden[e];
    blockq_linear(normed, tokens, weights, qkv, threads);
    if (qkv_bias != nullptr)
        for (int64_t t = 0; t < tokens; ++t)
            for (int64_t e = 0; e < qkv_width; ++e) qkv[t * qkv_width + e] += qkv_bias[e];
    if (q_norm != nullptr && k_norm != nullptr)  // in place: a row is read before it is written
        for (int64_t t = 0; t < tokens; ++t) {
            float* q = qkv + t * qkv_width;
            float* k = q + num_heads * head_dim;
            cpu_rms_norm(q, nullptr, q_norm, num_heads, head_dim, eps_qk, q, nullptr, threads);
            cpu_rms_norm(k, nullptr, k_norm, num_kv_heads, head_dim, eps_qk, k, nullptr, threads);
        }
    cpu_rope_qkv_store(qkv, qkv_width, cos, sin, stride_cs, slots, k_cache, v_cache, tokens,
                       num_heads, num_kv_heads, head_dim, threads);
    cpu_paged_attention(qkv, k_cache, v_cache, kv_indices, kv_indptr, qo_indptr, prefix_lens,
                        tree_bits, batch, tokens, num_heads, num_kv_heads, head_dim, qkv_width,
                        scale, attn, threads);
    blockq_linear(attn, tokens, weights + 6, out, threads);  // out: o_proj's output for now
    cpu_rms_norm(out, residual_out, norm_post, tokens, width, eps_post, normed, residual_out,
                 threads);
    blockq_linear(normed, tokens, weights + 12, gate_up, threads);
    cpu_silu_mul(gate_up, tokens, inter, act, threads);
    blockq_linear(act, tokens, weights + 18, out, threads);
}
