// blockq_linear under AddressSanitizer and UBSan (built and run by test_blockq_sanitized.py):
// random shapes (N not a multiple of the 32-row panel, K of 0-6 blocks, 0-39 rows of x and
// some of 120-159, both formats, 1-2 threads), on the FMA path and then on AMX tiles where the
// CPU has them, against a float64 product of the same weights read from the panel layout,
// with a guard word after y. The test force-includes tile_check.h into blockq.cpp, so every
// tile load and store is checked too. Prints "amx 0|1", the tile accesses checked and
// "fails N"; exits 1 if any.
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "kernels.h"

extern "C" long engine_tiles_checked_count() __attribute__((weak));  // tile_check.h

int main() {
    std::mt19937 rng(1);
    int fails = 0;
    for (int trial = 0; trial < 400; ++trial) {
        // both paths where the CPU has AMX tiles (else the FMA path twice)
        if (trial == 0) blockq_amx(0);
        if (trial == 200) std::printf("amx %ld\n", (long)blockq_amx(1));
        const int64_t N = 1 + rng() % 80, K = 32 * (rng() % 7);
        const int64_t M = trial % 8 == 7 ? 120 + rng() % 40 : rng() % 40;  // past a tile group
        const bool nibbles = rng() & 1;
        const int64_t panels = (N + 31) / 32, blocks = K / 32;
        const int64_t block_bytes = nibbles ? 16 * 32 : 32 * 32;
        std::vector<uint8_t> q(panels * blocks * block_bytes);
        for (auto& v : q) v = rng();
        std::vector<float> d(panels * blocks * 32), m(panels * blocks * 32);
        for (auto& v : d) v = (rng() % 1000) / 65536.0f;
        for (auto& v : m) v = -((rng() % 1000) / 8192.0f);
        std::vector<float> x(M * K);
        for (auto& v : x) v = (int(rng() % 2001) - 1000) / 1000.0f;
        std::vector<float> y(M * N + 1, 12345.0f);  // + a guard word
        const int64_t w[6] = {nibbles ? 0 : 1, (int64_t)q.data(), (int64_t)d.data(),
                              nibbles ? (int64_t)m.data() : 0, N, K};
        blockq_linear(x.data(), M, w, y.data(), 1 + rng() % 2);
        if (y[M * N] != 12345.0f) {
            std::printf("trial %d wrote past y\n", trial);
            ++fails;
        }
        for (int64_t i = 0; i < M; ++i)
            for (int64_t n = 0; n < N; ++n) {
                const int64_t p = n / 32, c = n % 32;
                double expected = 0;
                for (int64_t k = 0; k < K; ++k) {
                    const int64_t b = k / 32, e = k % 32, at = (p * blocks + b) * 32 + c;
                    double weight;
                    if (nibbles) {
                        const uint8_t byte = q[(p * blocks + b) * block_bytes + e % 16 * 32 + c];
                        weight = (double)d[at] * (e < 16 ? byte & 15 : byte >> 4) + m[at];
                    } else {
                        weight = (double)d[at] * (int8_t)q[(p * blocks + b) * block_bytes
                                                          + e * 32 + c];
                    }
                    expected += weight * x[i * K + k];
                }
                if (std::fabs(expected - y[i * N + n]) > 1e-4 * (1 + std::fabs(expected))) {
                    if (fails < 5)
                        std::printf("trial %d (M %ld N %ld K %ld): %g against %g\n", trial,
                                    (long)M, (long)N, (long)K, y[i * N + n], expected);
                    ++fails;
                }
            }
    }
    if (engine_tiles_checked_count)
        std::printf("tile accesses checked %ld\n", engine_tiles_checked_count());
    std::printf("fails %d\n", fails);
    return fails ? 1 : 0;
}
