// qhoptim's fused CPU kernels: one pass over memory per tensor for a whole
// QHM or QHAdam step (read p, g and the state once, write p and the state
// once), vectorized by the compiler and parallel over elements.
//
// The coefficients are computed in Python by qhoptim.rules (qhm_coefficients,
// qhadam_coefficients folded by fold_qhadam) and passed in; these loops only
// apply them. Low-precision parameters (float16, bfloat16) are computed in
// float32, float32 and float64 in their own precision.

// ATen's Tensor and pybind11 with torch's type casters, not <torch/extension.h>:
// that header brings all of libtorch's C++ API and is two thirds of a first
// build's compile time (37 s against 24 s here for one vector width).
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "eight_bit.h"  // qhoptim/csrc, on the include path
#include "rounding.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

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

// The stochastic rounding's hash of a seed and an element's key, key =
// position * kGolden (mod 2**32; see position_key), and its rounding to
// bfloat16: qhoptim/csrc/rounding.h, shared with the MLX backend's kernel.
// qhoptim.torch._state_dtype.hash32 computes the same numbers with torch's
// integer ops for the other paths.
using qhoptim::rounding::hash32_of_key;
using qhoptim::rounding::kGolden;
using qhoptim::rounding::needs_fold;
using qhoptim::rounding::position_key;

// The keys of a chunk's elements, one after the other (next() once per
// element): below 2**32 a 32-bit induction variable, which the vectorized
// loops advance by one addition per vector; a key from each index instead
// costs them a multiplication and 64-bit index arithmetic per vector.
template <bool FOLD>
class PositionKeys {
 public:
  explicit PositionKeys(int64_t first) : first_(first), key_(position_key<FOLD>(first, 0)) {}
  uint32_t next() {
    if constexpr (FOLD) {
      return position_key<true>(first_, index_++);
    } else {
      const uint32_t key = key_;
      key_ += kGolden;
      return key;
    }
  }

 private:
  int64_t first_;
  int64_t index_ = 0;
  uint32_t key_;
};

// A state value stored: in the state's own dtype, or (SR) a float32 value
// rounded stochastically to bfloat16 (qhoptim::rounding::bfloat16_bits).
template <typename state_t, bool SR, typename opmath_t>
inline state_t store(opmath_t value, uint32_t seed, uint32_t key) {
  if constexpr (SR) {
    const uint16_t bits = qhoptim::rounding::bfloat16_bits(static_cast<float>(value), seed, key);
    return c10::BFloat16(bits, c10::BFloat16::from_bits());
  } else {
    return static_cast<state_t>(value);
  }
}

// Which of a step's optional terms a loop computes, chosen once per tensor as
// a compile-time argument, so that no branch keeps the loops from vectorizing
// and none multiplies by one:
//   kBare     the gradient as it is and the parameter undecayed (no grad scale,
//             not maximize, no weight decay: the common case);
//   kScaled   the gradient times its multiplier gm (GradScaler's 1 / scale,
//             -1 to maximize), the parameter times its decoupled decay df;
//   kCoupled  kScaled's, with coupled weight decay, g * gm + wd * p.
// Where wd is 0 the gradient is not g + 0 * p: a NaN or infinite parameter
// (0 * NaN is NaN) then leaves its state alone, as in the multi-tensor
// kernels. kBare's values are kScaled's with gm = df = 1, bit for bit (x * 1
// is x, also inside a fused multiply-add).
enum Terms : int { kBare, kScaled, kCoupled };

inline Terms terms_of(double grad_multiplier, double coupled_weight_decay, double decay_factor) {
  if (coupled_weight_decay != 0) {
    return kCoupled;
  }
  return grad_multiplier == 1 && decay_factor == 1 ? kBare : kScaled;
}

// f(terms, low) with both as compile-time constants (std::integral_constant).
// BARE: whether kBare's loops are built; where not, kScaled's step those tensors
// (the same values). They are built for float32 parameters, whose steps are
// the ones that must be fast, and not for the other dtypes: a third set of
// loops for each would add a quarter to the build's time.
template <bool BARE, typename F>
inline void with_terms(Terms terms, bool low, F&& f) {
  auto with_low = [&](auto terms_tag) {
    low ? f(terms_tag, std::true_type{}) : f(terms_tag, std::false_type{});
  };
  if (terms == kCoupled) {
    with_low(std::integral_constant<int, kCoupled>{});
    return;
  }
  if constexpr (BARE) {
    if (terms == kBare) {
      with_low(std::integral_constant<int, kBare>{});
      return;
    }
  }
  with_low(std::integral_constant<int, kScaled>{});
}

