// qhoptim's fused CPU kernels: one pass over memory per tensor for a whole
// QHM or QHAdam step (read p, g and the state once, write p and the state
// once), vectorized by the compiler and parallel over elements.
//
// The coefficients are computed in Python by qhoptim.rules (qhm_coefficients,
// qhadam_coefficients folded by fold_qhadam) and passed in; these loops only
// apply them. Low-precision parameters (float16, bfloat16) are computed in
// float32, float32 and float64 in their own precision.

#include <torch/extension.h>

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kGrain = 1 << 15;

template <typename T>
struct type_tag {
  using type = T;
};

// torch.maximum's: NaN if either is NaN (as the foreach path's _foreach_maximum_).
template <typename T>
inline T nan_max(T a, T b) {
  return (a != a || b != b) ? a + b : (a < b ? b : a);
}

// torch.lerp's formula, so that the fused moments round as the foreach ones:
// LOW (weight < 0.5) computes from `start`, else from `end`. The side is a
// template argument, chosen once per tensor: a select on the weight inside the
// loop kept the bfloat16 state's loops from vectorizing, at 4x the time.
template <bool LOW, typename T>
inline T lerp(T start, T end, T weight) {
  if constexpr (LOW) {
    return start + weight * (end - start);
  } else {
    return end - (end - start) * (T(1) - weight);
  }
}

// grads: the gradients, of the parameters' dtype; states: the state lists, of
// the parameters' dtype or all of `state_dtype` (a narrower bfloat16 state).
void check_lists(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                 const std::vector<std::vector<at::Tensor>>& states, bool narrow) {
  TORCH_CHECK(grads.size() == params.size(), "qhoptim fused: tensor lists differ in length");
  for (const auto& list : states) {
    TORCH_CHECK(list.size() == params.size(), "qhoptim fused: tensor lists differ in length");
  }
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK(params[i].is_contiguous(), "qhoptim fused: parameters must be contiguous");
    TORCH_CHECK(grads[i].is_contiguous() && grads[i].numel() == params[i].numel() &&
                    grads[i].scalar_type() == params[i].scalar_type(),
                "qhoptim fused: gradients must match their parameter");
    for (const auto& list : states) {
      const auto want = narrow ? at::kBFloat16 : params[i].scalar_type();
      TORCH_CHECK(list[i].is_contiguous() && list[i].numel() == params[i].numel() &&
                      list[i].scalar_type() == want,
                  "qhoptim fused: the state must match its parameter (or be bfloat16 state)");
    }
  }
}

// A 32-bit hash of a seed and an element's position (lowbias32's mixer): the
// stochastic rounding's noise, counter-based (qhoptim.rounding.noise16).
// qhoptim.torch._state_dtype.hash32 computes the same numbers with torch's
// integer ops for the other paths.
inline uint32_t hash32(uint32_t seed, uint32_t position) {
  uint32_t x = position * 0x9E3779B9u ^ seed;
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

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

// f(fold, low) with both flags as compile-time constants (std::bool_constant).
// A fold is only ever needed by a bfloat16 state's chunk past 2**32 values.
template <typename F>
inline void with_flags(bool fold, bool low, F&& f) {
  if (fold) {
    low ? f(std::true_type{}, std::true_type{}) : f(std::true_type{}, std::false_type{});
  } else {
    low ? f(std::false_type{}, std::true_type{}) : f(std::false_type{}, std::false_type{});
  }
}

// A state value stored: in the state's own dtype, or (SR) a float32 value
// rounded stochastically to bfloat16 -- the low 16 bits of its pattern plus
// 16 random bits carry into the kept half exactly as often as they are
// large, which makes the rounding unbiased.
template <typename state_t, bool SR, typename opmath_t>
inline state_t store(opmath_t value, uint32_t seed, uint32_t position) {
  if constexpr (SR) {
    const float f = static_cast<float>(value);
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof(bits));
    bits = (bits + (hash32(seed, position) & 0xFFFFu)) & 0xFFFF0000u;
    return c10::BFloat16(static_cast<uint16_t>(bits >> 16), c10::BFloat16::from_bits());
  } else {
    return static_cast<state_t>(value);
  }
}

// The gradient with coupled weight decay, g + wd * p (COUPLED), or g itself
// where wd is 0: a NaN or infinite parameter (0 * NaN is NaN) then leaves its
// state alone, as in the multi-tensor kernels. A compile-time flag, so that no
// branch keeps the loops from vectorizing.
template <bool COUPLED, typename opmath_t>
inline opmath_t coupled_gradient(opmath_t g, opmath_t wd, opmath_t p) {
  if constexpr (COUPLED) {
    return g + wd * p;
  } else {
    return g;
  }
}

