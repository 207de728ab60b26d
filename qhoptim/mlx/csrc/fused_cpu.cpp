// qhoptim.mlx's fused CPU step: one MLX primitive that reads a float32
// parameter, its gradient and its state once and writes the new parameter and
// state, float32 or bfloat16 (rounded stochastically by qhoptim.rounding's
// rule, or to nearest) -- one pass over memory where MLX's own kernels take
// three or four with a bfloat16 state (MLX does not fuse across a bit cast).
//
// The step's scalar coefficients come from qhoptim.rules, computed by the
// Python side (qhoptim/mlx/_qhm.py, _qhadam.py) and passed as one float32 array; the
// element-wise arithmetic is the one MLX's operations do for the unfused
// step, in the same order and rounding (built with -ffp-contract=off: no
// fused multiply-add), so that fused and unfused steps give the same bits.
//
// Built on first use by qhoptim/mlx/_extension.py against the installed MLX.

#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"
#include "rounding.h"  // qhoptim/csrc, on the include path
#include "slices.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

// How a state is stored (qhoptim.rounding).
enum class Store : int { kFloat32 = 0, kBFloat16Stochastic = 1, kBFloat16Nearest = 2 };

// Which moments QHAdam's denominator reads (qhoptim.rules.Denominator).
enum class Denominator : int { kExpAvgSq = 0, kGrad = 1, kMix = 2 };

// The layout of the coefficient array, written by qhoptim/mlx/_qhm.py and
// _qhadam.py (_kernel_inputs): the rules' weights in float32, the learning rate in
// the values.
enum QHMCoefficient : int { kMomentum, kOneMinusMomentum, kGradWeight, kBufferWeight, kLr, kQHMFactor, kQHMCoupled };
enum QHAdamCoefficient : int {
  kBeta1, kOneMinusBeta1, kBeta2, kOneMinusBeta2, kExpAvgSqWeight, kGradSqWeight, kEps,
  kExpAvgValue, kGradValue, kFactor, kCoupled,
};

struct Config {
  bool qhadam;              // else QHM
  int denominator;          // Denominator, QHAdam
  bool amsgrad;             // QHAdam: a third state, the running maximum
  bool grad_term;           // QHAdam: grad_value is not the number 0
  bool coupled;             // L2 weight decay: grad + coupled * param
  bool decay;               // decoupled decay: param * factor
  int store;                // Store, every state of the step
  int64_t first_seed;       // the index of the first state's seed in `seeds`
  bool operator==(const Config& o) const {
    return qhadam == o.qhadam && denominator == o.denominator && amsgrad == o.amsgrad &&
           grad_term == o.grad_term && coupled == o.coupled && decay == o.decay &&
           store == o.store && first_seed == o.first_seed;
  }
};

// The hash's key of an element, position * kGolden (qhoptim/csrc/rounding.h).
using qhoptim::rounding::kGolden;

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// MLX's own float32-to-bfloat16 conversion (mlx/types/bf16.h), written out:
// where the compiler has a native bfloat16 type (ARM's BF16 extension), MLX's
// header takes that one instead, whose conversion is the hardware's.
inline uint16_t bfloat16_nearest_bits(float value) {
  if (std::isnan(value)) return 0x7FC0;  // MLX's NaN
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  bits += ((bits >> 16) & 1u) + 0x7FFFu;  // to nearest, ties to even
  return static_cast<uint16_t>(bits >> 16);
}

template <Store S>
struct StateType {
  using type = uint16_t;  // a bfloat16's bits
};
template <>
struct StateType<Store::kFloat32> {
  using type = float;
};

template <Store S>
inline float load(const typename StateType<S>::type* x, int64_t i) {
  if constexpr (S == Store::kFloat32) {
    return x[i];
  } else {
    return bits_to_float(static_cast<uint32_t>(x[i]) << 16);
  }
}

// qhoptim.rounding.bfloat16_bits (stochastic), MLX's own float32-to-bfloat16
// conversion (to nearest), or the value itself.
template <Store S>
inline void store(typename StateType<S>::type* x, int64_t i, float value, uint32_t seed, uint32_t key) {
  if constexpr (S == Store::kFloat32) {
    x[i] = value;
  } else if constexpr (S == Store::kBFloat16Stochastic) {
    x[i] = qhoptim::rounding::bfloat16_bits(value, seed, key);
  } else {
    x[i] = bfloat16_nearest_bits(value);
  }
}

// MLX's maximum: NaN from either side.
inline float nan_maximum(float a, float b) { return std::isnan(a) ? a : (a > b ? a : b); }

// One step's arrays, the parameter and the states stepped in place: four
// arrays that never overlap (``__restrict__`` in the loops lets the compiler
// vectorize them without checking at run time).
template <Store S>
struct Arrays {
  using T = typename StateType<S>::type;
  float* param;
  const float* grad;
  T* state[3];
};