// The gradient a step reads, g * gm (+ wd * p): see Terms.
template <int TERMS, typename opmath_t>
inline opmath_t step_gradient(opmath_t g, opmath_t gm, opmath_t wd, opmath_t p) {
  if constexpr (TERMS == kBare) {
    return g;
  } else if constexpr (TERMS == kScaled) {
    return g * gm;
  } else {
    return g * gm + wd * p;
  }
}

// The parameter a step starts from, p * df: see Terms.
template <int TERMS, typename opmath_t>
inline opmath_t decayed(opmath_t p, opmath_t df) {
  if constexpr (TERMS == kBare) {
    return p;
  } else {
    return p * df;
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

// The chunk loops stream their tensors from memory and ask for them ahead:
// before each span of kSpan values, the cache lines kAhead values further on.
// The hardware's prefetchers alone left the loops waiting: at 1e7 float32
// values (2 threads), asking ahead made QHM's step 9-13% faster with a float32
// buffer and 23-27% with a bfloat16 one (the rounding's arithmetic between the
// loads had kept fewer of them in flight), and kAhead = 2048 did better than
// 1024 and 4096. Requests stay inside the chunk: its last spans ask for
// nothing.
// That was an Intel Xeon. On AMD's EPYC (Zen 4) the requests cost time
// instead (benchmarks.kernel_ab, 2 threads, the same build with and without
// them): without, QHM's float32 step was 4-19% faster, the bfloat16 steps
// 10-22% and the 8-bit ones 11-24% -- its hardware prefetchers keep up with
// the streams alone, and the requests take load slots. So the loops ask on
// every CPU but AMD's (asks_ahead), the one where not asking was measured to
// be faster.
// The span loop and its requests are written out in each chunk: through a
// lambda, the pointers' __restrict__ was lost and the gain with it, and one
// variadic helper for the requests made the bfloat16 steps 5-13% slower
// (benchmarks.kernel_ab).
constexpr int64_t kSpan = 256;
constexpr int64_t kAhead = 2048;

// Whether the loops ask for memory ahead on this CPU (see above).
inline bool asks_ahead() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool asks = !__builtin_cpu_is("amd");
  return asks;
#else
  return true;
#endif
}

// Asks for the cache lines of x[0, kSpan); WRITE: they will be written too.
template <bool WRITE, typename T>
inline void ask_for_span(const T* x) {
  for (int64_t k = 0; k < kSpan; k += 64 / static_cast<int64_t>(sizeof(T))) {
    __builtin_prefetch(x + k, WRITE ? 1 : 0, 3);
  }
}

// One chunk of a QHM step. The pointers do not alias and the coefficients are
// values, so the compiler vectorizes the loop without run-time checks. `first`
// is the chunk's position in the tensor (the rounding noise's counter).
// SCALES: the chunk is an 8-bit block's, and `largest[0]` receives the
// magnitude_bits maximum of the buffer it writes (eight_bit_blocks).
template <typename scalar_t, typename state_t, bool SR, typename opmath_t, bool FOLD, bool LOW,
          int TERMS, bool SCALES = false>
void qhm_chunk(scalar_t* __restrict__ p, const scalar_t* __restrict__ g, state_t* __restrict__ b,
               int64_t first, int64_t n, opmath_t gm, opmath_t wd, opmath_t df, opmath_t w,
               opmath_t bv, opmath_t gv, uint32_t seed, int32_t* largest = nullptr) {
  [[maybe_unused]] int32_t largest_b = 0;
  PositionKeys<FOLD> keys(first);
  const bool asks = asks_ahead();
  const int64_t span = asks ? kSpan : n;
  for (int64_t begin = 0; begin < n; begin += span) {
    if (asks && begin + kAhead + kSpan <= n) {
      ask_for_span<true>(p + begin + kAhead);
      ask_for_span<false>(g + begin + kAhead);
      ask_for_span<true>(b + begin + kAhead);
    }
    const int64_t end = std::min(n, begin + span);
    for (int64_t i = begin; i < end; ++i) {
      const opmath_t pi = static_cast<opmath_t>(p[i]);
      const opmath_t gi = step_gradient<TERMS>(static_cast<opmath_t>(g[i]), gm, wd, pi);
      const opmath_t bi = lerp<LOW>(static_cast<opmath_t>(b[i]), gi, w);
      b[i] = store<state_t, SR>(bi, seed, keys.next());
      p[i] = static_cast<scalar_t>(decayed<TERMS>(pi, df) + bv * bi + gv * gi);
      if constexpr (SCALES) {
        largest_b = std::max(largest_b, qhoptim::eight_bit::magnitude_bits(bi));
      }
    }
  }
  if constexpr (SCALES) {
    largest[0] = largest_b;
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
  const Terms terms = terms_of(grad_multiplier, coupled_weight_decay, decay_factor);
  at::parallel_for(0, param.numel(), kGrain, [=](int64_t begin, int64_t end) {
    with_terms<std::is_same_v<scalar_t, float>>(terms, low, [&](auto terms_tag, auto low_tag) {
      auto run = [&](auto fold_tag) {
        qhm_chunk<scalar_t, state_t, SR, opmath_t, decltype(fold_tag)::value,
                  decltype(low_tag)::value, decltype(terms_tag)::value>(
            p + begin, g + begin, b + begin, begin, end - begin, gm, wd, df, w, bv, gv, seed);
      };
      SR && needs_fold(begin, end - begin) ? run(std::true_type{}) : run(std::false_type{});
    });
  });
}

// One chunk of a QHAdam step. FORM: 0 reads the second moment alone, 1 the
// gradient alone, 2 both (qhoptim.rules.Denominator EXP_AVG_SQ, GRAD, MIX).
// AMSGRAD: v keeps the running maximum of the (uncorrected) second moment,
// which the denominator reads in its place (qhoptim.rules.qhadam_amsgrad_update,
// with the same folded coefficients); without it v is unused. SCALES: as
// qhm_chunk's, `largest` receiving m's, s's and v's.
template <typename scalar_t, typename state_t, bool SR, typename opmath_t, int FORM, bool AMSGRAD,
          bool FOLD, bool LOW, int TERMS, bool SCALES = false>
void qhadam_chunk(scalar_t* __restrict__ p, const scalar_t* __restrict__ g,
                  state_t* __restrict__ m, state_t* __restrict__ s, state_t* __restrict__ v,
                  int64_t first, int64_t n, opmath_t gm, opmath_t wd, opmath_t df, opmath_t w1,
                  opmath_t b2, opmath_t w2, opmath_t sw, opmath_t gw, opmath_t eps, opmath_t mv,
                  opmath_t gv, const uint32_t* seeds, int32_t* largest = nullptr) {
  [[maybe_unused]] int32_t largest_m = 0, largest_s = 0, largest_v = 0;
  // The seeds as values: loads through a pointer beside the state's stores
  // would keep the loop from vectorizing.
  const uint32_t seed_m = seeds[0], seed_s = seeds[1], seed_v = seeds[2];
  PositionKeys<FOLD> keys(first);
  // A state as wide as the parameters asks for nothing: the loop's square root
  // and division leave the hardware's prefetchers time enough, and the
  // requests cost QHAdam's float32-state step 2-4% on ResNet-18 shapes.
  const bool asks = (SR || !std::is_same_v<state_t, scalar_t>) && asks_ahead();
  const int64_t span = asks ? kSpan : n;
  for (int64_t begin = 0; begin < n; begin += span) {
    if (asks && begin + kAhead + kSpan <= n) {
      ask_for_span<true>(p + begin + kAhead);
      ask_for_span<false>(g + begin + kAhead);
      ask_for_span<true>(m + begin + kAhead);
      ask_for_span<true>(s + begin + kAhead);
      if constexpr (AMSGRAD) {
        ask_for_span<true>(v + begin + kAhead);
      }
    }
    const int64_t end = std::min(n, begin + span);
    for (int64_t i = begin; i < end; ++i) {
      const uint32_t at = keys.next();
      const opmath_t pi = static_cast<opmath_t>(p[i]);
      const opmath_t gi = step_gradient<TERMS>(static_cast<opmath_t>(g[i]), gm, wd, pi);
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
      p[i] = static_cast<scalar_t>(decayed<TERMS>(pi, df) + (mv * mi + gv * gi) / (base + eps));
      if constexpr (SCALES) {
        largest_m = std::max(largest_m, qhoptim::eight_bit::magnitude_bits(mi));
        largest_s = std::max(largest_s, qhoptim::eight_bit::magnitude_bits(si));
        if constexpr (AMSGRAD) {
          largest_v = std::max(largest_v, qhoptim::eight_bit::magnitude_bits(di));
        }
      }
    }
  }
  if constexpr (SCALES) {
    largest[0] = largest_m;
    largest[1] = largest_s;
    if constexpr (AMSGRAD) {
      largest[2] = largest_v;
    }
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
  const Terms terms = terms_of(grad_multiplier, coupled_weight_decay, decay_factor);
  at::parallel_for(0, param.numel(), kGrain, [=](int64_t begin, int64_t end) {
    with_terms<std::is_same_v<scalar_t, float>>(terms, low, [&](auto terms_tag, auto low_tag) {
      auto run = [&](auto fold_tag) {
        qhadam_chunk<scalar_t, state_t, SR, opmath_t, FORM, AMSGRAD, decltype(fold_tag)::value,
                     decltype(low_tag)::value, decltype(terms_tag)::value>(
            p + begin, g + begin, m + begin, s + begin, AMSGRAD ? v + begin : nullptr, begin,
            end - begin, gm, wd, df, w1, b2, w2, sw, gw, eps, mv, gv, seeds);
      };
      SR && needs_fold(begin, end - begin) ? run(std::true_type{}) : run(std::false_type{});
    });
  });
}

// The seeds of a narrow state's rounding: `seeds` holds k per tensor (k = 1,
// 2 or 3: one per state list, as qhoptim.torch._state_dtype.state_seeds makes
// them), flat, or nothing for a state of the parameters' dtype; the table
// has three per tensor, zeros past k.
std::vector<uint32_t> seed_table(const std::vector<int64_t>& seeds, size_t n) {
  std::vector<uint32_t> out(3 * n, 0);
  if (seeds.empty()) {
    return out;
  }
  const size_t k = n == 0 ? 0 : seeds.size() / n;
  TORCH_CHECK(n > 0 && k >= 1 && k <= 3 && seeds.size() == k * n,
              "qhoptim fused: seeds must hold 1, 2 or 3 numbers per tensor, flat");
  for (size_t i = 0; i < n; ++i) {
    for (size_t j = 0; j < k; ++j) {
      out[3 * i + j] = static_cast<uint32_t>(seeds[k * i + j]);
    }
  }
  return out;
}

// QHAdam's folded coefficients (qhoptim.rules.FoldedQHAdam less its first
// field: exp_avg_sq_weight, grad_sq_weight, eps, exp_avg_value, grad_value):
// one row of 5 for every tensor (the usual case, every count the same), or a
// row per tensor. Returns the distance from one tensor's row to the next's.
size_t coefficient_row(const std::vector<double>& coefficients, size_t n) {
  TORCH_CHECK(coefficients.size() == 5 || coefficients.size() == 5 * n,
              "qhoptim fused: coefficients must be 5 numbers, or 5 per tensor");
  return coefficients.size() == 5 ? 0 : 5;
}

}  // namespace

void qhm_(std::vector<at::Tensor> params, std::vector<at::Tensor> grads,
          std::vector<at::Tensor> momentum_buffers, double grad_multiplier,
          double coupled_weight_decay, double decay_factor, double grad_to_buffer,
          double buffer_value, double grad_value, const std::vector<int64_t>& seeds) {
  const bool narrow = !seeds.empty();
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
             std::vector<at::Tensor> max_exp_avg_sqs, std::vector<double> coefficients,
             int64_t form, double grad_multiplier, double coupled_weight_decay, double decay_factor,
             double exp_avg_lerp, double beta2, double one_minus_beta2,
             const std::vector<int64_t>& seeds) {
  const bool amsgrad = !max_exp_avg_sqs.empty();
  const bool narrow = !seeds.empty();
  if (amsgrad) {
    check_lists(params, grads, {exp_avgs, exp_avg_sqs, max_exp_avg_sqs}, narrow);
  } else {
    check_lists(params, grads, {exp_avgs, exp_avg_sqs}, narrow);
  }
  TORCH_CHECK(!narrow || std::all_of(params.begin(), params.end(),
                                     [](const at::Tensor& p) { return p.scalar_type() == at::kFloat; }),
              "qhoptim fused: a bfloat16 state is for float32 parameters");
  const size_t row = coefficient_row(coefficients, params.size());
  TORCH_CHECK(form >= 0 && form <= 2, "qhoptim fused: unknown denominator form");
  const double* c = coefficients.data();
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
              params[i], grad, exp_avgs[i], exp_avg_sqs[i], maxes, c + row * i, grad_multiplier,
              coupled_weight_decay, decay_factor, exp_avg_lerp, beta2, one_minus_beta2,
              seed.data() + 3 * i);
        } else {
          qhadam_tensor<scalar_t, state_t, kSR, kForm, false>(
              params[i], grad, exp_avgs[i], exp_avg_sqs[i], nullptr, c + row * i, grad_multiplier,
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
    auto chunk = [&](auto fold_tag) {
      PositionKeys<decltype(fold_tag)::value> keys(start + begin);
      for (int64_t i = 0; i < end - begin; ++i) {
        d[begin + i] = store<c10::BFloat16, true>(x[begin + i], s, keys.next());
      }
    };
    needs_fold(start + begin, end - begin) ? chunk(std::true_type{}) : chunk(std::false_type{});
  });
}

