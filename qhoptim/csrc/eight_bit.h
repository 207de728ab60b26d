// qhoptim.rounding's 8-bit blockwise state in C++: the code book's ladder,
// each block's scale, and the codes' encoding (stochastic or to nearest) and
// decoding, the same bytes as qhoptim.rounding.eight_bit_encode_reference and
// eight_bit_decode_reference. Shared by the torch backend's fused CPU kernel
// (qhoptim/torch/csrc) and the optax backend's state step (qhoptim/optax/csrc),
// which include it; each tests its codes against the NumPy statement.
//
// The vector loops below use AVX2 and AVX-512 where the build targets them
// (the same codes as the scalar loops, which finish each block).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "rounding.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace qhoptim::eight_bit {
// Internal linkage, as in the single source file each kernel is: the
// compiler inlines these loops where they are used, as it did before they
// were shared.
namespace {

using qhoptim::rounding::hash32_of_key;
using qhoptim::rounding::kGolden;
using qhoptim::rounding::needs_fold;
using qhoptim::rounding::position_key;

// `levels` are qhoptim.rounding.eight_bit_levels: 0 and a ladder to 1 of
// eight levels per octave, (1 + r / 8) * 2**q; a signed state's codes keep
// the sign in their top bit. Each block of kBlock values has a float32 scale,
// its largest finite magnitude.
constexpr int64_t kBlock = 256;
// Magnitudes and ratios below float32's smallest normal number are read as 0
// (qhoptim.rounding.EIGHT_BIT_SMALLEST).
constexpr float kSmallestNormal = std::numeric_limits<float>::min();
// qhoptim.rounding.EIGHT_BIT_LARGEST_PLAIN_SCALE, 2**126: the largest scale
// whose reciprocal is normal.
constexpr float kLargestPlainScale = 0x1p126f;

// The codes of non-finite values (qhoptim.rounding.EIGHT_BIT_NON_FINITE): a
// signed state's NaN or infinity (its "-0", otherwise unused) reads back as
// NaN; an unsigned one's (a second moment that overflowed) as +inf, as a
// float32 state would hold it. The block's other values keep their scale.
constexpr int kSignedNonFinite = 128;
constexpr int kUnsignedInfinite = 1;

// The levels of an 8-bit state and how to find them: `lv` ascending, `nl` of
// them, `per_octave` levels per halving (qhoptim.rounding.EIGHT_BIT_PER_OCTAVE).
// `linear`: the levels are qhoptim.rounding's ladder -- 0, then eight levels
// spaced evenly in each octave, (1 + r / 8) * 2**q -- whose level k >= 1 has
// the float32 bits (k - (nl - 1) + 8 * 127) << 20: an exponent and the
// mantissa's top three bits, the rest 0 (linear_ladder checks it against the
// table). The vector loops then find and read levels with shifts and masks
// on a float's bits, where reading them from the table would take a gather
// (which compilers spell as eight scalar loads) per value.
struct Ladder {
  const float* lv;
  int nl;
  int per_octave;
  bool linear;
};

// The linear ladder's levels per octave (qhoptim.rounding.EIGHT_BIT_PER_OCTAVE).
constexpr int kPerOctave = 8;
// A level's bits, shifted right by kRungShift, are its rung: the exponent
// field and the mantissa's top three bits, 8 * 127 at 1.0.
constexpr int kRungShift = 23 - 3;
static_assert(kPerOctave == 1 << (23 - kRungShift), "a rung per level");
constexpr int32_t kRungOfOne = 8 * 127;
constexpr int32_t kBelowRung = (int32_t{1} << kRungShift) - 1;  // the bits under a rung

// Whether `lv` is the linear ladder of `nl` levels (see Ladder).
inline bool linear_ladder(const float* lv, int nl) {
  if (nl < kPerOctave + 2 || nl > 256 || lv[0] != 0.0f) {
    return false;
  }
  for (int k = 1; k < nl; ++k) {
    int32_t bits;
    std::memcpy(&bits, &lv[k], sizeof(bits));
    if (bits != (k - (nl - 1) + kRungOfOne) << kRungShift) {
      return false;
    }
  }
  return true;
}

// One block's 8-bit arithmetic, written for the compiler to vectorize (with
// AVX2, 8 values at a time, the table read by gathers): 32-bit integers, no
// branch, and each choice as arithmetic or a mask where a select would put a
// table's load on one side of a branch and keep the loop scalar. Blocks hold
// at most kBlock values.

// A value as a block's scale counts it: its magnitude's bits where that is
// finite and normal, else 0 (a NaN or an infinity takes its own code and
// leaves the others' scale alone; a subnormal magnitude reads as 0, the 8-bit
// rule's flush). The bits are ordered as the magnitudes are, so a block's
// scale is an integer maximum, where a float maximum that skips NaNs would
// not vectorize; a step's loop can take it as it writes the block.
inline int32_t scale_bits(float x) {
  int32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  bits &= 0x7FFFFFFF;
  return bits < 0x7F800000 && bits >= 0x00800000 ? bits : 0;
}

// The scale whose scale_bits are `largest`.
inline float scale_of_bits(int32_t largest) {
  float scale;
  std::memcpy(&scale, &largest, sizeof(scale));
  return scale;
}

// A block's scale: its largest finite magnitude.
inline float block_scale(const float* __restrict__ x, int len) {
  int32_t largest = 0;
  for (int i = 0; i < len; ++i) {
    largest = std::max(largest, scale_bits(x[i]));
  }
  return scale_of_bits(largest);
}

// A value's magnitude bits, NaNs' and infinities' too: what a step's loop
// takes the maximum of as it writes a block, a mask and a maximum per vector
// where scale_bits' tests take three operations more (4% of the 8-bit QHAdam
// step's arithmetic). scale_from_magnitudes makes the block's scale of it.
inline int32_t magnitude_bits(float x) {
  int32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits & 0x7FFFFFFF;
}

// The scale of the `len` values `x` whose largest magnitude_bits is
// `largest`: block_scale(x, len), found from `largest` alone but where a NaN
// or an infinity is the largest (rare, and then read again without them). A
// largest below the smallest normal magnitude means every magnitude is
// subnormal or 0: a scale of 0, the rule's flush.
inline float scale_from_magnitudes(int32_t largest, const float* x, int len) {
  if (largest >= 0x7F800000) {
    return block_scale(x, len);
  }
  return scale_of_bits(largest >= 0x00800000 ? largest : 0);
}

#if defined(__AVX2__)
// The vector loops of the linear ladder (Ladder), 8 values at a time: the
// same numbers as the loops below them, which finish each block's last few
// values.

template <bool SIGNED>
inline int decode_values_avx2(float* __restrict__ x, const uint8_t* __restrict__ c, int len,
                              float scale, const Ladder& ladder) {
  const __m256i bias = _mm256_set1_epi32(kRungOfOne - (ladder.nl - 1));
  const __m256i zero = _mm256_setzero_si256();
  const __m256 scale8 = _mm256_set1_ps(scale);
  int i = 0;
  for (; i + 8 <= len; i += 8) {
    __m128i bytes;
    std::memcpy(&bytes, c + i, 8);  // the low 8 bytes; the rest is unused
    const __m256i code = _mm256_cvtepu8_epi32(bytes);
    const __m256i k = SIGNED ? _mm256_and_si256(code, _mm256_set1_epi32(127)) : code;
    const __m256 level =  // its bits (Ladder)
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, bias), kRungShift));
    __m256 value = _mm256_mul_ps(level, scale8);
    value = _mm256_andnot_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(k, zero)), value);  // level 0
    if constexpr (SIGNED) {
      const __m256i negative = _mm256_cmpgt_epi32(code, _mm256_set1_epi32(128));
      value = _mm256_xor_ps(value, _mm256_castsi256_ps(_mm256_slli_epi32(negative, 31)));
      const __m256i non_finite = _mm256_cmpeq_epi32(code, _mm256_set1_epi32(kSignedNonFinite));
      value = _mm256_blendv_ps(value, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()),
                               _mm256_castsi256_ps(non_finite));
    } else {
      const __m256i infinite = _mm256_cmpeq_epi32(code, _mm256_set1_epi32(kUnsignedInfinite));
      value = _mm256_blendv_ps(value, _mm256_set1_ps(std::numeric_limits<float>::infinity()),
                               _mm256_castsi256_ps(infinite));
    }
    _mm256_storeu_ps(x + i, value);
  }
  return i;
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define QHOPTIM_AVX512 1
// The same loops 16 values at a time, where the CPU and the build have
// AVX-512: masks in place of blends, unsigned comparisons, codes narrowed in
// one instruction.