// The gradient the loops read: a copy of one that overlaps its parameter's memory
// (`p.grad = p.detach()`, the gradient of |p|^2 / 2, or a view of p), which the
// loop would otherwise read after writing p, and which the compiler is told
// (__restrict__) cannot happen. Two comparisons per tensor; only an overlapping
// gradient is copied.
at::Tensor readable_grad(const at::Tensor& param, const at::Tensor& grad) {
  const auto* p = static_cast<const char*>(param.data_ptr());
  const auto* g = static_cast<const char*>(grad.data_ptr());
  const auto bytes = static_cast<std::ptrdiff_t>(param.numel() * param.element_size());
  return (g < p + bytes && p < g + bytes) ? grad.clone() : grad;
}

// One chunk of a QHM step. The pointers do not alias and the coefficients are
// values, so the compiler vectorizes the loop without run-time checks. `first`
// is the chunk's position in the tensor (the rounding noise's counter).
template <typename scalar_t, typename state_t, bool SR, typename opmath_t, bool FOLD, bool LOW,
          bool COUPLED>
void qhm_chunk(scalar_t* __restrict__ p, const scalar_t* __restrict__ g, state_t* __restrict__ b,
               int64_t first, int64_t n, opmath_t gm, opmath_t wd, opmath_t df, opmath_t w,
               opmath_t bv, opmath_t gv, uint32_t seed) {
  for (int64_t i = 0; i < n; ++i) {
    const opmath_t pi = static_cast<opmath_t>(p[i]);
    const opmath_t gi = coupled_gradient<COUPLED>(static_cast<opmath_t>(g[i]) * gm, wd, pi);
    const opmath_t bi = lerp<LOW>(static_cast<opmath_t>(b[i]), gi, w);
    b[i] = store<state_t, SR>(bi, seed, position_of<FOLD>(first, i));
    p[i] = static_cast<scalar_t>(pi * df + bv * bi + gv * gi);
  }
}

template <typename scalar_t, typename state_t, bool SR>
void qhm_tensor(at::Tensor& param, const at::Tensor& grad, at::Tensor& buf, double grad_multiplier,
                double coupled_weight_decay, double decay_factor, double grad_to_buffer,
                double buffer_value, double grad_value, uint32_t seed) {
  using opmath_t = at::opmath_type<scalar_t>;
  scalar_t* p = param.data_ptr<scalar_t>();
  const scalar_t* g = grad.data_ptr<scalar_t>();
  state_t* b = buf.data_ptr<state_t>();
  const opmath_t gm = grad_multiplier, wd = coupled_weight_decay, df = decay_factor,
                 w = grad_to_buffer, bv = buffer_value, gv = grad_value;
  const bool low = w < opmath_t(0.5);
  const bool coupled = wd != opmath_t(0);
  at::parallel_for(0, param.numel(), kGrain, [=](int64_t begin, int64_t end) {
    auto chunk = [&](auto fold_tag, auto low_tag) {
      auto run = [&](auto coupled_tag) {
        qhm_chunk<scalar_t, state_t, SR, opmath_t, decltype(fold_tag)::value,
                  decltype(low_tag)::value, decltype(coupled_tag)::value>(
            p + begin, g + begin, b + begin, begin, end - begin, gm, wd, df, w, bv, gv, seed);
      };
      coupled ? run(std::true_type{}) : run(std::false_type{});
    };
    with_flags(SR && needs_fold(begin, end - begin), low, chunk);
  });
}

// One chunk of a QHAdam step. FORM: 0 reads the second moment alone, 1 the
// gradient alone, 2 both (qhoptim.rules.Denominator EXP_AVG_SQ, GRAD, MIX).
// AMSGRAD: v keeps the running maximum of the (uncorrected) second moment,
// which the denominator reads in its place (qhoptim.rules.qhadam_amsgrad_update,
// with the same folded coefficients); without it v is unused.
template <typename scalar_t, typename state_t, bool SR, typename opmath_t, int FORM, bool AMSGRAD,
          bool FOLD, bool LOW, bool COUPLED>