// An 8-bit blockwise state (qhoptim/csrc/eight_bit.h; qhoptim.torch._state_dtype.quantize_ /
// dequantize_ are the torch-operations statement of the same arithmetic, and a
// test holds the two to the same bytes).
using namespace qhoptim::eight_bit;
static_assert(kBlock == kSpan, "a block's prefetch asks for one span");
constexpr int64_t kBlocksAhead = 2;  // which block eight_bit_blocks asks for ahead

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

namespace {

Ladder ladder_of(const at::Tensor& levels, int64_t per_octave) {
  TORCH_CHECK(levels.scalar_type() == at::kFloat && levels.is_contiguous() &&
                  levels.numel() >= 2 && levels.device().is_cpu(),
              "qhoptim fused: 8-bit levels must be a float32 CPU tensor");
  TORCH_CHECK(ladder_fits(levels.numel(), per_octave),
              "qhoptim fused: at most 256 levels, 1 to 255 per octave");
  return ladder_of_levels(levels.data_ptr<float>(), static_cast<int>(levels.numel()),
                          static_cast<int>(per_octave));
}

void quantize8_(at::Tensor codes, at::Tensor scales, at::Tensor values, at::Tensor levels,
                bool is_signed, int64_t seed, bool stochastic, bool high, int64_t start,
                int64_t per_octave) {
  check_eight_bit(codes, scales, values, levels);
  uint8_t* c = codes.data_ptr<uint8_t>();
  float* sc = scales.data_ptr<float>();
  const float* x = values.data_ptr<float>();
  const Ladder ladder = ladder_of(levels, per_octave);
  const int64_t n = values.numel();
  const auto s = static_cast<uint32_t>(seed);
  at::parallel_for(0, scales.numel(), 64, [=](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo = b * kBlock, len = std::min(n, lo + kBlock) - lo;
      encode_block(c + lo, sc + b, x + lo, start + lo, len, ladder, is_signed, s, stochastic,
                   high);
    }
  });
}

