// Configuring AMX's eight tile registers, for the bf16 and the quantized kernels alike.
#pragma once
#include <cstdint>

#include <immintrin.h>

// LDTILECFG's 64-byte operand (palette 1): each tile's rows and bytes per row.
struct TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  TileConfig& tile(int t, int tile_rows, int bytes_per_row) {
    rows[t] = static_cast<uint8_t>(tile_rows);
    colsb[t] = static_cast<uint16_t>(bytes_per_row);
    return *this;
  }

  void load() const {
    // GCC 12 may not count LDTILECFG as reading the whole struct and drop some of its
    // stores (an invalid configuration then faults); the barrier keeps them
    asm volatile("" : : "r"(this) : "memory");
    _tile_loadconfig(this);
  }
};
