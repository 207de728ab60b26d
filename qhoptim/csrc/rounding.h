// qhoptim.rounding's stochastic rounding to bfloat16, in C++: the same bits
// as qhoptim/rounding.py, for the CPU kernels of the torch, MLX and optax
// backends (qhoptim/torch/csrc, qhoptim/mlx/csrc, qhoptim/optax/csrc), which
// include it. Their vectorized forms of the hash are written beside their
// loops and tested against these.

#pragma once

#include <cstdint>
#include <cstring>

namespace qhoptim::rounding {

// An element's flat position spread by this odd constant (2**32 / golden
// ratio) is the hash's key: key = position * kGolden (mod 2**32), so that a
// loop advances it by one addition per element (POSITION_MULTIPLIER).
constexpr uint32_t kGolden = 0x9E3779B9u;

// lowbias32 (mix32) of key ^ seed; its low 16 bits are the element's noise
// (noise16).
inline uint32_t hash32_of_key(uint32_t seed, uint32_t key) {
  uint32_t x = key ^ seed;
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// The bits of the bfloat16 that `value` rounds to under `seed` at `key`
// (bfloat16_bits): the float32's low half plus 16 random bits carries into
// the kept half exactly as often as the low half is large, which makes the
// rounding unbiased.
inline uint16_t bfloat16_bits(float value, uint32_t seed, uint32_t key) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return static_cast<uint16_t>((bits + (hash32_of_key(seed, key) & 0xFFFFu)) >> 16);
}

}  // namespace qhoptim::rounding