void dequantize8_(at::Tensor values, at::Tensor codes, at::Tensor scales, at::Tensor levels,
                  bool is_signed) {
  check_eight_bit(codes, scales, values, levels);
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const float* sc = scales.data_ptr<float>();
  float* x = values.data_ptr<float>();
  const Ladder ladder = ladder_of(levels, kPerOctave);  // decoding reads no per-octave count
  const int64_t n = values.numel();
  at::parallel_for(0, scales.numel(), 64, [=](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo = b * kBlock, len = std::min(n, lo + kBlock) - lo;
      decode_block(x + lo, c + lo, len, sc[b], ladder, is_signed);
    }
  });
}

// An 8-bit state of a tensor of n values as the packed uint8 tensor holds it
// (qhoptim.torch._state_dtype._Packed): the blocks' float32 scales, then the codes.
struct Packed8 {
  float* scales;
  uint8_t* codes;
};

Packed8 packed8(at::Tensor& packed, int64_t n) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() == 4 * blocks + n && packed.device().is_cpu(),
              "qhoptim fused: an 8-bit state must be the packed uint8 tensor of its parameter");
  uint8_t* base = packed.data_ptr<uint8_t>();
  TORCH_CHECK(reinterpret_cast<std::uintptr_t>(base) % alignof(float) == 0,
              "qhoptim fused: an 8-bit state's scales must be aligned");
  return {reinterpret_cast<float*>(base), base + 4 * blocks};
}