// A vector the compiler must keep (in a register, or spilled): GCC otherwise
// makes some constants again on every pass of a loop, a broadcast from a
// general register each -- a uop on the port the encoding's shifts and
// comparisons already crowd (it took 9% longer without).
inline __m512i kept(__m512i v) {
  asm("" : "+v"(v));
  return v;
}
inline __m512 kept(__m512 v) {
  asm("" : "+v"(v));
  return v;
}

// Whether the `len` codes `c` hold a 0 (level 0) or the non-finite code
// (`special`): checked once per block, 64 codes a comparison, so that a block
// without them (nearly all, past the first step) decodes with neither test.
inline bool has_zero_or_special_avx512(const uint8_t* __restrict__ c, int len, int special) {
  const __m512i zero = _mm512_setzero_si512();
  const __m512i special64 = _mm512_set1_epi8(static_cast<char>(special));
  __mmask64 found = 0;
  int i = 0;
  for (; i + 64 <= len; i += 64) {
    const __m512i codes = _mm512_loadu_si512(c + i);
    found |= _mm512_cmpeq_epi8_mask(codes, zero) | _mm512_cmpeq_epi8_mask(codes, special64);
  }
  bool any = found != 0;
  for (; i < len; ++i) {
    any |= c[i] == 0 || c[i] == special;
  }
  return any;
}

