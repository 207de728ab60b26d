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
// (qhoptim.rounding._carried): a payload in the low half would carry into
// its sign or exponent. Two selections on one comparison, which the loops
// that call it vectorize as masked operations: a product by the NaN flag
// (torch's and MLX's bfloat16 steps) and a mask made by a shift (MLX's: 40%
// slower) each cost more.
inline uint16_t bfloat16_bits(float value, uint32_t seed, uint32_t key) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  const bool nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;  // a NaN's magnitude bits exceed inf's
  const uint32_t noise = nan ? 0u : hash32_of_key(seed, key) & 0xFFFFu;
  return static_cast<uint16_t>((nan ? bits | 0x00400000u : bits + noise) >> 16);
}

}  // namespace qhoptim::rounding