// One step of float32 parameters whose states are 8-bit, block by block: each
// block's states decoded (decode_block), stepped by `step(lo, len, locals,
// largest)` -- the float32 kernel's chunk over the block, on the decoded
// values, which also finds each new state's magnitude_bits maximum as it
// writes it, whence the block's scale (scale_from_magnitudes) -- and encoded
// back (encode_block_at_scale) with the noise of the state's seed (or, where
// `high[k]`, the high halves of state 0's hashes: state k follows it, and its
// seed is unused; qhoptim.rounding.eight_bit_noise_source). The same numbers as
// decoding the whole tensor, stepping it and encoding it (the working-copy
// path), in one pass over memory.
template <int K, typename Step>
void eight_bit_blocks(at::Tensor& param, const float* grad, std::array<at::Tensor*, K> states,
                      std::array<bool, K> is_signed, std::array<uint32_t, K> seeds,
                      std::array<bool, K> high, const Ladder& signed_ladder,
                      const Ladder& unsigned_ladder, Step step) {
  const int64_t n = param.numel();
  const float* p = param.data_ptr<float>();
  std::array<Packed8, K> packed;
  for (int k = 0; k < K; ++k) {
    packed[k] = packed8(*states[k], n);
  }
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  const bool asks = asks_ahead();
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    alignas(64) float local[K][kBlock];
    alignas(64) uint32_t hashes[kBlock];
    const int64_t hi = std::min(n, b1 * kBlock);  // this thread's blocks' end
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo = b * kBlock, len = std::min(n, lo + kBlock) - lo;
      // The block after next asked for now (where asks_ahead, see kSpan's
      // notes: not on AMD's CPUs): the step waits on memory for the
      // parameter and the gradient, the encoding before it does arithmetic
      // only, and the hardware's prefetchers do not keep up with the streams.
      // Nearer than the chunk loops' kAhead: a block's arithmetic is several
      // times theirs, and asking kAhead values on made the step 3-17% slower
      // (benchmarks.kernel_ab, 2 threads).
      if (asks && lo + (kBlocksAhead + 1) * kBlock <= hi) {  // inside this thread's blocks
        const int64_t ahead = lo + kBlocksAhead * kBlock;
        ask_for_span<true>(p + ahead);
        ask_for_span<false>(grad + ahead);
        for (int k = 0; k < K; ++k) {
          ask_for_span<true>(packed[k].codes + ahead);
        }
      }
      for (int k = 0; k < K; ++k) {
        const Ladder& ladder = is_signed[k] ? signed_ladder : unsigned_ladder;
        decode_block(local[k], packed[k].codes + lo, len, packed[k].scales[b], ladder,
                     is_signed[k]);
      }
      int32_t largest[K];
      step(lo, len, local, largest);
      for (int k = 0; k < K; ++k) {
        const Ladder& ladder = is_signed[k] ? signed_ladder : unsigned_ladder;
        const float scale = scale_from_magnitudes(largest[k], local[k], static_cast<int>(len));
        packed[k].scales[b] = scale;
        if (!high[k]) {
          block_hashes<false>(hashes, lo, len, seeds[k]);
        }
        encode_block_at_scale(packed[k].codes + lo, local[k], len, scale, ladder, is_signed[k],
                              hashes, high[k]);
      }
    }
  });
}