template <bool SIGNED>
inline int decode_values_avx512(float* __restrict__ x, const uint8_t* __restrict__ c, int len,
                                float scale, const Ladder& ladder) {
  const __m512i bias = _mm512_set1_epi32(kRungOfOne - (ladder.nl - 1));
  const __m512i zero = _mm512_setzero_si512();
  const __m512 scale16 = _mm512_set1_ps(scale);
  int i = 0;
  if (!has_zero_or_special_avx512(c, len, SIGNED ? kSignedNonFinite : kUnsignedInfinite)) {
    // Every level is one of the ladder's (k > 0) and finite: the level's bits
    // times the scale, a signed code's bit 7 moved to the float's sign (the
    // same bits as the loop below, which takes every code).
    const __m512i sign_bit = _mm512_set1_epi32(static_cast<int>(0x80000000u));
    for (; i + 16 <= len; i += 16) {
      const __m512i code =
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + i)));
      const __m512i k = SIGNED ? _mm512_and_si512(code, _mm512_set1_epi32(127)) : code;
      const __m512 level =
          _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(k, bias), kRungShift));
      __m512 value = _mm512_mul_ps(level, scale16);
      if constexpr (SIGNED) {  // value ^ (bit 7 of the code, at bit 31)
        value = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(
            _mm512_castps_si512(value), _mm512_slli_epi32(code, 24), sign_bit, 0x78));
      }
      _mm512_storeu_ps(x + i, value);
    }
    return i;
  }
  for (; i + 16 <= len; i += 16) {
    const __m512i code = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + i)));
    const __m512i k = SIGNED ? _mm512_and_si512(code, _mm512_set1_epi32(127)) : code;
    const __m512 level =  // its bits (Ladder)
        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(k, bias), kRungShift));
    __m512 value = _mm512_maskz_mov_ps(_mm512_cmpneq_epi32_mask(k, zero),  // level 0
                                       _mm512_mul_ps(level, scale16));
    if constexpr (SIGNED) {
      const __mmask16 negative = _mm512_cmpgt_epi32_mask(code, _mm512_set1_epi32(128));
      value = _mm512_mask_xor_ps(value, negative, value, _mm512_set1_ps(-0.0f));
      value = _mm512_mask_mov_ps(
          value, _mm512_cmpeq_epi32_mask(code, _mm512_set1_epi32(kSignedNonFinite)),
          _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
    } else {
      value = _mm512_mask_mov_ps(
          value, _mm512_cmpeq_epi32_mask(code, _mm512_set1_epi32(kUnsignedInfinite)),
          _mm512_set1_ps(std::numeric_limits<float>::infinity()));
    }
    _mm512_storeu_ps(x + i, value);
  }
  return i;
}
#endif

// Decode `len` codes of a block of `scale` into `x`.
template <bool SIGNED>
inline void decode_values(float* __restrict__ x, const uint8_t* __restrict__ c, int len,
                          float scale, const Ladder& ladder) {
  const float* __restrict__ lv = ladder.lv;
  int i = 0;
  if (ladder.linear) {
#if defined(QHOPTIM_AVX512)
    i = decode_values_avx512<SIGNED>(x, c, len, scale, ladder);
#endif
#if defined(__AVX2__)
    i += decode_values_avx2<SIGNED>(x + i, c + i, len - i, scale, ladder);
#endif
  }
  for (; i < len; ++i) {
    const int code = c[i];
    if constexpr (SIGNED) {
      const float value = lv[code & 127] * scale;
      const float signed_value = code > 128 ? -value : value;
      x[i] = code == kSignedNonFinite ? std::numeric_limits<float>::quiet_NaN() : signed_value;
    } else {
      // + inf rather than a select of it (see above); the level's value is finite.
      const float infinite =
          code == kUnsignedInfinite ? std::numeric_limits<float>::infinity() : 0.0f;
      x[i] = lv[code] * scale + infinite;
    }
  }
}

// The vector loops' fast case: a vector whose ratios are all normal numbers
// in [lv[1], 1] (lv[2] for an unsigned state, whose code 1 is infinity's),
// whose magnitudes are normal too (as the rule reads them), so that the level
// below each is not 0. A ratio's bits b give its level and the rule's
// comparison at once (Ladder): the level below is b with its low kRungShift
// bits cleared, (b >> 20) - kRungOfOne rungs from 1 (the code (b >> 20) +
// code_of_rung), and the level above lies one unit of bit 20 further up (the
// next mantissa, or from r = 7 the next power of two): 2**(e - 3) above it,
// e the ratio's exponent. Both sides of the rule's comparison
//   ratio - below > threshold * (above - below)
// are exact in float32 (the distance a difference in one binade, the gap a
// power of two), and scaled by 2**(23 - e) they read
//   (b & kBelowRung) > threshold * 2**20,
// i.e. the bits under the rung exceed 16 times the 16-bit noise (2**19 to
// nearest). So the carry 2**20 - 1 - 16 * noise (kHalfCarry to nearest),
// added to b, reaches the rung exactly when the rule goes up: the code is
// ((b - lowest_bits + carry) >> 20) + code_of_lowest, the lowest fast level's
// bits having nothing under their rung. A ratio of 1 is the top level
// itself, nothing under its rung: the top's code, as the rule gives it. A
// vector with any other case -- 0, the bottom rung, NaN and infinity,
// subnormals -- takes the general steps.
struct FastCase {
  static constexpr int32_t kOneBits = 0x3F800000;  // 1.0f
  static constexpr int32_t kHalfRung = int32_t{1} << (kRungShift - 1);  // to nearest
  static constexpr int32_t kHalfCarry = kHalfRung - 1;  // 2**20 - 1 - 2**19
  int32_t lowest_bits;  // the fast ratios' bit patterns: lowest_bits .. + span
  int32_t span;
  int32_t code_of_rung;  // code = (b >> kRungShift) + code_of_rung
  int32_t code_of_lowest;  // lowest_bits' code
  FastCase(const Ladder& ladder, bool is_signed) {
    code_of_lowest = is_signed ? 1 : 2;
    std::memcpy(&lowest_bits, &ladder.lv[code_of_lowest], sizeof(lowest_bits));
    span = kOneBits - lowest_bits;
    code_of_rung = ladder.nl - 1 - kRungOfOne;
  }
};