void qhadam_chunk(scalar_t* __restrict__ p, const scalar_t* __restrict__ g,
                  state_t* __restrict__ m, state_t* __restrict__ s, state_t* __restrict__ v,
                  int64_t first, int64_t n, opmath_t gm, opmath_t wd, opmath_t df, opmath_t w1,
                  opmath_t b2, opmath_t w2, opmath_t sw, opmath_t gw, opmath_t eps, opmath_t mv,
                  opmath_t gv, const uint32_t* seeds) {
  // The seeds as values: loads through a pointer beside the state's stores
  // would keep the loop from vectorizing.
  const uint32_t seed_m = seeds[0], seed_s = seeds[1], seed_v = seeds[2];
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t at = position_of<FOLD>(first, i);
    const opmath_t pi = static_cast<opmath_t>(p[i]);
    const opmath_t gi = coupled_gradient<COUPLED>(static_cast<opmath_t>(g[i]) * gm, wd, pi);
    const opmath_t mi = lerp<LOW>(static_cast<opmath_t>(m[i]), gi, w1);
    const opmath_t si = b2 * static_cast<opmath_t>(s[i]) + w2 * gi * gi;
    // What the denominator reads: the second moment, or its running maximum.
    opmath_t di = si;
    if constexpr (AMSGRAD) {
      di = nan_max(static_cast<opmath_t>(v[i]), si);
      v[i] = store<state_t, SR>(di, seed_v, at);
    }
    opmath_t base;
    if constexpr (FORM == 0) {
      base = std::sqrt(sw * di);
    } else if constexpr (FORM == 1) {
      base = std::sqrt(gw * (gi * gi));
    } else {
      base = std::sqrt(sw * di + gw * (gi * gi));
    }
    m[i] = store<state_t, SR>(mi, seed_m, at);
    s[i] = store<state_t, SR>(si, seed_s, at);
    p[i] = static_cast<scalar_t>(pi * df + (mv * mi + gv * gi) / (base + eps));
  }
}

template <typename scalar_t, typename state_t, bool SR, int FORM, bool AMSGRAD>
void qhadam_tensor(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg,
                   at::Tensor& exp_avg_sq, at::Tensor* max_exp_avg_sq, const double* c,
                   double grad_multiplier, double coupled_weight_decay, double decay_factor,
                   double exp_avg_lerp, double beta2, double one_minus_beta2,
                   const uint32_t* seeds) {
  using opmath_t = at::opmath_type<scalar_t>;
  scalar_t* p = param.data_ptr<scalar_t>();
  const scalar_t* g = grad.data_ptr<scalar_t>();
  state_t* m = exp_avg.data_ptr<state_t>();
  state_t* s = exp_avg_sq.data_ptr<state_t>();
  state_t* v = AMSGRAD ? max_exp_avg_sq->data_ptr<state_t>() : nullptr;
  const opmath_t gm = grad_multiplier, wd = coupled_weight_decay, df = decay_factor,
                 w1 = exp_avg_lerp, b2 = beta2, w2 = one_minus_beta2;
  // FoldedQHAdam: exp_avg_sq_weight, grad_sq_weight, eps, exp_avg_value, grad_value
  const opmath_t sw = c[0], gw = c[1], eps = c[2], mv = c[3], gv = c[4];
  const bool low = w1 < opmath_t(0.5);
  const bool coupled = wd != opmath_t(0);
  at::parallel_for(0, param.numel(), kGrain, [=](int64_t begin, int64_t end) {
    auto chunk = [&](auto fold_tag, auto low_tag) {
      auto run = [&](auto coupled_tag) {
        qhadam_chunk<scalar_t, state_t, SR, opmath_t, FORM, AMSGRAD, decltype(fold_tag)::value,
                     decltype(low_tag)::value, decltype(coupled_tag)::value>(
            p + begin, g + begin, m + begin, s + begin, AMSGRAD ? v + begin : nullptr, begin,
            end - begin, gm, wd, df, w1, b2, w2, sw, gw, eps, mv, gv, seeds);
      };
      coupled ? run(std::true_type{}) : run(std::false_type{});
    };
    with_flags(SR && needs_fold(begin, end - begin), low, chunk);
  });
}

// The seeds of a bfloat16 state's rounding: `seeds` is an int64 tensor [n, 3]
// (one per state list and tensor, as qhoptim.torch._state_dtype.rounding_seed
// makes them), or empty for a state of the parameters' dtype.
std::vector<uint32_t> seed_table(const at::Tensor& seeds, size_t n) {
  std::vector<uint32_t> out(3 * n, 0);
  if (seeds.numel() == 0) {
    return out;
  }
  TORCH_CHECK(seeds.scalar_type() == at::kLong && seeds.is_contiguous() &&
                  seeds.numel() == static_cast<int64_t>(n) * 3,
              "qhoptim fused: seeds must be a contiguous int64 tensor [n, 3]");
  const int64_t* s = seeds.data_ptr<int64_t>();
  for (size_t i = 0; i < 3 * n; ++i) {
    out[i] = static_cast<uint32_t>(s[i]);
  }
  return out;
}

}  // namespace