void check_float32_params(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                          const std::vector<std::vector<at::Tensor>>& states) {
  TORCH_CHECK(grads.size() == params.size(), "qhoptim fused: tensor lists differ in length");
  for (const auto& list : states) {
    TORCH_CHECK(list.size() == params.size(), "qhoptim fused: tensor lists differ in length");
  }
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK(params[i].scalar_type() == at::kFloat && params[i].is_contiguous() &&
                    params[i].device().is_cpu(),
                "qhoptim fused: an 8-bit state is for contiguous float32 CPU parameters");
    TORCH_CHECK(grads[i].is_contiguous() && grads[i].numel() == params[i].numel() &&
                    grads[i].scalar_type() == at::kFloat,
                "qhoptim fused: gradients must match their parameter");
  }
}

// f(i, p, g) for each float32 parameter's data and its gradient's (a copy of
// one that overlaps the parameter: readable_grad).
template <typename F>
void for_each_float32_param(std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                            F&& f) {
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor grad = readable_grad(params[i], grads[i]);
    f(i, params[i].data_ptr<float>(), grad.data_ptr<float>());
  }
}

}  // namespace

// QHM's step (qhm_'s arguments) with 8-bit momentum buffers: `seeds` int64
// [n, 3] (the first of each row is the buffer's), `levels_signed` the signed
// ladder (qhoptim.rounding.eight_bit_levels(True)). Stochastic rounding.
void qhm8_(std::vector<at::Tensor> params, std::vector<at::Tensor> grads,
           std::vector<at::Tensor> momentum_buffers, double grad_multiplier,
           double coupled_weight_decay, double decay_factor, double grad_to_buffer,
           double buffer_value, double grad_value, const std::vector<int64_t>& seeds,
           at::Tensor levels_signed, int64_t per_octave) {
  check_float32_params(params, grads, {momentum_buffers});
  const std::vector<uint32_t> seed = seed_table(seeds, params.size());
  const Ladder ladder = ladder_of(levels_signed, per_octave);
  const float gm = grad_multiplier, wd = coupled_weight_decay, df = decay_factor,
              w = grad_to_buffer, bv = buffer_value, gv = grad_value;
  const bool low = w < 0.5f;
  const Terms terms = terms_of(grad_multiplier, coupled_weight_decay, decay_factor);
  for_each_float32_param(params, grads, [&](size_t i, float* p, const float* g) {
    with_terms<true>(terms, low, [&](auto terms_tag, auto low_tag) {
      eight_bit_blocks<1>(
          params[i], g, {&momentum_buffers[i]}, {true}, {seed[3 * i]}, {false}, ladder, ladder,
          [&](int64_t lo, int64_t len, float (*local)[kBlock], int32_t* largest) {
            qhm_chunk<float, float, false, float, false, decltype(low_tag)::value,
                      decltype(terms_tag)::value, true>(p + lo, g + lo, local[0], lo, len, gm, wd,
                                                        df, w, bv, gv, 0, largest);
          });
    });
  });
}