// A state's 16 bits of noise from the hash of its value's position
// (block_hashes): the low half, or with HIGH the high half -- an 8-bit
// second moment's, which shares its first moment's hash
// (qhoptim.rounding.eight_bit_noise_source).
template <bool HIGH>
inline uint32_t noise_of_hash(uint32_t hash) {
  return HIGH ? hash >> 16 : hash & 0xFFFFu;
}

#if defined(__AVX2__)
// hash32_of_key of 8 keys.
inline __m256i hash32_of_key_avx2(uint32_t seed, __m256i key) {
  __m256i x = _mm256_xor_si256(key, _mm256_set1_epi32(static_cast<int>(seed)));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7FEB352D));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x846CA68Bu)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

// encode_values' loop for the linear ladder, 8 values at a time: the fast
// case (FastCase) on a ratio's bits, the general steps with the levels around
// a ratio read off its bits too. The same codes as the loop of encode_values,
// step for step.
template <bool SIGNED, bool STOCHASTIC, bool HIGH>
inline int encode_values_avx2(uint8_t* __restrict__ c, const float* __restrict__ x,
                              const uint32_t* __restrict__ hashes, int len, float inverse_scale,
                              const Ladder& ladder) {
  const int nl = ladder.nl;
  const __m256 magnitude_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 largest = _mm256_set1_ps(std::numeric_limits<float>::max());
  const __m256 smallest = _mm256_set1_ps(kSmallestNormal);
  const __m256 inverse = _mm256_set1_ps(inverse_scale);
  const __m256i highest_low = _mm256_set1_epi32(nl - 2);
  const __m256i one = _mm256_set1_epi32(1), zero = _mm256_setzero_si256();
  const __m256 first_level = _mm256_set1_ps(ladder.lv[1]);
  const __m256 last_below = _mm256_set1_ps(ladder.lv[nl - 2]);
  const __m256 last_above = _mm256_set1_ps(ladder.lv[nl - 1]);
  const __m256i below_rung = _mm256_set1_epi32(kBelowRung);
  const __m256i one_rung = _mm256_set1_epi32(int32_t{1} << kRungShift);
  const FastCase fast_case(ladder, SIGNED);
  const __m256i lowest = _mm256_set1_epi32(fast_case.lowest_bits);
  const __m256i span = _mm256_set1_epi32(fast_case.span);
  const __m256i code_of_rung = _mm256_set1_epi32(fast_case.code_of_rung);
  const __m256i half_rung = _mm256_set1_epi32(FastCase::kHalfRung);
  int i = 0;
  for (; i + 8 <= len; i += 8) {
    const __m256 value = _mm256_loadu_ps(x + i);
    const __m256 absolute = _mm256_and_ps(value, magnitude_mask);
    // The fast case (FastCase), and the general steps for the others. The
    // range's unsigned comparison as a maximum: a ratio's NaN may have its
    // sign bit set.
    const __m256 fast_ratio = _mm256_mul_ps(absolute, inverse);
    const __m256i fast_bits = _mm256_castps_si256(fast_ratio);
    const __m256i offset = _mm256_sub_epi32(fast_bits, lowest);
    const __m256 fast = _mm256_and_ps(
        _mm256_cmp_ps(absolute, smallest, _CMP_GE_OQ),
        _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_max_epu32(offset, span), span)));
    // The bar the bits under a rung must pass to go up: 16 times the noise
    // (both below 2**20, so that a signed comparison does), or half a rung.
    __m256i bar = half_rung;
    if constexpr (STOCHASTIC) {
      const __m256i hash = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hashes + i));
      const __m256i noise = HIGH ? _mm256_srli_epi32(hash, 16)
                                 : _mm256_and_si256(hash, _mm256_set1_epi32(0xFFFF));
      bar = _mm256_slli_epi32(noise, 4);
    }
    if (_mm256_movemask_ps(fast) == 0xFF) {
      const __m256i up = _mm256_cmpgt_epi32(_mm256_and_si256(fast_bits, below_rung), bar);
      __m256i code = _mm256_add_epi32(_mm256_srli_epi32(fast_bits, kRungShift), code_of_rung);
      code = _mm256_sub_epi32(code, up);
      if constexpr (SIGNED) {  // the sign bit, as 128
        code = _mm256_or_si256(
            code, _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(value), 24),
                                   _mm256_set1_epi32(128)));
      }
      const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(code),
                                             _mm256_extracti128_si256(code, 1));
      const __m128i bytes = _mm_packus_epi16(words, words);
      std::memcpy(c + i, &bytes, 8);
      continue;
    }
    const __m256 finite = _mm256_cmp_ps(absolute, largest, _CMP_LE_OQ);
    const __m256 magnitude =
        _mm256_andnot_ps(_mm256_cmp_ps(absolute, smallest, _CMP_LT_OQ), absolute);
    __m256 ratio = _mm256_mul_ps(magnitude, inverse);
    ratio = _mm256_andnot_ps(_mm256_cmp_ps(ratio, smallest, _CMP_NGE_UQ), ratio);  // NaN, tiny: 0
    const __m256i bits = _mm256_castps_si256(ratio);
    // The levels around a normal ratio (FastCase); k = its rung + code_of_rung.
    const __m256i rung_bits = _mm256_andnot_si256(below_rung, bits);
    __m256 below = _mm256_castsi256_ps(rung_bits);
    __m256 above = _mm256_castsi256_ps(_mm256_add_epi32(rung_bits, one_rung));
    __m256i low = _mm256_add_epi32(_mm256_srli_epi32(bits, kRungShift), code_of_rung);
    // Below the first level (0 included): between 0 and it. At or past the
    // top: the last pair.
    const __m256 under = _mm256_castsi256_ps(_mm256_cmpgt_epi32(one, low));
    const __m256 over = _mm256_castsi256_ps(_mm256_cmpgt_epi32(low, highest_low));
    low = _mm256_min_epi32(_mm256_max_epi32(low, zero), highest_low);
    below = _mm256_blendv_ps(_mm256_andnot_ps(under, below), last_below, over);
    above = _mm256_blendv_ps(_mm256_blendv_ps(above, first_level, under), last_above, over);
    __m256 threshold = _mm256_set1_ps(0.5f);
    if constexpr (STOCHASTIC) {
      threshold = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(bar, 4)),
                                _mm256_set1_ps(0x1p-16f));
    }
    const __m256i up = _mm256_castps_si256(
        _mm256_cmp_ps(_mm256_sub_ps(ratio, below),
                      _mm256_mul_ps(threshold, _mm256_sub_ps(above, below)), _CMP_GT_OQ));
    __m256i code = _mm256_sub_epi32(low, up);
    const __m256i keep = _mm256_castps_si256(finite);
    if constexpr (SIGNED) {
      const __m256i negative =
          _mm256_castps_si256(_mm256_cmp_ps(value, _mm256_setzero_ps(), _CMP_LT_OQ));
      const __m256i nonzero = _mm256_cmpgt_epi32(code, zero);
      code = _mm256_add_epi32(
          code, _mm256_and_si256(_mm256_and_si256(negative, nonzero), _mm256_set1_epi32(128)));
      code = _mm256_blendv_epi8(_mm256_set1_epi32(kSignedNonFinite), code, keep);
    } else {
      const __m256i positive = _mm256_cmpgt_epi32(bits, zero);
      code = _mm256_max_epi32(
          code, _mm256_and_si256(positive, _mm256_set1_epi32(kUnsignedInfinite + 1)));
      code = _mm256_blendv_epi8(_mm256_set1_epi32(kUnsignedInfinite), code, keep);
    }
    const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(code),
                                           _mm256_extracti128_si256(code, 1));
    const __m128i bytes = _mm_packus_epi16(words, words);
    std::memcpy(c + i, &bytes, 8);
  }
  return i;
}
#endif