template <Store S>
void qhm(const Arrays<S>& a, int64_t first, int64_t n, const float* c, const Config& cfg, const uint32_t* seeds) {
  const float momentum = c[kMomentum], one_minus = c[kOneMinusMomentum];
  const float grad_weight = c[kGradWeight], buffer_weight = c[kBufferWeight], lr = c[kLr];
  const float factor = c[kQHMFactor], wd = c[kQHMCoupled];
  const uint32_t seed = seeds ? seeds[0] : 0u;
  const bool coupled = cfg.coupled, decay = cfg.decay;
  using T = typename StateType<S>::type;
  float* __restrict__ p = a.param;
  const float* __restrict__ g = a.grad;
  T* __restrict__ b = a.state[0];
  // The hash's key of element i, i * 0x9E3779B9 (mod 2**32), advanced by
  // one addition per element.
  uint32_t key = static_cast<uint32_t>(first) * kGolden;
  for (int64_t i = first; i < first + n; ++i, key += kGolden) {
    const float param = p[i];
    float grad = g[i];
    if (coupled) grad = grad + wd * param;
    // rules.qhm_update, rules.apply_update
    const float buf = momentum * load<S>(b, i) + one_minus * grad;
    const float direction = grad_weight * grad + buffer_weight * buf;
    p[i] = (decay ? param * factor : param) - lr * direction;
    store<S>(b, i, buf, seed, key);
  }
}

template <Store S, Denominator D, bool AMSGRAD>
void qhadam(const Arrays<S>& a, int64_t first, int64_t n, const float* c, const Config& cfg,
            const uint32_t* seeds) {
  const float b1 = c[kBeta1], omb1 = c[kOneMinusBeta1], b2 = c[kBeta2], omb2 = c[kOneMinusBeta2];
  const float s_weight = c[kExpAvgSqWeight], g_weight = c[kGradSqWeight], eps = c[kEps];
  const float m_value = c[kExpAvgValue], g_value = c[kGradValue];
  const float factor = c[kFactor], wd = c[kCoupled];
  const uint32_t s0 = seeds ? seeds[0] : 0u, s1 = seeds ? seeds[1] : 0u;
  const uint32_t s2 = (seeds && AMSGRAD) ? seeds[2] : 0u;
  const bool coupled = cfg.coupled, decay = cfg.decay, grad_term = cfg.grad_term;
  using T = typename StateType<S>::type;
  float* __restrict__ p = a.param;
  const float* __restrict__ g = a.grad;
  T* __restrict__ m = a.state[0];
  T* __restrict__ v = a.state[1];
  T* __restrict__ v_max = a.state[2];
  // The hash's key of element i, i * 0x9E3779B9 (mod 2**32), advanced by
  // one addition per element.
  uint32_t key = static_cast<uint32_t>(first) * kGolden;
  for (int64_t i = first; i < first + n; ++i, key += kGolden) {
    const float param = p[i];
    float grad = g[i];
    if (coupled) grad = grad + wd * param;
    // rules.ewma of both moments, rules.amsgrad_maximum, rules.folded_qhadam_step
    const float grad_sq = grad * grad;
    const float new_m = b1 * load<S>(m, i) + omb1 * grad;
    const float new_v = b2 * load<S>(v, i) + omb2 * grad_sq;
    float second = new_v;
    if constexpr (AMSGRAD) second = nan_maximum(load<S>(v_max, i), new_v);
    float base;
    if constexpr (D == Denominator::kExpAvgSq) {
      base = s_weight * second;
    } else if constexpr (D == Denominator::kGrad) {
      base = g_weight * grad_sq;
    } else {
      base = s_weight * second + g_weight * grad_sq;
    }
    float numerator = m_value * new_m;
    if (grad_term) numerator = numerator + g_value * grad;
    const float delta = numerator / (std::sqrt(base) + eps);
    p[i] = (decay ? param * factor : param) + delta;
    store<S>(m, i, new_m, s0, key);
    store<S>(v, i, new_v, s1, key);
    if constexpr (AMSGRAD) store<S>(v_max, i, second, s2, key);
  }
}

template <Store S>
void run(const Arrays<S>& a, int64_t first, int64_t n, const float* c, const Config& cfg,
         const uint32_t* seeds) {
  if (!cfg.qhadam) return qhm<S>(a, first, n, c, cfg, seeds);
  const auto d = static_cast<Denominator>(cfg.denominator);
#define QHOPTIM_QHADAM(DEN)                                           \
  if (d == DEN) {                                                     \
    if (cfg.amsgrad) return qhadam<S, DEN, true>(a, first, n, c, cfg, seeds); \
    return qhadam<S, DEN, false>(a, first, n, c, cfg, seeds);                \
  }
  QHOPTIM_QHADAM(Denominator::kExpAvgSq)
  QHOPTIM_QHADAM(Denominator::kGrad)
  QHOPTIM_QHADAM(Denominator::kMix)
#undef QHOPTIM_QHADAM
}

