// Force-included into blockq.cpp (`-include`) by test_blockq_sanitized.py. AddressSanitizer
// does not see AMX tile loads and stores, so each one is checked here first, row by row,
// against ASan's shadow memory, with the rows and bytes per row of the calling thread's tile
// configuration. An access to poisoned memory (outside an allocation) aborts with its place.
#pragma once

#include <immintrin.h>
#include <sanitizer/asan_interface.h>
#include <stdint.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>

struct EngineTileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};
inline thread_local EngineTileConfig engine_tile_config;
inline std::atomic<long> engine_tiles_checked{0};

inline void engine_check_tile(int tile, const void* base, long stride, const char* what) {
    const EngineTileConfig& config = engine_tile_config;
    if (config.rows[tile] == 0 || config.colsb[tile] == 0) {
        std::fprintf(stderr, "tile %d used unconfigured (%s)\n", tile, what);
        std::abort();
    }
    for (int row = 0; row < config.rows[tile]; ++row) {
        const char* at = static_cast<const char*>(base) + (long)row * stride;
        if (void* bad = __asan_region_is_poisoned(const_cast<char*>(at), config.colsb[tile])) {
            std::fprintf(stderr, "tile %s of tile %d, row %d of %d (%d bytes, stride %ld): "
                         "poisoned at %p\n", what, tile, row, config.rows[tile],
                         config.colsb[tile], stride, bad);
            std::abort();
        }
    }
    engine_tiles_checked.fetch_add(1, std::memory_order_relaxed);
}

inline void engine_checked_loadconfig(const void* config) {
    std::memcpy(&engine_tile_config, config, sizeof(EngineTileConfig));
    _tile_loadconfig(config);
}

extern "C" long engine_tiles_checked_count() { return engine_tiles_checked.load(); }

// a tile load or store (`access`: GCC's own), its memory checked first
#define ENGINE_CHECKED(access, what, tile, base, stride)                 \
    do {                                                                 \
        engine_check_tile(tile, (base), (stride), what);                 \
        access(tile, base, stride);                                      \
    } while (0)
#undef _tile_loadd
#define _tile_loadd(tile, base, stride) \
    ENGINE_CHECKED(_tile_loadd_internal, "load", tile, base, stride)
#undef _tile_stored
#define _tile_stored(tile, base, stride) \
    ENGINE_CHECKED(_tile_stored_internal, "store", tile, base, stride)
#define _tile_loadconfig(config) engine_checked_loadconfig(config)