#if defined(QHOPTIM_AVX512)
// The constants of hash_avx512 for a seed, made once per loop.
struct HashConstants {
  __m512i folded, first_multiplier, second_multiplier;
  explicit HashConstants(uint32_t seed)
      : folded(kept(_mm512_set1_epi32(static_cast<int>(seed ^ (seed >> 16))))),
        first_multiplier(kept(_mm512_set1_epi32(0x7FEB352D))),
        second_multiplier(kept(_mm512_set1_epi32(static_cast<int>(0x846CA68Bu)))) {}
};

// hash32_of_key(seed, key) of 16 keys (k: HashConstants(seed)). Its first
// step, x ^ (x >> 16) of x = key ^ seed, is key ^ (key >> 16) ^ folded with
// folded = seed ^ (seed >> 16) (a shift distributes over a xor): one
// three-way xor per vector instead of two.
inline __m512i hash_avx512(const HashConstants& k, __m512i key) {
  __m512i x = _mm512_ternarylogic_epi32(key, _mm512_srli_epi32(key, 16), k.folded, 0x96);
  x = _mm512_mullo_epi32(x, k.first_multiplier);
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, k.second_multiplier);
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

// The general steps of encode_values_avx512 for 16 values (`noise` their
// noise, noise_of_hash's), where not all of them are in FastCase's range
// (rare: a zero, a value far below its block's scale, a non-finite one). Out
// of line, so that the loop holds only the fast case's constants in its
// registers.
template <bool SIGNED, bool STOCHASTIC>
__attribute__((noinline)) void encode16_general_avx512(uint8_t* __restrict__ c, __m512 value,
                                                       __m512i noise, float inverse_scale,
                                                       const Ladder& ladder) {
  const int nl = ladder.nl;
  const __m512 largest = _mm512_set1_ps(std::numeric_limits<float>::max());
  const __m512 smallest = _mm512_set1_ps(kSmallestNormal);
  const __m512 inverse = _mm512_set1_ps(inverse_scale);
  const __m512i highest_low = _mm512_set1_epi32(nl - 2);
  const __m512i one = _mm512_set1_epi32(1), zero = _mm512_setzero_si512();
  const __m512 first_level = _mm512_set1_ps(ladder.lv[1]);
  const __m512 last_below = _mm512_set1_ps(ladder.lv[nl - 2]);
  const __m512 last_above = _mm512_set1_ps(ladder.lv[nl - 1]);
  const __m512 absolute = _mm512_abs_ps(value);
  const __mmask16 finite = _mm512_cmp_ps_mask(absolute, largest, _CMP_LE_OQ);
  const __m512 magnitude =
      _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(absolute, smallest, _CMP_NLT_UQ), absolute);
  __m512 ratio = _mm512_mul_ps(magnitude, inverse);
  ratio = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(ratio, smallest, _CMP_GE_OQ), ratio);
  const __m512i bits = _mm512_castps_si512(ratio);
  // The levels around a normal ratio (FastCase).
  const __m512i rung_bits = _mm512_andnot_si512(_mm512_set1_epi32(kBelowRung), bits);
  __m512 below = _mm512_castsi512_ps(rung_bits);
  __m512 above = _mm512_castsi512_ps(
      _mm512_add_epi32(rung_bits, _mm512_set1_epi32(int32_t{1} << kRungShift)));
  __m512i low = _mm512_add_epi32(_mm512_srli_epi32(bits, kRungShift),
                                 _mm512_set1_epi32(nl - 1 - kRungOfOne));
  const __mmask16 under = _mm512_cmplt_epi32_mask(low, one);
  const __mmask16 over = _mm512_cmpgt_epi32_mask(low, highest_low);
  low = _mm512_min_epi32(_mm512_max_epi32(low, zero), highest_low);
  below = _mm512_mask_mov_ps(_mm512_mask_mov_ps(below, under, _mm512_setzero_ps()), over,
                             last_below);
  above = _mm512_mask_mov_ps(_mm512_mask_mov_ps(above, under, first_level), over, last_above);
  __m512 threshold = _mm512_set1_ps(0.5f);
  if constexpr (STOCHASTIC) {
    threshold = _mm512_mul_ps(_mm512_cvtepi32_ps(noise), _mm512_set1_ps(0x1p-16f));
  }
  const __mmask16 up =
      _mm512_cmp_ps_mask(_mm512_sub_ps(ratio, below),
                         _mm512_mul_ps(threshold, _mm512_sub_ps(above, below)), _CMP_GT_OQ);
  __m512i code = _mm512_mask_add_epi32(low, up, low, one);
  if constexpr (SIGNED) {
    const __mmask16 negative =
        _mm512_cmp_ps_mask(value, _mm512_setzero_ps(), _CMP_LT_OQ) &
        _mm512_cmpgt_epi32_mask(code, zero);
    code = _mm512_mask_add_epi32(code, negative, code, _mm512_set1_epi32(128));
    code = _mm512_mask_mov_epi32(_mm512_set1_epi32(kSignedNonFinite), finite, code);
  } else {
    const __mmask16 positive = _mm512_cmpgt_epi32_mask(bits, zero);
    code = _mm512_mask_max_epi32(code, positive, code, _mm512_set1_epi32(kUnsignedInfinite + 1));
    code = _mm512_mask_mov_epi32(_mm512_set1_epi32(kUnsignedInfinite), finite, code);
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(c), _mm512_cvtepi32_epi8(code));
}