// The step on raw memory: `outs` the states, then the parameter, each holding
// its old values; a large array in slices on several threads
// (qhoptim/csrc/slices.h).
template <Store S>
void run_on(const std::vector<void*>& outs, const float* grad, int64_t n, const float* c,
            const Config& cfg, const uint32_t* seeds) {
  using T = typename StateType<S>::type;
  const size_t states = outs.size() - 1;
  Arrays<S> a{static_cast<float*>(outs[states]), grad, {}};
  for (size_t k = 0; k < states; ++k) a.state[k] = static_cast<T*>(outs[k]);
  qhoptim::slices::for_each_slice(n, [&](int64_t first, int64_t count) { run<S>(a, first, count, c, cfg, seeds); });
}

// ``x``'s data where it is row-contiguous; else its elements gathered in
// row-major order into a buffer kept in ``scratch`` (a broadcast or
// transposed gradient, a sliced state: MLX does not export its own copy
// kernels to extensions).
const char* contiguous(const mx::array& x, std::vector<std::vector<char>>& scratch) {
  if (x.flags().row_contiguous) return x.data<char>();
  const size_t item = x.itemsize(), n = x.size();
  scratch.emplace_back(n * item);
  char* dst = scratch.back().data();
  const char* src = x.data<char>();
  const int ndim = static_cast<int>(x.ndim());
  std::vector<int64_t> index(ndim, 0);
  int64_t offset = 0;  // in elements
  for (size_t i = 0; i < n; ++i) {
    std::memcpy(dst + i * item, src + offset * static_cast<int64_t>(item), item);
    for (int d = ndim - 1; d >= 0; --d) {  // the next index, as an odometer turns
      offset += x.strides()[d];
      if (++index[d] < x.shape(d)) break;
      offset -= x.strides()[d] * x.shape(d);
      index[d] = 0;
    }
  }
  return dst;
}