void qhm_(std::vector<at::Tensor> params, std::vector<at::Tensor> grads,
          std::vector<at::Tensor> momentum_buffers, double grad_multiplier,
          double coupled_weight_decay, double decay_factor, double grad_to_buffer,
          double buffer_value, double grad_value, at::Tensor seeds) {
  const bool narrow = seeds.numel() > 0;
  check_lists(params, grads, {momentum_buffers}, narrow);
  TORCH_CHECK(!narrow || std::all_of(params.begin(), params.end(),
                                     [](const at::Tensor& p) { return p.scalar_type() == at::kFloat; }),
              "qhoptim fused: a bfloat16 state is for float32 parameters");
  const std::vector<uint32_t> seed = seed_table(seeds, params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor grad = readable_grad(params[i], grads[i]);
    if (narrow) {
      qhm_tensor<float, c10::BFloat16, true>(params[i], grad, momentum_buffers[i],
                                             grad_multiplier, coupled_weight_decay, decay_factor,
                                             grad_to_buffer, buffer_value, grad_value, seed[3 * i]);
      continue;
    }
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, params[i].scalar_type(), "qhm_", [&] {
      qhm_tensor<scalar_t, scalar_t, false>(params[i], grad, momentum_buffers[i], grad_multiplier,
                                            coupled_weight_decay, decay_factor, grad_to_buffer,
                                            buffer_value, grad_value, 0);
    });
  }
}

// max_exp_avg_sqs: the running maxima of the AMSGrad variant, or an empty list
// for plain QHAdam. seeds: see seed_table.
void qhadam_(std::vector<at::Tensor> params, std::vector<at::Tensor> grads,
             std::vector<at::Tensor> exp_avgs, std::vector<at::Tensor> exp_avg_sqs,
             std::vector<at::Tensor> max_exp_avg_sqs, at::Tensor coefficients, int64_t form,
             double grad_multiplier, double coupled_weight_decay, double decay_factor,
             double exp_avg_lerp, double beta2, double one_minus_beta2, at::Tensor seeds) {
  const bool amsgrad = !max_exp_avg_sqs.empty();
  const bool narrow = seeds.numel() > 0;
  if (amsgrad) {
    check_lists(params, grads, {exp_avgs, exp_avg_sqs, max_exp_avg_sqs}, narrow);
  } else {
    check_lists(params, grads, {exp_avgs, exp_avg_sqs}, narrow);
  }
  TORCH_CHECK(!narrow || std::all_of(params.begin(), params.end(),
                                     [](const at::Tensor& p) { return p.scalar_type() == at::kFloat; }),
              "qhoptim fused: a bfloat16 state is for float32 parameters");
  TORCH_CHECK(coefficients.scalar_type() == at::kDouble && coefficients.is_contiguous() &&
                  coefficients.numel() == static_cast<int64_t>(params.size()) * 5,
              "qhoptim fused: coefficients must be a contiguous float64 tensor [n, 5]");
  TORCH_CHECK(form >= 0 && form <= 2, "qhoptim fused: unknown denominator form");
  const double* c = coefficients.data_ptr<double>();
  const std::vector<uint32_t> seed = seed_table(seeds, params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor grad = readable_grad(params[i], grads[i]);
    at::Tensor* maxes = amsgrad ? &max_exp_avg_sqs[i] : nullptr;
    // One kernel per parameter, state dtype, rounding, denominator form and amsgrad.
    auto run = [&](auto scalar_tag, auto state_tag, auto sr_tag) {
      using scalar_t = typename decltype(scalar_tag)::type;
      using state_t = typename decltype(state_tag)::type;
      constexpr bool kSR = decltype(sr_tag)::value;
      auto with_form = [&](auto form_tag) {
        constexpr int kForm = decltype(form_tag)::value;
        if (amsgrad) {
          qhadam_tensor<scalar_t, state_t, kSR, kForm, true>(
              params[i], grad, exp_avgs[i], exp_avg_sqs[i], maxes, c + 5 * i, grad_multiplier,
              coupled_weight_decay, decay_factor, exp_avg_lerp, beta2, one_minus_beta2,
              seed.data() + 3 * i);
        } else {
          qhadam_tensor<scalar_t, state_t, kSR, kForm, false>(
              params[i], grad, exp_avgs[i], exp_avg_sqs[i], nullptr, c + 5 * i, grad_multiplier,
              coupled_weight_decay, decay_factor, exp_avg_lerp, beta2, one_minus_beta2,
              seed.data() + 3 * i);
        }
      };
      if (form == 0) {
        with_form(std::integral_constant<int, 0>{});
      } else if (form == 1) {
        with_form(std::integral_constant<int, 1>{});
      } else {
        with_form(std::integral_constant<int, 2>{});
      }
    };
    if (narrow) {
      run(type_tag<float>{}, type_tag<c10::BFloat16>{}, std::true_type{});
      continue;
    }
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, params[i].scalar_type(), "qhadam_", [&] {
      run(type_tag<scalar_t>{}, type_tag<scalar_t>{}, std::false_type{});
    });
  }
}