// encode_values_avx2, 16 values at a time. The fast case's code from the
// carry (FastCase): 2**20 - 1 - 16 * noise is ((0xFFFF - noise) << 4) | 0xF,
// the noise's bits moved to bits 4-19 (a shift of the hash, its other bits
// masked) and flipped, and the low four set: one three-way operation.
// PLAIN: a block whose scale is not tiny (inverse_scale <= lowest * 2**125,
// the scale above about 2**-109), where a subnormal magnitude's ratio lies
// below half the lowest fast level, so that the range test alone leaves it
// to the general steps (its product can round up, but not past twice itself).
template <bool SIGNED, bool STOCHASTIC, bool HIGH, bool PLAIN>
inline int encode_values_avx512(uint8_t* __restrict__ c, const float* __restrict__ x,
                                const uint32_t* __restrict__ hashes, int len,
                                float inverse_scale, const Ladder& ladder) {
  // Every constant of the loop kept (see kept).
  const __m512 smallest = kept(_mm512_set1_ps(kSmallestNormal));
  const __m512 inverse = kept(_mm512_set1_ps(inverse_scale));
  const __m512i sign_code = kept(_mm512_set1_epi32(128));
  const FastCase fast_case(ladder, SIGNED);
  const __m512i lowest = kept(_mm512_set1_epi32(fast_case.lowest_bits));
  const __m512i span = kept(_mm512_set1_epi32(fast_case.span));
  const __m512i code_of_lowest = kept(_mm512_set1_epi32(fast_case.code_of_lowest));
  const __m512i noise_field = kept(_mm512_set1_epi32(0xFFFF << 4));
  const __m512i low_four = kept(_mm512_set1_epi32(0xF));
  const __m512i half_carry = kept(_mm512_set1_epi32(FastCase::kHalfCarry));
  int i = 0;
  for (; i + 16 <= len; i += 16) {
    const __m512 value = _mm512_loadu_ps(x + i);
    const __m512 absolute = _mm512_abs_ps(value);
    // The fast case (FastCase); the general steps for the others.
    const __m512 fast_ratio = _mm512_mul_ps(absolute, inverse);
    const __m512i offset = _mm512_sub_epi32(_mm512_castps_si512(fast_ratio), lowest);
    const __mmask16 fast =
        PLAIN ? _mm512_cmple_epu32_mask(offset, span)
              : _mm512_mask_cmple_epu32_mask(_mm512_cmp_ps_mask(absolute, smallest, _CMP_GE_OQ),
                                             offset, span);
    __m512i hash = _mm512_setzero_si512();
    if constexpr (STOCHASTIC) {
      hash = _mm512_loadu_si512(hashes + i);
    }
    if (fast != 0xFFFF) {
      const __m512i noise = HIGH ? _mm512_srli_epi32(hash, 16)
                                 : _mm512_and_si512(hash, _mm512_set1_epi32(0xFFFF));
      encode16_general_avx512<SIGNED, STOCHASTIC>(c + i, value, noise, inverse_scale, ladder);
      continue;
    }
    __m512i carry = half_carry;
    if constexpr (STOCHASTIC) {  // (~field & noise_field) | low_four
      const __m512i field = HIGH ? _mm512_srli_epi32(hash, 12) : _mm512_slli_epi32(hash, 4);
      carry = _mm512_ternarylogic_epi32(field, noise_field, low_four, 0xAE);
    }
    __m512i code = _mm512_add_epi32(
        _mm512_srli_epi32(_mm512_add_epi32(offset, carry), kRungShift), code_of_lowest);
    if constexpr (SIGNED) {
      // The sign bit: here every value is finite, normal and not zero, so it
      // is value < 0, read on another port than a float comparison's.
      const __mmask16 negative = _mm512_movepi32_mask(_mm512_castps_si512(value));
      code = _mm512_mask_add_epi32(code, negative, code, sign_code);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(c + i), _mm512_cvtepi32_epi8(code));
  }
  return i;
}
#endif

