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

// An element's position as the hash reads it: itself below 2**32, folded to
// 32 bits beyond (FOLD: a chunk reaching past 2**32). Below, a chunk counts in
// uint32, and without a branch in the loop, which lets it vectorize.
template <bool FOLD>
inline uint32_t position_of(int64_t first, int64_t i) {
  if constexpr (FOLD) {
    const int64_t at = first + i;
    return static_cast<uint32_t>(at ^ (at >> 32));
  } else {
    return static_cast<uint32_t>(first) + static_cast<uint32_t>(i);
  }
}

inline bool needs_fold(int64_t first, int64_t n) { return first + n > (int64_t{1} << 32); }

// position_of(first, i) * kGolden, the hash's key: below 2**32 an affine
// function of i, which the vectorized loops advance by an addition per vector
// instead of a multiplication per value.
template <bool FOLD>
inline uint32_t position_key(int64_t first, int64_t i) {
  if constexpr (FOLD) {
    return position_of<true>(first, i) * kGolden;
  } else {
    return static_cast<uint32_t>(first) * kGolden + static_cast<uint32_t>(i) * kGolden;
  }
}

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
// rounding unbiased. A NaN takes no noise and keeps its quiet bit set
// (is_nan_bits): a payload in the low half would carry into its sign or
// exponent. Masks, not a branch nor a product: the loops that call it
// vectorize, and a vector multiplication costs what the rest does.
inline uint16_t bfloat16_bits(float value, uint32_t seed, uint32_t key) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  // All ones for a NaN (its magnitude's bits above infinity's), else 0.
  const auto nan = static_cast<uint32_t>(static_cast<int32_t>(0x7F800000u - (bits & 0x7FFFFFFFu)) >> 31);
  const uint32_t noise = hash32_of_key(seed, key) & 0xFFFFu & ~nan;
  return static_cast<uint16_t>(((bits + noise) | (nan & 0x00400000u)) >> 16);
}

}  // namespace qhoptim::rounding