// dst (bfloat16) <- src (float32) rounded stochastically with `seed`, the
// elements counted from `start` (src a slice of a tensor that starts there):
// the working-copy paths' write-back (qhoptim.torch._state_dtype.stochastic_round_).
void stochastic_round_(at::Tensor dst, at::Tensor src, int64_t seed, int64_t start) {
  TORCH_CHECK(dst.scalar_type() == at::kBFloat16 && src.scalar_type() == at::kFloat &&
                  dst.is_contiguous() && src.is_contiguous() && dst.numel() == src.numel() &&
                  dst.device().is_cpu() && src.device().is_cpu(),
              "qhoptim stochastic_round_: a contiguous bfloat16 CPU tensor and a float32 one");
  c10::BFloat16* d = dst.data_ptr<c10::BFloat16>();
  const float* x = src.data_ptr<float>();
  const auto s = static_cast<uint32_t>(seed);
  at::parallel_for(0, src.numel(), kGrain, [=](int64_t begin, int64_t end) {
    auto chunk = [&](auto fold_tag, auto) {
      constexpr bool kFold = decltype(fold_tag)::value;
      for (int64_t i = 0; i < end - begin; ++i) {
        d[begin + i] = store<c10::BFloat16, true>(x[begin + i], s,
                                                  position_of<kFold>(start + begin, i));
      }
    };
    with_flags(needs_fold(start + begin, end - begin), false, chunk);
  });
}

// An 8-bit blockwise state (qhoptim.torch._state_dtype.quantize_ / dequantize_,
// the torch-operations statement of the same arithmetic; a test holds the two
// to the same bytes). `levels` are qhoptim.rounding.eight_bit_levels: 0 and a
// geometric ladder to 1, ascending; a signed state's codes keep the sign in
// their top bit. Each block of kBlock values has a float32 scale, its largest
// magnitude (NaN if it holds one).
constexpr int64_t kBlock = 256;

// The codes of non-finite values (qhoptim.rounding.EIGHT_BIT_NON_FINITE): a
// signed state's NaN or infinity (its "-0", otherwise unused) reads back as
// NaN; an unsigned one's (a second moment that overflowed) as +inf, as a
// float32 state would hold it. The block's other values keep their scale.
constexpr int kSignedNonFinite = 128;
constexpr int kUnsignedInfinite = 1;

void check_eight_bit(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& values,
                     const at::Tensor& levels) {
  const int64_t n = values.numel();
  TORCH_CHECK(codes.scalar_type() == at::kByte && scales.scalar_type() == at::kFloat &&
                  values.scalar_type() == at::kFloat && levels.scalar_type() == at::kFloat &&
                  codes.is_contiguous() && scales.is_contiguous() && values.is_contiguous() &&
                  levels.is_contiguous() && codes.numel() == n &&
                  scales.numel() == (n + kBlock - 1) / kBlock && levels.numel() >= 2 &&
                  codes.device().is_cpu() && values.device().is_cpu(),
              "qhoptim 8-bit state: uint8 codes, float32 scales and values on the CPU");
}