// The hashes of the positions first .. first + len under `seed`,
// hash32_of_key(seed, position_key(first, i)) into `hashes`: a block's 32
// random bits per value, made once for every state that draws its noise from
// them (noise_of_hash). Positions past 2**32 are folded to 32 bits (torch's
// kernels), or with WRAP taken modulo 2**32 (optax's: XLA's uint32 positions
// wrap).
template <bool WRAP>
inline void block_hashes(uint32_t* __restrict__ hashes, int64_t first, int64_t len,
                         uint32_t seed) {
  const int n = static_cast<int>(len);
  int i = 0;
  if (!WRAP && needs_fold(first, len)) {
    for (; i < n; ++i) {
      hashes[i] = hash32_of_key(seed, position_key<true>(first, i));
    }
    return;
  }
  // The lanes' keys, position_key's, advanced by a vector's positions at a time.
  [[maybe_unused]] const uint32_t first_key = static_cast<uint32_t>(first) * kGolden;
#if defined(QHOPTIM_AVX512)
  {
    const HashConstants k(seed);
    __m512i key = _mm512_add_epi32(
        _mm512_set1_epi32(static_cast<int>(first_key)),
        _mm512_mullo_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32(static_cast<int>(kGolden))));
    const __m512i key_step = kept(_mm512_set1_epi32(static_cast<int>(16u * kGolden)));
    for (; i + 16 <= n; i += 16, key = _mm512_add_epi32(key, key_step)) {
      _mm512_storeu_si512(hashes + i, hash_avx512(k, key));
    }
  }
#endif
#if defined(__AVX2__)
  {
    __m256i key = _mm256_add_epi32(
        _mm256_set1_epi32(static_cast<int>(first_key + static_cast<uint32_t>(i) * kGolden)),
        _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                           _mm256_set1_epi32(static_cast<int>(kGolden))));
    const __m256i key_step = _mm256_set1_epi32(static_cast<int>(8u * kGolden));
    for (; i + 8 <= n; i += 8, key = _mm256_add_epi32(key, key_step)) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(hashes + i), hash32_of_key_avx2(seed, key));
    }
  }
#endif
  for (; i < n; ++i) {
    hashes[i] = hash32_of_key(seed, position_key<false>(first, i));
  }
}

// Encode `len` values `x` of a block of `scale` into `c`, each rounded with
// the noise of its hash (noise_of_hash<HIGH>; none to nearest): a value's
// ratio is its magnitude times `inverse_scale`, times `after` (1, or 1/4 for
// a scale above kLargestPlainScale, whose blocks take the scalar loop).
template <bool SIGNED, bool STOCHASTIC, bool HIGH>
inline void encode_values(uint8_t* __restrict__ c, const float* __restrict__ x,
                          const uint32_t* __restrict__ hashes, int len, float inverse_scale,
                          float after, const Ladder& ladder) {
  const float* __restrict__ lv = ladder.lv;
  const int nl = ladder.nl, per_octave = ladder.per_octave;
  int i = 0;
  if (ladder.linear && after == 1.0f) {
#if defined(QHOPTIM_AVX512)
    const float lowest = ladder.lv[SIGNED ? 1 : 2];  // FastCase's
    i = inverse_scale <= lowest * 0x1p125f
            ? encode_values_avx512<SIGNED, STOCHASTIC, HIGH, true>(c, x, hashes, len,
                                                                   inverse_scale, ladder)
            : encode_values_avx512<SIGNED, STOCHASTIC, HIGH, false>(c, x, hashes, len,
                                                                    inverse_scale, ladder);
#endif
#if defined(__AVX2__)
    i += encode_values_avx2<SIGNED, STOCHASTIC, HIGH>(c + i, x + i, hashes + i, len - i,
                                                      inverse_scale, ladder);
#endif
  }
  for (; i < len; ++i) {
    const float absolute = std::fabs(x[i]);
    const bool finite = absolute <= std::numeric_limits<float>::max();
    // Subnormal magnitudes and ratios count as 0 (qhoptim.rounding's rule:
    // the bytes do not depend on a flush-to-zero mode, XLA's on CPU).
    const float magnitude = absolute < kSmallestNormal ? 0.0f : absolute;
    float ratio = magnitude * inverse_scale * after;
    ratio = ratio != ratio || ratio < kSmallestNormal ? 0.0f : ratio;  // 0 * inf: all-zero block
    // The last level <= ratio (the table decides): a first guess of
    // per_octave * log2(ratio) from the float's exponent and the top of its
    // mantissa (within a level of the truth), then a step along the table,
    // in place of a binary search per value. The guess is at most one level
    // below (log2(1 + f) >= f), or one above where a level's float32 rounding
    // lies past the ratio: one step each way.
    int32_t bits;
    std::memcpy(&bits, &ratio, sizeof(bits));
    int low = nl - 1 + per_octave * ((bits >> 23) - 127) + (((bits & 0x7FFFFF) * per_octave) >> 23);
    low = std::min(std::max(low, 1), nl - 2);
    low -= lv[low] > ratio ? 1 : 0;
    low += lv[low + 1] <= ratio ? 1 : 0;
    low = std::min(low, nl - 2);
    const float below = lv[low], above = lv[low + 1];
    float threshold = 0.5f;
    if constexpr (STOCHASTIC) {
      threshold = static_cast<float>(noise_of_hash<HIGH>(hashes[i])) * 0x1p-16f;
    }
    // Up with probability (ratio - below) / (above - below): compared as a
    // product, no division per value.
    int code = low + (ratio - below > threshold * (above - below) ? 1 : 0);
    if constexpr (SIGNED) {
      const int negative = x[i] < 0.0f;
      const int nonzero = code > 0;
      code += 128 * (negative & nonzero);  // no -0: 128 is non-finite's
      const int keep = -static_cast<int>(finite);
      code = (code & keep) | (kSignedNonFinite & ~keep);
    } else {
      // A positive second moment is never stored as 0 (nor as the code of inf).
      const int positive = bits > 0;  // ratio > 0, on its bits
      code = std::max(code, (kUnsignedInfinite + 1) * positive);
      const int keep = -static_cast<int>(finite);
      code = (code & keep) | (kUnsignedInfinite & ~keep);
    }
    c[i] = static_cast<uint8_t>(code);
  }
}