// QHAdam's step (qhadam_'s arguments) with 8-bit moments: the first moment
// (and no other) signed; `levels_signed`, `levels_unsigned` the two ladders.
// The second moment rounds with the high halves of the first moment's hashes
// (qhoptim.rounding.eight_bit_noise_source): its seed is unused.
void qhadam8_(std::vector<at::Tensor> params, std::vector<at::Tensor> grads,
              std::vector<at::Tensor> exp_avgs, std::vector<at::Tensor> exp_avg_sqs,
              std::vector<at::Tensor> max_exp_avg_sqs, std::vector<double> coefficients,
              int64_t form, double grad_multiplier, double coupled_weight_decay, double decay_factor,
              double exp_avg_lerp, double beta2, double one_minus_beta2,
              const std::vector<int64_t>& seeds, at::Tensor levels_signed,
              at::Tensor levels_unsigned, int64_t per_octave) {
  const bool amsgrad = !max_exp_avg_sqs.empty();
  if (amsgrad) {
    check_float32_params(params, grads, {exp_avgs, exp_avg_sqs, max_exp_avg_sqs});
  } else {
    check_float32_params(params, grads, {exp_avgs, exp_avg_sqs});
  }
  const size_t row = coefficient_row(coefficients, params.size());
  TORCH_CHECK(form >= 0 && form <= 2, "qhoptim fused: unknown denominator form");
  const std::vector<uint32_t> seed = seed_table(seeds, params.size());
  const Ladder signed_ladder = ladder_of(levels_signed, per_octave);
  const Ladder unsigned_ladder = ladder_of(levels_unsigned, per_octave);
  const float gm = grad_multiplier, wd = coupled_weight_decay, df = decay_factor,
              w1 = exp_avg_lerp, b2 = beta2, w2 = one_minus_beta2;
  const bool low = w1 < 0.5f;
  const Terms terms = terms_of(grad_multiplier, coupled_weight_decay, decay_factor);
  for_each_float32_param(params, grads, [&](size_t i, float* p, const float* g) {
    // FoldedQHAdam: exp_avg_sq_weight, grad_sq_weight, eps, exp_avg_value, grad_value
    const double* c = coefficients.data() + row * i;
    const float sw = c[0], gw = c[1], eps = c[2], mv = c[3], gv = c[4];
    const uint32_t no_seeds[3] = {0, 0, 0};
    auto with_form = [&](auto form_tag) {
      constexpr int kForm = decltype(form_tag)::value;
      with_terms<true>(terms, low, [&](auto terms_tag, auto low_tag) {
        constexpr bool kLow = decltype(low_tag)::value;
        constexpr int kTerms = decltype(terms_tag)::value;
        if (amsgrad) {
          eight_bit_blocks<3>(
              params[i], g, {&exp_avgs[i], &exp_avg_sqs[i], &max_exp_avg_sqs[i]},
              {true, false, false}, {seed[3 * i], 0, seed[3 * i + 2]}, {false, true, false},
              signed_ladder, unsigned_ladder,
              [&](int64_t lo, int64_t len, float (*local)[kBlock], int32_t* largest) {
                qhadam_chunk<float, float, false, float, kForm, true, false, kLow, kTerms, true>(
                    p + lo, g + lo, local[0], local[1], local[2], lo, len, gm, wd, df, w1, b2,
                    w2, sw, gw, eps, mv, gv, no_seeds, largest);
              });
        } else {
          eight_bit_blocks<2>(
              params[i], g, {&exp_avgs[i], &exp_avg_sqs[i]}, {true, false},
              {seed[3 * i], 0}, {false, true}, signed_ladder, unsigned_ladder,
              [&](int64_t lo, int64_t len, float (*local)[kBlock], int32_t* largest) {
                qhadam_chunk<float, float, false, float, kForm, false, false, kLow, kTerms, true>(
                    p + lo, g + lo, local[0], local[1], nullptr, lo, len, gm, wd, df, w1, b2, w2,
                    sw, gw, eps, mv, gv, no_seeds, largest);
              });
        }
      });
    };
    if (form == 0) {
      with_form(std::integral_constant<int, 0>{});
    } else if (form == 1) {
      with_form(std::integral_constant<int, 1>{});
    } else {
      with_form(std::integral_constant<int, 2>{});
    }
  });
}