void quantize8_(at::Tensor codes, at::Tensor scales, at::Tensor values, at::Tensor levels,
                bool is_signed, int64_t seed, bool stochastic, int64_t start, int64_t per_octave) {
  check_eight_bit(codes, scales, values, levels);
  uint8_t* c = codes.data_ptr<uint8_t>();
  float* sc = scales.data_ptr<float>();
  const float* x = values.data_ptr<float>();
  const float* lv = levels.data_ptr<float>();
  const int64_t nl = levels.numel(), n = values.numel();
  const auto s = static_cast<uint32_t>(seed);
  at::parallel_for(0, scales.numel(), 64, [=](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo = b * kBlock, hi = std::min(n, lo + kBlock);
      // The block's scale: its largest finite magnitude. A NaN or an infinity
      // takes its own code (below) and leaves the others' scale alone.
      float scale = 0.0f;
      for (int64_t i = lo; i < hi; ++i) {
        const float a = std::fabs(x[i]);
        scale = a <= std::numeric_limits<float>::max() ? std::max(scale, a) : scale;
      }
      sc[b] = scale;
      const bool fold = needs_fold(start + lo, hi - lo);
      for (int64_t i = lo; i < hi; ++i) {
        if (!(std::fabs(x[i]) <= std::numeric_limits<float>::max())) {  // NaN, inf
          c[i] = static_cast<uint8_t>(is_signed ? kSignedNonFinite : kUnsignedInfinite);
          continue;
        }
        float ratio = std::fabs(x[i]) / scale;
        if (ratio != ratio) {
          ratio = 0.0f;  // 0/0 in an all-zero block
        }
        // The last level <= ratio (the table decides): a first guess of
        // per_octave * log2(ratio) from the float's exponent and the top of its
        // mantissa (within a level of the truth), then a step along the table,
        // in place of a binary search per value.
        uint32_t bits;
        std::memcpy(&bits, &ratio, sizeof(bits));
        const int64_t octave = static_cast<int64_t>(bits >> 23) - 127;
        const int64_t eighths = (static_cast<int64_t>(bits & 0x7FFFFFu) * per_octave) >> 23;
        // The guess is at most one level below (log2(1 + f) >= f), or one
        // above where a level's float32 rounding lies past the ratio: one step
        // each way, without branches.
        int64_t low = nl - 1 + per_octave * octave + eighths;
        low = std::min<int64_t>(std::max<int64_t>(low, 1), nl - 2);
        low -= lv[low] > ratio ? 1 : 0;
        low += lv[low + 1] <= ratio ? 1 : 0;
        low = std::min<int64_t>(low, nl - 2);
        const float up = (ratio - lv[low]) / (lv[low + 1] - lv[low]);
        const uint32_t at = fold ? position_of<true>(start, i) : position_of<false>(start, i);
        const float threshold =
            stochastic ? static_cast<float>(hash32(s, at) & 0xFFFFu) / 65536.0f : 0.5f;
        int64_t code = low + (up > threshold ? 1 : 0);
        if (is_signed) {
          code += (x[i] < 0.0f && code > 0) ? 128 : 0;  // no -0: 128 is non-finite's
        } else if (code <= kUnsignedInfinite && ratio > 0.0f) {
          // A positive second moment is never stored as 0 (nor as the code of inf).
          code = kUnsignedInfinite + 1;
        }
        c[i] = static_cast<uint8_t>(code);
      }
    }
  });
}

void dequantize8_(at::Tensor values, at::Tensor codes, at::Tensor scales, at::Tensor levels,
                  bool is_signed) {
  check_eight_bit(codes, scales, values, levels);
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const float* sc = scales.data_ptr<float>();
  float* x = values.data_ptr<float>();
  const float* lv = levels.data_ptr<float>();
  const int64_t n = values.numel();
  at::parallel_for(0, scales.numel(), 64, [=](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float scale = sc[b];
      for (int64_t i = b * kBlock; i < std::min(n, (b + 1) * kBlock); ++i) {
        const int code = c[i];
        const float value = lv[is_signed ? (code & 127) : code] * scale;
        if (is_signed) {
          x[i] = code == kSignedNonFinite ? NAN : (code > 128 ? -value : value);
        } else {
          x[i] = code == kUnsignedInfinite ? INFINITY : value;
        }
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qhm_", &qhm_, "One fused QHM step over a list of CPU tensors, in place.");
  m.def("qhadam_", &qhadam_, "One fused QHAdam step over a list of CPU tensors, in place.");
  m.def("quantize8_", &quantize8_, "Encode float32 values as an 8-bit blockwise state.");
  m.def("dequantize8_", &dequantize8_, "Decode an 8-bit blockwise state to float32.");
  m.def("stochastic_round_", &stochastic_round_,
        "Round a float32 CPU tensor to bfloat16 stochastically (qhoptim.rounding).");
}