inline void decode_block(float* x, const uint8_t* c, int64_t len, float scale,
                         const Ladder& ladder, bool is_signed) {
  const int n = static_cast<int>(len);
  is_signed ? decode_values<true>(x, c, n, scale, ladder)
            : decode_values<false>(x, c, n, scale, ladder);
}

// Encode one block of `len` values `x` into `codes`, at the block's `scale`
// (block_scale's: where a step found it as it wrote the values), rounded
// stochastically with the noise of `hashes` (block_hashes'; its high halves
// with `high`), or to nearest where `hashes` is null.
inline void encode_block_at_scale(uint8_t* c, const float* x, int64_t len, float scale,
                                  const Ladder& ladder, bool is_signed, const uint32_t* hashes,
                                  bool high) {
  const int n = static_cast<int>(len);
  // Once per block: ratios are products. Above kLargestPlainScale the
  // reciprocal of a quarter of the scale, the product then times 1/4: the
  // plain reciprocal would be subnormal, 0 where subnormals are flushed.
  const bool large = scale > kLargestPlainScale;
  const float inverse_scale = (large ? 4.0f : 1.0f) / scale;
  const float after = large ? 0.25f : 1.0f;
  auto encode = [&](auto signed_tag, auto stochastic_tag, auto high_tag) {
    encode_values<decltype(signed_tag)::value, decltype(stochastic_tag)::value,
                  decltype(high_tag)::value>(c, x, hashes, n, inverse_scale, after, ladder);
  };
  auto with_rounding = [&](auto signed_tag) {
    if (hashes == nullptr) {
      encode(signed_tag, std::false_type{}, std::false_type{});
    } else {
      high ? encode(signed_tag, std::true_type{}, std::true_type{})
           : encode(signed_tag, std::true_type{}, std::false_type{});
    }
  };
  is_signed ? with_rounding(std::true_type{}) : with_rounding(std::false_type{});
}

// Encode one block of `len` values `x` (the values `first ..` of their tensor)
// into `codes`, its scale found first and written to `*scale_out`; rounded
// stochastically with the noise of `seed` at their positions (block_hashes,
// WRAP its; the hashes' high halves with `high`), or to nearest.
template <bool WRAP = false>
inline void encode_block(uint8_t* c, float* scale_out, const float* x, int64_t first, int64_t len,
                         const Ladder& ladder, bool is_signed, uint32_t seed, bool stochastic,
                         bool high) {
  const float scale = block_scale(x, static_cast<int>(len));
  *scale_out = scale;
  alignas(64) uint32_t hashes[kBlock];
  if (stochastic) {
    block_hashes<WRAP>(hashes, first, len, seed);
  }
  encode_block_at_scale(c, x, len, scale, ladder, is_signed, stochastic ? hashes : nullptr, high);
}

// Whether ladder_of_levels takes `nl` levels with `per_octave` a halving: at
// most 256 (a byte's codes), and a first guess whose products fit 32 bits.
inline bool ladder_fits(int64_t nl, int64_t per_octave) {
  return nl >= 2 && nl <= 256 && per_octave >= 1 && per_octave <= 255;
}

// The ladder of the `nl` levels `lv` (read, not copied: they outlive it) with
// `per_octave` levels per halving.
inline Ladder ladder_of_levels(const float* lv, int nl, int per_octave) {
  return Ladder{lv, nl, per_octave, linear_ladder(lv, nl)};
}

}  // namespace
}  // namespace qhoptim::eight_bit
