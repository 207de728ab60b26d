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

#include <cmath>
#include <cstddef>
#include <vector>

namespace {

constexpr int64_t kGrain = 1 << 15;

// torch.maximum's: NaN if either is NaN (as the foreach path's _foreach_maximum_).
template <typename T>
inline T nan_max(T a, T b) {
  return (a != a || b != b) ? a + b : (a < b ? b : a);
}

// torch.lerp's formula, so that the fused moments round as the foreach ones.
template <typename T>
inline T lerp(T start, T end, T weight) {
  return weight < T(0.5) ? start + weight * (end - start)
                         : end - (end - start) * (T(1) - weight);
}

void check_lists(const std::vector<at::Tensor>& params,
                 const std::vector<std::vector<at::Tensor>>& others) {
  for (const auto& list : others) {
    TORCH_CHECK(list.size() == params.size(), "qhoptim fused: tensor lists differ in length");
  }
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK(params[i].is_contiguous(), "qhoptim fused: parameters must be contiguous");
    for (const auto& list : others) {
      TORCH_CHECK(list[i].is_contiguous() && list[i].numel() == params[i].numel() &&
                      list[i].scalar_type() == params[i].scalar_type(),
                  "qhoptim fused: state and gradients must match their parameter");
    }
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
// values, so the compiler vectorizes the loop without run-time checks.
template <typename scalar_t, typename opmath_t>
void qhm_chunk(scalar_t* __restrict__ p, const scalar_t* __restrict__ g, scalar_t* __restrict__ b,
               int64_t n, opmath_t gm, opmath_t wd, opmath_t df, opmath_t w, opmath_t bv,
               opmath_t gv) {
  for (int64_t i = 0; i < n; ++i) {
    const opmath_t pi = static_cast<opmath_t>(p[i]);
    const opmath_t gi = static_cast<opmath_t>(g[i]) * gm + wd * pi;
    const opmath_t bi = lerp(static_cast<opmath_t>(b[i]), gi, w);
    b[i] = static_cast<scalar_t>(bi);
    p[i] = static_cast<scalar_t>(pi * df + bv * bi + gv * gi);
  }
}

template <typename scalar_t>
void qhm_tensor(at::Tensor& param, const at::Tensor& grad, at::Tensor& buf, double grad_multiplier,
                double coupled_weight_decay, double decay_factor, double grad_to_buffer,
                double buffer_value, double grad_value) {
  using opmath_t = at::opmath_type<scalar_t>;
  scalar_t* p = param.data_ptr<scalar_t>();
  const scalar_t* g = grad.data_ptr<scalar_t>();
  scalar_t* b = buf.data_ptr<scalar_t>();
  const opmath_t gm = grad_multiplier, wd = coupled_weight_decay, df = decay_factor,
                 w = grad_to_buffer, bv = buffer_value, gv = grad_value;
  at::parallel_for(0, param.numel(), kGrain, [=](int64_t begin, int64_t end) {
    qhm_chunk<scalar_t, opmath_t>(p + begin, g + begin, b + begin, end - begin, gm, wd, df, w,
                                  bv, gv);
  });
}

// One chunk of a QHAdam step. FORM: 0 reads the second moment alone, 1 the
// gradient alone, 2 both (qhoptim.rules.Denominator EXP_AVG_SQ, GRAD, MIX).
// AMSGRAD: v keeps the running maximum of the (uncorrected) second moment,
// which the denominator reads in its place (qhoptim.rules.qhadam_amsgrad_update,
// with the same folded coefficients); without it v is unused.
template <typename scalar_t, typename opmath_t, int FORM, bool AMSGRAD>
void qhadam_chunk(scalar_t* __restrict__ p, const scalar_t* __restrict__ g,
                  scalar_t* __restrict__ m, scalar_t* __restrict__ s, scalar_t* __restrict__ v,
                  int64_t n, opmath_t gm, opmath_t wd, opmath_t df, opmath_t w1, opmath_t b2,
                  opmath_t w2, opmath_t sw, opmath_t gw, opmath_t eps, opmath_t mv, opmath_t gv) {
  for (int64_t i = 0; i < n; ++i) {
    const opmath_t pi = static_cast<opmath_t>(p[i]);
    const opmath_t gi = static_cast<opmath_t>(g[i]) * gm + wd * pi;
    const opmath_t mi = lerp(static_cast<opmath_t>(m[i]), gi, w1);
    const opmath_t si = b2 * static_cast<opmath_t>(s[i]) + w2 * gi * gi;
    // What the denominator reads: the second moment, or its running maximum.
    opmath_t di = si;
    if constexpr (AMSGRAD) {
      di = nan_max(static_cast<opmath_t>(v[i]), si);
      v[i] = static_cast<scalar_t>(di);
    }
    opmath_t base;
    if constexpr (FORM == 0) {
      base = std::sqrt(sw * di);
    } else if constexpr (FORM == 1) {
      base = std::sqrt(gw * (gi * gi));
    } else {
      base = std::sqrt(sw * di + gw * (gi * gi));
    }
    m[i] = static_cast<scalar_t>(mi);
    s[i] = static_cast<scalar_t>(si);
    p[i] = static_cast<scalar_t>(pi * df + (mv * mi + gv * gi) / (base + eps));
  }
}

template <typename scalar_t, int FORM, bool AMSGRAD>
void qhadam_tensor(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg,
                   at::Tensor& exp_avg_sq, at::Tensor* max_exp_avg_sq, const double* c,
                   double grad_multiplier, double coupled_weight_decay, double decay_factor,
                   double exp_avg_lerp, double beta2, double one_minus_beta2) {
  using opmath_t = at::opmath_type<scalar_t>;
  scalar_t* p = param.data_ptr<scalar_t>();
  const scalar_t* g = grad.data_ptr<scalar_t>();
  scalar_t* m = exp_avg.data_ptr<scalar_t>();
  scalar_t* s = exp_avg_sq.data_ptr<scalar_t>();
  scalar_t* v = AMSGRAD ? max_exp_avg_sq->data_ptr<scalar_t>() : nullptr;
  const opmath_t gm = grad_multiplier, wd = coupled_weight_decay, df = decay_factor,
                 w1 = exp_avg_lerp, b2 = beta2, w2 = one_minus_beta2;
  // FoldedQHAdam: exp_avg_sq_weight, grad_sq_weight, eps, exp_avg_value, grad_value
  const opmath_t sw = c[0], gw = c[1], eps = c[2], mv = c[3], gv = c[4];
  at::parallel_for(0, param.numel(), kGrain, [=](int64_t begin, int64_t end) {
    qhadam_chunk<scalar_t, opmath_t, FORM, AMSGRAD>(
        p + begin, g + begin, m + begin, s + begin, AMSGRAD ? v + begin : nullptr, end - begin,
        gm, wd, df, w1, b2, w2, sw, gw, eps, mv, gv);
  });
}

}  // namespace

void qhm_(std::vector<at::Tensor> params, std::vector<at::Tensor> grads,
          std::vector<at::Tensor> momentum_buffers, double grad_multiplier,
          double coupled_weight_decay, double decay_factor, double grad_to_buffer,
          double buffer_value, double grad_value) {
  check_lists(params, {grads, momentum_buffers});
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor grad = readable_grad(params[i], grads[i]);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, params[i].scalar_type(), "qhm_", [&] {
      qhm_tensor<scalar_t>(params[i], grad, momentum_buffers[i], grad_multiplier,
                           coupled_weight_decay, decay_factor, grad_to_buffer, buffer_value,
                           grad_value);
    });
  }
}