// One parameter's step. Inputs: param, grad, the states, the coefficients
// (float32) and, for stochastic rounding, every state seed of the step
// (uint32). Outputs: the new states, then the new parameter.
class FusedStep : public mx::Primitive {
 public:
  FusedStep(mx::Stream stream, Config cfg) : mx::Primitive(stream), cfg_(cfg) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = mx::cpu::get_command_encoder(stream());
    const size_t states = outputs.size() - 1;
    // MLX gives each output of a primitive its own list of the inputs, so each
    // input looks read by as many arrays as there are outputs and MLX's test
    // of donation (is_donatable) would never pass. Once evaluated, an output
    // needs its inputs no more (MLX detaches them after this call), so the
    // others let go of theirs here, except while tracing (a tracer keeps its graph).
    bool tracing = false;
    for (const auto& out : outputs) tracing = tracing || out.is_tracer();
    if (!tracing) {
      for (auto& out : outputs) {
        if (&out.inputs() != &inputs) out.inputs().clear();
      }
    }
    // Output k overwrites the array it replaces where nothing else reads that
    // one (MLX's donation; asked before any copy of it here counts as one more
    // reader), else it is new memory the old values are first copied into:
    // the step runs in place either way.
    std::vector<bool> donated(states + 1);
    for (size_t k = 0; k <= states; ++k) {
      const mx::array& source = inputs[k == states ? 0 : 2 + k];
      donated[k] = source.is_donatable() && source.flags().row_contiguous &&
                   source.data_size() == source.size();
    }
    std::vector<void*> out_data;
    for (size_t k = 0; k <= states; ++k) {
      mx::array& out = outputs[k];
      if (donated[k]) {
        out.copy_shared_buffer(inputs[k == states ? 0 : 2 + k]);
      } else {
        out.set_data(mx::allocator::malloc(out.nbytes()));
      }
      out_data.push_back(out.data<void>());
    }
    for (const auto& x : inputs) encoder.set_input_array(x);
    for (auto& x : outputs) encoder.set_output_array(x);
    // The task runs after the inputs' own computations (this stream's order)
    // and reads them through weak copies (their buffers, not their graph
    // nodes, as MLX's own kernels do): MLX keeps the buffers alive until the
    // stream has run it, and a strong copy would count as one more reader of
    // each input until then, and free graph nodes on the stream's thread.
    std::vector<mx::array> in;
    in.reserve(inputs.size());
    for (const auto& x : inputs) in.push_back(mx::array::unsafe_weak_copy(x));
    encoder.dispatch([in = std::move(in), out_data = std::move(out_data), donated = std::move(donated),
                      n = static_cast<int64_t>(outputs[0].size()), cfg = cfg_]() {
      const size_t states = out_data.size() - 1;
      std::vector<std::vector<char>> scratch;
      if (n == 0) return;
      for (size_t k = 0; k <= states; ++k) {  // the old values where MLX did not donate them
        if (donated[k]) continue;
        const mx::array& source = in[k == states ? 0 : 2 + k];
        std::memcpy(out_data[k], contiguous(source, scratch), source.nbytes());
      }
      const auto* g = reinterpret_cast<const float*>(contiguous(in[1], scratch));
      const auto* c = reinterpret_cast<const float*>(contiguous(in[2 + states], scratch));
      const bool stochastic = cfg.store == static_cast<int>(Store::kBFloat16Stochastic);
      const uint32_t* seeds =
          stochastic ? reinterpret_cast<const uint32_t*>(contiguous(in[3 + states], scratch)) + cfg.first_seed
                     : nullptr;
      switch (static_cast<Store>(cfg.store)) {
        case Store::kFloat32:
          return run_on<Store::kFloat32>(out_data, g, n, c, cfg, seeds);
        case Store::kBFloat16Stochastic:
          return run_on<Store::kBFloat16Stochastic>(out_data, g, n, c, cfg, seeds);
        case Store::kBFloat16Nearest:
          return run_on<Store::kBFloat16Nearest>(out_data, g, n, c, cfg, seeds);
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("qhoptim's fused MLX step runs on the CPU");
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const size_t states = cfg_.qhadam ? (cfg_.amsgrad ? 3 : 2) : 1;
    return std::vector<mx::Shape>(states + 1, inputs[0].shape());
  }

  const char* name() const override { return "QHFusedStep"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return cfg_ == static_cast<const FusedStep&>(other).cfg_;
  }

 private:
  Config cfg_;
};

// The step as an MLX graph node; checks what the Python side guarantees.
std::vector<mx::array> fused_step(const mx::array& param, const mx::array& grad,
                                  const std::vector<mx::array>& states, const mx::array& coefficients,
                                  const mx::array& seeds, bool qhadam, int denominator, bool grad_term,
                                  bool coupled, bool decay, int store, int64_t first_seed) {
  const size_t count = states.size();
  if (param.dtype() != mx::float32 || grad.dtype() != mx::float32 || grad.shape() != param.shape()) {
    throw std::invalid_argument("the fused step takes a float32 parameter and a gradient of its shape");
  }
  if (count != (qhadam ? 2u : 1u) && !(qhadam && count == 3)) {
    throw std::invalid_argument("the fused step takes QHM's buffer or QHAdam's two or three moments");
  }
  const mx::Dtype state_dtype = store == static_cast<int>(Store::kFloat32) ? mx::float32 : mx::bfloat16;
  for (const auto& s : states) {
    if (s.dtype() != state_dtype || s.shape() != param.shape()) {
      throw std::invalid_argument("the fused step's states must have the parameter's shape and the store's dtype");
    }
  }
  if (coefficients.dtype() != mx::float32 || coefficients.ndim() != 1 ||
      coefficients.shape(0) != (qhadam ? kCoupled + 1 : kQHMCoupled + 1)) {
    throw std::invalid_argument("the fused step's coefficients are one float32 vector of the rule's layout");
  }
  const bool stochastic = store == static_cast<int>(Store::kBFloat16Stochastic);
  if (stochastic && (seeds.dtype() != mx::uint32 || seeds.ndim() != 1 || first_seed < 0 ||
                     first_seed + static_cast<int64_t>(count) > seeds.shape(0))) {
    throw std::invalid_argument("the fused step's seeds are a uint32 vector holding every state's");
  }
  Config cfg{qhadam, denominator, qhadam && count == 3, grad_term, coupled, decay, store, first_seed};
  auto stream = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs{param, grad};
  inputs.insert(inputs.end(), states.begin(), states.end());
  inputs.push_back(coefficients);
  if (stochastic) inputs.push_back(seeds);
  std::vector<mx::Shape> shapes(count + 1, param.shape());
  std::vector<mx::Dtype> dtypes(count, state_dtype);
  dtypes.push_back(mx::float32);
  return mx::array::make_arrays(std::move(shapes), dtypes, std::make_shared<FusedStep>(stream, cfg), inputs);
}

}  // namespace

NB_MODULE(QHOPTIM_MODULE_NAME, m) {
  m.doc() = "qhoptim.mlx's fused CPU step (built on first use)";
  m.def("fused_step", &fused_step, nb::arg("param"), nb::arg("grad"), nb::arg("states"),
        nb::arg("coefficients"), nb::arg("seeds"), nb::arg("qhadam"), nb::arg("denominator"),
        nb::arg("grad_term"), nb::arg("coupled"), nb::arg("decay"), nb::arg("store"), nb::arg("first_seed"));
}