// Advance each step count by one, as torch's foreach addition of 1 would, and
// return the new counts: the numbers the host folds QHAdam's coefficients
// and the rounding's seeds from. One call in place of a torch call per count
// (torch's multi-tensor addition takes its slow path on one-value tensors).
// Counts that are not all float32 or float64 one-value CPU tensors are left
// as they are and nullopt returned (None in Python): the caller counts them
// with torch's operations.
std::optional<std::vector<double>> count_steps_(const std::vector<at::Tensor>& counts) {
  for (const auto& count : counts) {
    if (!(count.device().is_cpu() && count.numel() == 1 &&
          (count.scalar_type() == at::kFloat || count.scalar_type() == at::kDouble))) {
      return std::nullopt;
    }
  }
  std::vector<double> out;
  out.reserve(counts.size());
  for (const auto& count : counts) {
    AT_DISPATCH_FLOATING_TYPES(count.scalar_type(), "count_steps_", [&] {
      scalar_t* value = count.data_ptr<scalar_t>();
      *value += scalar_t(1);
      out.push_back(static_cast<double>(*value));
    });
    count.unsafeGetTensorImpl()->bump_version();  // an in-place change, as torch's
  }
  return out;
}

// A step's rounding seeds, qhoptim.rounding.rounding_seed_of_spread: the
// step's mix `mixed_step` (mix32 of its number) with each state's spread
// (rounding.index_spread of its index, `states` per parameter, flat), mixed
// by the same hash the noise uses (hash32_of_key(seed, key) is
// mix32(key ^ seed)). One row of `states` seeds per parameter.
std::vector<std::vector<int64_t>> rounding_seeds_(int64_t mixed_step,
                                                  const std::vector<int64_t>& spreads,
                                                  int64_t states) {
  TORCH_CHECK(states >= 1 && spreads.size() % static_cast<size_t>(states) == 0,
              "qhoptim rounding_seeds_: spreads must hold `states` numbers per parameter");
  const size_t k = static_cast<size_t>(states);
  std::vector<std::vector<int64_t>> rows(spreads.size() / k, std::vector<int64_t>(k));
  const uint32_t mixed = static_cast<uint32_t>(mixed_step);
  for (size_t i = 0; i < rows.size(); ++i) {
    for (size_t j = 0; j < k; ++j) {
      rows[i][j] = hash32_of_key(mixed, static_cast<uint32_t>(spreads[k * i + j]));
    }
  }
  return rows;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qhm_", &qhm_, "One fused QHM step over a list of CPU tensors, in place.");
  m.def("qhadam_", &qhadam_, "One fused QHAdam step over a list of CPU tensors, in place.");
  m.def("quantize8_", &quantize8_, "Encode float32 values as an 8-bit blockwise state.");
  m.def("dequantize8_", &dequantize8_, "Decode an 8-bit blockwise state to float32.");
  m.def("qhm8_", &qhm8_, "One fused QHM step of float32 CPU tensors with 8-bit buffers.");
  m.def("qhadam8_", &qhadam8_, "One fused QHAdam step of float32 CPU tensors with 8-bit moments.");
  m.def("stochastic_round_", &stochastic_round_,
        "Round a float32 CPU tensor to bfloat16 stochastically (qhoptim.rounding).");
  m.def("rounding_seeds_", &rounding_seeds_,
        "A step's rounding seeds from its mixed step number and the states' spreads.");
  m.def("count_steps_", &count_steps_,
        "Add one to each step count (float one-value CPU tensors) and return the new "
        "counts; None, changing nothing, for any other list.");
}