// max_exp_avg_sqs: the running maxima of the AMSGrad variant, or an empty list
// for plain QHAdam.
void qhadam_(std::vector<at::Tensor> params, std::vector<at::Tensor> grads,
             std::vector<at::Tensor> exp_avgs, std::vector<at::Tensor> exp_avg_sqs,
             std::vector<at::Tensor> max_exp_avg_sqs, at::Tensor coefficients, int64_t form,
             double grad_multiplier, double coupled_weight_decay, double decay_factor,
             double exp_avg_lerp, double beta2, double one_minus_beta2) {
  const bool amsgrad = !max_exp_avg_sqs.empty();
  if (amsgrad) {
    check_lists(params, {grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs});
  } else {
    check_lists(params, {grads, exp_avgs, exp_avg_sqs});
  }
  TORCH_CHECK(coefficients.scalar_type() == at::kDouble && coefficients.is_contiguous() &&
                  coefficients.numel() == static_cast<int64_t>(params.size()) * 5,
              "qhoptim fused: coefficients must be a contiguous float64 tensor [n, 5]");
  TORCH_CHECK(form >= 0 && form <= 2, "qhoptim fused: unknown denominator form");
  const double* c = coefficients.data_ptr<double>();
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor grad = readable_grad(params[i], grads[i]);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, params[i].scalar_type(), "qhadam_", [&] {
      auto run = [&](auto form_tag) {
        constexpr int kForm = decltype(form_tag)::value;
        if (amsgrad) {
          qhadam_tensor<scalar_t, kForm, true>(
              params[i], grad, exp_avgs[i], exp_avg_sqs[i], &max_exp_avg_sqs[i], c + 5 * i,
              grad_multiplier, coupled_weight_decay, decay_factor, exp_avg_lerp, beta2,
              one_minus_beta2);
        } else {
          qhadam_tensor<scalar_t, kForm, false>(
              params[i], grad, exp_avgs[i], exp_avg_sqs[i], nullptr, c + 5 * i,
              grad_multiplier, coupled_weight_decay, decay_factor, exp_avg_lerp, beta2,
              one_minus_beta2);
        }
      };
      if (form == 0) {
        run(std::integral_constant<int, 0>{});
      } else if (form == 1) {
        run(std::integral_constant<int, 1>{});
      } else {
        run(std::integral_constant<int, 2>{});
      }
    });
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qhm_", &qhm_, "One fused QHM step over a list of CPU tensors, in place.");
  m.def("qhadam_", &qhadam_, "One fused QHAdam step over a list of CPU tensors, in place.");
}
