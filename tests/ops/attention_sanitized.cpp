// cpu_paged_attention under AddressSanitizer and UBSan (built and run by
// test_blockq_sanitized.py): random decode and tree-verify batches (head sizes 16, 64 and
// 128, 1-5 q heads per kv head, trees of up to 13 nodes, prefixes of 0-70 keys at scattered
// slots, 1-2 threads) against a float64 reference. Prints "fails N"; exits 1 if any.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "kernels.h"

int main() {
    std::mt19937 rng(2);
    int fails = 0;
    for (int trial = 0; trial < 200; ++trial) {
        const int64_t head_dims[3] = {16, 64, 128};
        const int64_t d = head_dims[rng() % 3], kv_heads = 1 + rng() % 3,
                      group = 1 + rng() % 5, heads = kv_heads * group, batch = 1 + rng() % 3;
        const bool tree = rng() % 4 != 0;
        std::vector<int32_t> qo_indptr{0}, kv_indptr{0}, prefix_lens, kv_indices;
        std::vector<int64_t> bits;
        const int64_t slots = 400;
        std::vector<int32_t> order(slots);
        for (int64_t s = 0; s < slots; ++s) order[s] = (int32_t)s;
        std::shuffle(order.begin(), order.end(), rng);
        int64_t used = 0;
        for (int64_t i = 0; i < batch; ++i) {
            const int64_t prefix = rng() % 71, nodes = tree ? 1 + rng() % 13 : 1;
            prefix_lens.push_back((int32_t)prefix);
            for (int64_t j = 0; j < prefix + nodes; ++j) kv_indices.push_back(order[used++]);
            kv_indptr.push_back((int32_t)kv_indices.size());
            std::vector<int64_t> own(nodes);
            for (int64_t n = 0; n < nodes; ++n) {  // a random tree: parent before child
                own[n] = (n ? own[rng() % n] : 0) | (int64_t{1} << n);
                bits.push_back(own[n]);
            }
            qo_indptr.push_back(qo_indptr.back() + (int32_t)nodes);
        }
        const int64_t tokens = qo_indptr.back(), q_stride = heads * d + 3;
        std::vector<float> q(tokens * q_stride), k(slots * kv_heads * d), v(k.size());
        std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
        for (auto& x : q) x = unit(rng);
        for (auto& x : k) x = unit(rng);
        for (auto& x : v) x = unit(rng);
        std::vector<float> out(tokens * heads * d + 1, 12345.0f);  // + a guard word
        const float scale = 1.0f / std::sqrt((float)d);
        cpu_paged_attention(q.data(), k.data(), v.data(), kv_indices.data(), kv_indptr.data(),
                            qo_indptr.data(), prefix_lens.data(), tree ? bits.data() : nullptr,
                            batch, tokens, heads, kv_heads, d, q_stride, scale, out.data(),
                            1 + rng() % 2);
        if (out[tokens * heads * d] != 12345.0f) {
            std::printf("trial %d wrote past out\n", trial);
            ++fails;
        }
        for (int64_t i = 0; i < batch; ++i)
            for (int64_t t = qo_indptr[i]; t < qo_indptr[i + 1]; ++t)
                for (int64_t h = 0; h < heads; ++h) {
                    const int64_t kvh = h / group, prefix = prefix_lens[i];
                    std::vector<double> s;
                    std::vector<int32_t> seen;
                    for (int64_t j = 0; j < kv_indptr[i + 1] - kv_indptr[i]; ++j) {
                        const bool visible = j < prefix || (tree ? (bits[t] >> (j - prefix)) & 1
                                                                 : j == prefix);
                        if (!visible) continue;
                        const int32_t slot = kv_indices[kv_indptr[i] + j];
                        double dot = 0;
                        for (int64_t e = 0; e < d; ++e)
                            dot += (double)q[t * q_stride + h * d + e]
                                   * k[(slot * kv_heads + kvh) * d + e];
                        s.push_back(dot * scale);
                        seen.push_back(slot);
                    }
                    double top = -1e300, total = 0;
                    for (double x : s) top = std::max(top, x);
                    for (double& x : s) total += (x = std::exp(x - top));
                    for (int64_t e = 0; e < d; ++e) {
                        double expected = 0;
                        for (size_t n = 0; n < s.size(); ++n)
                            expected += s[n] / total * v[(seen[n] * kv_heads + kvh) * d + e];
                        const float got = out[(t * heads + h) * d + e];
                        if (std::fabs(got - expected) > 1e-4) {
                            if (fails < 5)
                                std::printf("trial %d token %ld head %ld: %g against %g\n",
                                            trial, (long)t, (long)h, got, expected);
                            ++fails;
                        }
                    }
                }
    }
    std::printf("fails %d\n", fails);
    return fails ? 1 : 0;
}
