// The CPU kernels' C entry points (each file's header comment says what it computes), for the
// kernels that call others: layer.cpp.
#pragma once

#include <stdint.h>

extern "C" {
void blockq_linear(const float* x, int64_t M, const int64_t* w, float* y, int64_t threads);
int64_t blockq_amx(int64_t want);
void cpu_paged_attention(const float* q, const float* k_cache, const float* v_cache,
                         const int32_t* kv_indices, const int32_t* kv_indptr,
                         const int32_t* qo_indptr, const int32_t* prefix_lens,
                         const int64_t* tree_bits, int64_t batch, int64_t num_tokens,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         int64_t q_stride, float scale, float* out, int64_t threads);
void cpu_rms_norm(const float* x, const float* residual, const float* weight, int64_t rows,
                  int64_t width, float eps, float* out, float* residual_out, int64_t threads);
void cpu_rope_qkv_store(float* qkv, int64_t stride_t, const float* cos, const float* sin,
                        int64_t stride_cs, const int64_t* slots, float* k_cache,
                        float* v_cache, int64_t tokens, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, int64_t threads);
void cpu_silu_mul(const float* gate_up, int64_t rows, int64_t inter, float* out,
                  int64_t threads);
}
