// qhoptim.optax's narrow state on the CPU: one XLA custom call per step
// that steps every parameter's moving averages and stores them in bfloat16,
// rounded stochastically by qhoptim.rounding's rule (StoreBFloat16State), or
// in 8 bits (StoreEightBitState: qhoptim/csrc/eight_bit.h) -- one pass over
// the state where XLA's own fusions, for want of fusing the rounding's
// integer hash with the moving averages across a parameter's many arrays,
// take several (for 8 bits, one each for the blocks' scales, the codes and
// the decoded values). The update itself (the direction optax returns) stays with
// XLA, which fuses it into optax.apply_updates; it reads the old state, as
// this call does, so that the new state never passes through a float32 array.
//
// The coefficients come from qhoptim.rules, computed by the Python side
// (qhoptim/optax/_qhm.py, _qhadam.py) and passed as one float32 array; the arithmetic
// is rules.ewma's (and rules.amsgrad_maximum's), element by element, each
// product and sum rounded as written (built with -ffp-contract=off).
//
// Built on first use by qhoptim/optax/_extension.py against jaxlib's XLA FFI
// headers.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "eight_bit.h"  // qhoptim/csrc, on the include path
#include "rounding.h"
#include "slices.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using qhoptim::rounding::kGolden;

inline float load(const uint16_t* x, int64_t i) {
  const uint32_t bits = static_cast<uint32_t>(x[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// jnp.maximum: NaN from either side.
inline float nan_maximum(float a, float b) { return std::isnan(a) ? a : (a > b ? a : b); }

// The layout of the coefficient array (_state_weights in __init__.py): each
// moving average's decay and the weight of what it averages,
// rules.qhadam_moment_weights's order.
enum Coefficient : int { kDecay1, kWeight1, kDecay2, kWeight2 };

// qhoptim.rounding's rule for 8 bits.
namespace eight_bit = qhoptim::eight_bit;
using eight_bit::kBlock;
// Each value's noise is keyed by its position modulo 2**32, as XLA's path
// keys it (qhoptim.optax._noise16: uint32 positions wrap).
constexpr bool kWrap = true;

// One parameter's states: `in` the stored ones, `out` the new ones (other
// buffers: XLA writes the new state beside the old, which the update's own
// fusion reads too).
struct States {
  const uint16_t* in[3];
  uint16_t* out[3];
};

// QHM's buffer: rules.ewma(buffer, grad, momentum).
void ewma_of_grad(const float* __restrict__ g, const uint16_t* __restrict__ in, uint16_t* __restrict__ out,
                  const float* c, uint32_t seed, int64_t first, int64_t n) {
  const float decay = c[kDecay1], weight = c[kWeight1];
  // The hash's key of element i, i * 0x9E3779B9 (mod 2**32), advanced by one
  // addition per element.
  uint32_t key = static_cast<uint32_t>(first) * kGolden;
  for (int64_t i = first; i < first + n; ++i, key += kGolden) {
    out[i] = qhoptim::rounding::bfloat16_bits(decay * load(in, i) + weight * g[i], seed, key);
  }
}

// QHAdam's moments: rules.ewma of grad and of grad * grad, and with AMSGRAD
// rules.amsgrad_maximum of the second.
template <bool AMSGRAD>
void qhadam_moments(const float* __restrict__ g, const States& s, const float* c, const uint32_t* seeds,
                    int64_t first, int64_t n) {
  const float b1 = c[kDecay1], w1 = c[kWeight1], b2 = c[kDecay2], w2 = c[kWeight2];
  const uint32_t s0 = seeds[0], s1 = seeds[1], s2 = AMSGRAD ? seeds[2] : 0u;
  const uint16_t* __restrict__ m_in = s.in[0];
  const uint16_t* __restrict__ v_in = s.in[1];
  const uint16_t* __restrict__ max_in = s.in[2];
  uint16_t* __restrict__ m_out = s.out[0];
  uint16_t* __restrict__ v_out = s.out[1];
  uint16_t* __restrict__ max_out = s.out[2];
  uint32_t key = static_cast<uint32_t>(first) * kGolden;
  for (int64_t i = first; i < first + n; ++i, key += kGolden) {
    const float grad = g[i];
    const float m = b1 * load(m_in, i) + w1 * grad;
    const float v = b2 * load(v_in, i) + w2 * (grad * grad);
    m_out[i] = qhoptim::rounding::bfloat16_bits(m, s0, key);
    v_out[i] = qhoptim::rounding::bfloat16_bits(v, s1, key);
    if constexpr (AMSGRAD) max_out[i] = qhoptim::rounding::bfloat16_bits(nan_maximum(load(max_in, i), v), s2, key);
  }
}

// One parameter of the call: its gradient, states, seeds and size.
struct Leaf {
  const float* grad;
  States states;
  const uint32_t* seeds;
  int64_t size;
};

// Values [first, first + n) of one parameter.
void step_leaf(const Leaf& leaf, int64_t count, const float* c, int64_t first, int64_t n) {
  if (count == 1) return ewma_of_grad(leaf.grad, leaf.states.in[0], leaf.states.out[0], c, leaf.seeds[0], first, n);
  if (count == 2) return qhadam_moments<false>(leaf.grad, leaf.states, c, leaf.seeds, first, n);
  return qhadam_moments<true>(leaf.grad, leaf.states, c, leaf.seeds, first, n);
}

// StoreBFloat16State's work, once its arguments are checked.
ffi::Error step_all(ffi::Buffer<ffi::F32> coefficients, ffi::Buffer<ffi::U32> seeds, const ffi::RemainingArgs& arrays,
                    const ffi::RemainingRets& stepped, int64_t count, int64_t leaves) {
  std::vector<Leaf> all(leaves);
  std::vector<int64_t> starts(leaves + 1, 0);  // where each parameter begins in the one range
  for (int64_t l = 0; l < leaves; ++l) {
    auto grad = arrays.get<ffi::Buffer<ffi::F32>>(l);
    if (!grad.has_value()) return ffi::Error::InvalidArgument("qhoptim's bfloat16 state: float32 gradients");
    Leaf& leaf = all[l];
    leaf.grad = grad->typed_data();
    leaf.size = static_cast<int64_t>(grad->element_count());
    leaf.seeds = seeds.typed_data() + l * count;
    for (int64_t k = 0; k < count; ++k) {
      auto in = arrays.get<ffi::Buffer<ffi::BF16>>(leaves + l * count + k);
      auto out = stepped.get<ffi::Buffer<ffi::BF16>>(l * count + k);
      if (!in.has_value() || !out.has_value()) {
        return ffi::Error::InvalidArgument("qhoptim's bfloat16 state: each state is a bfloat16 array");
      }
      if (static_cast<int64_t>(in->element_count()) != leaf.size ||
          static_cast<int64_t>((*out)->element_count()) != leaf.size) {
        return ffi::Error::InvalidArgument("qhoptim's bfloat16 state: each state has its gradient's size");
      }
      leaf.states.in[k] = reinterpret_cast<const uint16_t*>(in->untyped_data());
      leaf.states.out[k] = reinterpret_cast<uint16_t*>((*out)->untyped_data());
    }
    starts[l + 1] = starts[l] + leaf.size;
  }
  const float* c = coefficients.typed_data();
  qhoptim::slices::for_each_slice(starts[leaves], [&](int64_t first, int64_t n) {
    // The parameter holding `first`, then each one the slice reaches into.
    int64_t l = std::upper_bound(starts.begin(), starts.end(), first) - starts.begin() - 1;
    for (int64_t end = first + n; first < end; ++l) {
      const int64_t stop = std::min(end, starts[l + 1]);
      if (stop > first) step_leaf(all[l], count, c, first - starts[l], stop - first);
      first = stop;
    }
  });
  return ffi::Error::Success();
}

// Every parameter of one step in one call (one custom call per step, not per
// parameter: XLA's CPU runtime costs a few microseconds a call, which a
// model's hundreds of small parameters add up). Arguments: the coefficients
// (float32[4]), the seeds (uint32, `states` per parameter), the gradients
// (float32), then each parameter's `states` states (bfloat16: QHM's buffer;
// QHAdam's two moments, and the running maximum with AMSGrad). Results: the
// new states, in the same order. The parameters' values are stepped as one
// range, in slices on several threads where it is large.
ffi::Error StoreBFloat16State(ffi::Buffer<ffi::F32> coefficients, ffi::Buffer<ffi::U32> seeds,
                              ffi::RemainingArgs arrays, ffi::RemainingRets stepped, int64_t count) {
  const int64_t args = static_cast<int64_t>(arrays.size());
  if (count < 1 || count > 3 || args % (count + 1) != 0 || coefficients.element_count() != 4) {
    return ffi::Error::InvalidArgument("qhoptim's bfloat16 state: 1 to 3 states a parameter, 4 coefficients");
  }
  const int64_t leaves = args / (count + 1);
  if (static_cast<int64_t>(stepped.size()) != leaves * count ||
      static_cast<int64_t>(seeds.element_count()) != leaves * count) {
    return ffi::Error::InvalidArgument("qhoptim's bfloat16 state: a result and a seed for each state");
  }
  try {
    return step_all(coefficients, seeds, arrays, stepped, count, leaves);
  } catch (const std::exception& error) {  // no exception crosses into XLA
    return ffi::Error::Internal(std::string("qhoptim's bfloat16 state: ") + error.what());
  }
}


// ----------------------------------------------------------- 8-bit state
// One parameter's 8-bit states: each the codes (a byte per value) and the
// blocks' scales, stored (`in`) and new (`out`).
struct EightBitLeaf {
  const float* grad;
  const uint8_t* codes_in[3];
  const float* scales_in[3];
  uint8_t* codes_out[3];
  float* scales_out[3];
  const uint32_t* seeds;
  int64_t size;
};

// The states' ladders: QHM's buffer and QHAdam's first moment signed, the
// second moment and its running maximum not (qhoptim.optax's _zeros_state).
// `high`: the state rounds with the high halves of the first state's hashes
// (QHAdam's second moment, qhoptim.rounding.eight_bit_noise_source), its own
// seed unused.
struct EightBitRule {
  const eight_bit::Ladder* ladder[3];
  bool is_signed[3];
  bool high[3];
  bool stochastic;
};

// The moving averages of `len` values of a block, decoded into `local`,
// stepped as the bfloat16 loops above step them; `largest[k]` receives the
// largest eight_bit::magnitude_bits of each new state, whence its block's
// scale (eight_bit::scale_from_magnitudes) with no pass of its own.
void step_block(float (*local)[kBlock], const float* __restrict__ g, int64_t len, int64_t count,
                const float* c, int32_t* largest) {
  const float b1 = c[kDecay1], w1 = c[kWeight1], b2 = c[kDecay2], w2 = c[kWeight2];
  float* __restrict__ m = local[0];
  int32_t largest_m = 0, largest_v = 0, largest_max = 0;
  if (count == 1) {
    for (int64_t i = 0; i < len; ++i) {
      m[i] = b1 * m[i] + w1 * g[i];
      largest_m = std::max(largest_m, eight_bit::magnitude_bits(m[i]));
    }
    largest[0] = largest_m;
    return;
  }
  float* __restrict__ v = local[1];
  for (int64_t i = 0; i < len; ++i) {
    const float grad = g[i];
    m[i] = b1 * m[i] + w1 * grad;
    v[i] = b2 * v[i] + w2 * (grad * grad);
    largest_m = std::max(largest_m, eight_bit::magnitude_bits(m[i]));
    largest_v = std::max(largest_v, eight_bit::magnitude_bits(v[i]));
  }
  largest[0] = largest_m;
  largest[1] = largest_v;
  if (count == 3) {
    float* __restrict__ running = local[2];
    for (int64_t i = 0; i < len; ++i) {
      running[i] = nan_maximum(running[i], v[i]);
      largest_max = std::max(largest_max, eight_bit::magnitude_bits(running[i]));
    }
    largest[2] = largest_max;
  }
}

// Blocks [first, first + n) of one parameter: each decoded, stepped and
// encoded, in one pass over its memory.
void step_blocks(const EightBitLeaf& leaf, int64_t count, const EightBitRule& rule, const float* c,
                 int64_t first, int64_t n) {
  alignas(64) float local[3][kBlock];
  alignas(64) uint32_t hashes[kBlock];
  for (int64_t b = first; b < first + n; ++b) {
    const int64_t lo = b * kBlock, len = std::min(leaf.size, lo + kBlock) - lo;
    for (int64_t k = 0; k < count; ++k) {
      eight_bit::decode_block(local[k], leaf.codes_in[k] + lo, len, leaf.scales_in[k][b],
                              *rule.ladder[k], rule.is_signed[k]);
    }
    int32_t largest[3];
    step_block(local, leaf.grad + lo, len, count, c, largest);
    for (int64_t k = 0; k < count; ++k) {
      const float scale =
          eight_bit::scale_from_magnitudes(largest[k], local[k], static_cast<int>(len));
      leaf.scales_out[k][b] = scale;
      if (rule.stochastic && !rule.high[k]) {  // a high state follows the first
        eight_bit::block_hashes<kWrap>(hashes, lo, len, leaf.seeds[k]);
      }
      eight_bit::encode_block_at_scale(leaf.codes_out[k] + lo, local[k], len, scale,
                                       *rule.ladder[k], rule.is_signed[k],
                                       rule.stochastic ? hashes : nullptr, rule.high[k]);
    }
  }
}

// StoreEightBitState's work, once its arguments' counts are checked.
ffi::Error step_all_eight_bit(ffi::Buffer<ffi::F32> coefficients, ffi::Buffer<ffi::U32> seeds,
                              const EightBitRule& rule, const ffi::RemainingArgs& arrays,
                              const ffi::RemainingRets& stepped, int64_t count, int64_t leaves) {
  std::vector<EightBitLeaf> all(leaves);
  std::vector<int64_t> starts(leaves + 1, 0);  // where each parameter's blocks begin
  for (int64_t l = 0; l < leaves; ++l) {
    auto grad = arrays.get<ffi::Buffer<ffi::F32>>(l);
    if (!grad.has_value()) return ffi::Error::InvalidArgument("qhoptim's 8-bit state: float32 gradients");
    EightBitLeaf& leaf = all[l];
    leaf.grad = grad->typed_data();
    leaf.size = static_cast<int64_t>(grad->element_count());
    leaf.seeds = seeds.typed_data() + l * count;
    const int64_t blocks = (leaf.size + kBlock - 1) / kBlock;
    for (int64_t k = 0; k < count; ++k) {
      const int64_t at = 2 * (l * count + k);  // this state's codes, then its scales
      auto codes_in = arrays.get<ffi::Buffer<ffi::U8>>(leaves + at);
      auto scales_in = arrays.get<ffi::Buffer<ffi::F32>>(leaves + at + 1);
      auto codes_out = stepped.get<ffi::Buffer<ffi::U8>>(at);
      auto scales_out = stepped.get<ffi::Buffer<ffi::F32>>(at + 1);
      if (!codes_in.has_value() || !scales_in.has_value() || !codes_out.has_value() ||
          !scales_out.has_value()) {
        return ffi::Error::InvalidArgument("qhoptim's 8-bit state: uint8 codes and float32 scales");
      }
      if (static_cast<int64_t>(codes_in->element_count()) != leaf.size ||
          static_cast<int64_t>((*codes_out)->element_count()) != leaf.size ||
          static_cast<int64_t>(scales_in->element_count()) != blocks ||
          static_cast<int64_t>((*scales_out)->element_count()) != blocks) {
        return ffi::Error::InvalidArgument(
            "qhoptim's 8-bit state: a code for each value, a scale for each block of 256");
      }
      leaf.codes_in[k] = codes_in->typed_data();
      leaf.scales_in[k] = scales_in->typed_data();
      leaf.codes_out[k] = (*codes_out)->typed_data();
      leaf.scales_out[k] = (*scales_out)->typed_data();
    }
    starts[l + 1] = starts[l] + blocks;
  }
  const float* c = coefficients.typed_data();
  qhoptim::slices::for_each_slice(
      starts[leaves],
      [&](int64_t first, int64_t n) {
        int64_t l = std::upper_bound(starts.begin(), starts.end(), first) - starts.begin() - 1;
        for (int64_t end = first + n; first < end; ++l) {
          const int64_t stop = std::min(end, starts[l + 1]);
          if (stop > first) step_blocks(all[l], count, rule, c, first - starts[l], stop - first);
          first = stop;
        }
      },
      kBlock);
  return ffi::Error::Success();
}

// StoreBFloat16State for 8-bit states (qhoptim.optax.EightBitArray):
// arguments the coefficients, the seeds, the signed and the unsigned ladder
// (qhoptim.rounding.eight_bit_levels, float32), the gradients, then each
// parameter's states as codes and scales; results the new codes and scales
// in the same order. `per_octave` is the ladders' levels per halving,
// `stochastic` whether values round stochastically (1) or to nearest (0).
ffi::Error StoreEightBitState(ffi::Buffer<ffi::F32> coefficients, ffi::Buffer<ffi::U32> seeds,
                              ffi::Buffer<ffi::F32> signed_levels, ffi::Buffer<ffi::F32> unsigned_levels,
                              ffi::RemainingArgs arrays, ffi::RemainingRets stepped, int64_t count,
                              int64_t per_octave, int64_t stochastic) {
  const int64_t args = static_cast<int64_t>(arrays.size());
  if (count < 1 || count > 3 || args % (2 * count + 1) != 0 || coefficients.element_count() != 4) {
    return ffi::Error::InvalidArgument("qhoptim's 8-bit state: 1 to 3 states a parameter, 4 coefficients");
  }
  const int64_t leaves = args / (2 * count + 1);
  if (static_cast<int64_t>(stepped.size()) != 2 * leaves * count ||
      static_cast<int64_t>(seeds.element_count()) != leaves * count) {
    return ffi::Error::InvalidArgument("qhoptim's 8-bit state: codes and scales and a seed for each state");
  }
  const int64_t signed_count = static_cast<int64_t>(signed_levels.element_count());
  const int64_t unsigned_count = static_cast<int64_t>(unsigned_levels.element_count());
  // Every code a byte can hold names a level: 128 signed (bit 7 the sign), 256 unsigned.
  if (signed_count != 128 || unsigned_count != 256 || !eight_bit::ladder_fits(signed_count, per_octave) ||
      !eight_bit::ladder_fits(unsigned_count, per_octave)) {
    return ffi::Error::InvalidArgument("qhoptim's 8-bit state: 128 signed and 256 unsigned levels, 1 to 255 per octave");
  }
  try {
    const eight_bit::Ladder with_sign = eight_bit::ladder_of_levels(
        signed_levels.typed_data(), static_cast<int>(signed_count), static_cast<int>(per_octave));
    const eight_bit::Ladder without = eight_bit::ladder_of_levels(
        unsigned_levels.typed_data(), static_cast<int>(unsigned_count), static_cast<int>(per_octave));
    const EightBitRule rule{
        {&with_sign, &without, &without}, {true, false, false}, {false, true, false}, stochastic != 0};
    return step_all_eight_bit(coefficients, seeds, rule, arrays, stepped, count, leaves);
  } catch (const std::exception& error) {  // no exception crosses into XLA
    return ffi::Error::Internal(std::string("qhoptim's 8-bit state: ") + error.what());
  }
}

}  // namespace

// The symbols the library exports (it is built with -fvisibility=hidden);
// qhoptim/optax/_extension.py registers them as XLA custom call targets.
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* QHoptimStoreBFloat16State(XLA_FFI_CallFrame*);
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* QHoptimStoreEightBitState(XLA_FFI_CallFrame*);

XLA_FFI_DEFINE_HANDLER_SYMBOL(QHoptimStoreBFloat16State, StoreBFloat16State,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("states"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(QHoptimStoreEightBitState, StoreEightBitState,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("states")
                                  .Attr<int64_t>("per_octave")
                                  .Attr<int64_t>("stochastic"));
