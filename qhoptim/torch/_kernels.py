r"""All of :mod:`qhoptim.torch`'s tensor arithmetic: one kernel family.

The optimizer modules (``_qhm.py``, ``_qhadam.py``) gather parameters and
state and choose a path; everything that touches tensor values is here. The
coefficients always come from :mod:`qhoptim.rules`:

* :func:`qhm_` and :func:`qhadam_` -- the in-place kernels, on lists of tensors
  of one device and dtype (``torch._foreach_*`` ops, on CPU over cache-sized
  chunks). QHAdam takes its update in the folded form of
  :func:`qhoptim.rules.fold_qhadam`. A coefficient is a Python number (eager
  steps: the in-place ops' scalars), a 0-d tensor (a tensor ``lr``) or one 0-d
  tensor per parameter (capturable steps: bias corrections evaluated on the
  device step counts, so nothing is read back to the host and the step can be
  captured in a CUDA graph). The per-tensor path calls the same kernels on one
  tensor at a time, the multi-tensor path on whole lists, and
  ``qhoptim.keras`` on Keras's torch backend through :func:`foreach_qhm` /
  :func:`foreach_qhadam`.
* :func:`formula_qhm_` and :func:`formula_qhadam_` -- one parameter's step
  through :func:`qhoptim.rules.qhm_update` / :func:`~qhoptim.rules.qhadam_update`
  themselves, out of place: differentiable, free of host synchronisation, and
  fused by ``torch.compile``. Used with ``differentiable=True``, under
  ``torch.compile``, and for a tensor ``lr`` or ``capturable=True`` on the
  per-tensor path.

Bias corrections computed on tensors below float64 use the ``expm1`` form of
:func:`qhoptim.rules.bias_correction` (:func:`bias_corrections`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import Tensor

from qhoptim import rules
from qhoptim.torch._tensors import (
    QHAdamHyperparameters,
    QHMHyperparameters,
    group_by_device_and_dtype,
)

__all__ = [
    "amsgrad_maxes",
    "bias_corrections",
    "device_coefficients",
    "foreach_qhadam",
    "foreach_qhm",
    "formula_qhadam_",
    "formula_qhm_",
    "host_fold",
    "qhadam_",
    "qhm_",
]

#: The fused kernels' code of each QHAdam denominator form (C++ and Triton alike).
DENOMINATOR_FORMS = {
    rules.Denominator.EXP_AVG_SQ: 0,
    rules.Denominator.GRAD: 1,
    rules.Denominator.MIX: 2,
}

#: A kernel coefficient: a Python number, a 0-d tensor, or one 0-d tensor per tensor.
Coefficient = Any


# On CPU the multi-tensor kernels run over runs of whole tensors of about this
# many elements: each kernel then finds its operands still in cache from the
# previous one (as the per-tensor loop does), while small tensors still share
# kernel calls. Measured with 2 threads (benchmarks/torch_step.py): QHAdam on
# ResNet-18 shapes takes 21 ms in chunks of 2**13 to 2**21 elements, 29 ms
# unchunked and 22 ms in the loop; on 500 x 1,000 elements 2**16 to 2**17 are best.
CPU_CHUNK_NUMEL = 1 << 17


def _chunks(tensors: Sequence[Tensor], per_tensor: bool = False) -> list[slice]:
    """Consecutive runs of whole tensors of at most :data:`CPU_CHUNK_NUMEL` elements on CPU.

    ``per_tensor``: one tensor at a time (the per-tensor implementation).
    """
    if per_tensor:
        return [slice(i, i + 1) for i in range(len(tensors))]
    if not tensors or not tensors[0].is_cpu or torch.compiler.is_compiling():
        return [slice(0, len(tensors))]
    chunks, start, total = [], 0, 0
    for i, t in enumerate(tensors):
        n = t.numel()
        if total and total + n > CPU_CHUNK_NUMEL:
            chunks.append(slice(start, i))
            start, total = i, 0
        total += n
    chunks.append(slice(start, len(tensors)))
    return chunks


def abs_sq(x: Tensor) -> Tensor:
    """``|x|**2`` (real, without a square root): ``x * x`` for real tensors."""
    # dtype.is_complex, not Tensor.is_complex(): torch.compile before 2.4 breaks
    # the graph on the method call.
    if x.dtype.is_complex:
        return rules.abs_square(x, conj=torch.conj, real=torch.real)  # type: ignore[no-any-return]
    return x * x


def _sqrt(x: Any) -> Any:
    return x.sqrt() if isinstance(x, Tensor) else math.sqrt(x)


def at_precision(step: Tensor, param: Tensor) -> Tensor:
    """Step counts (float32 tensors) at ``param``'s precision, for its bias corrections."""
    return step.to(torch.promote_types(step.dtype, param.real.dtype))


def lr_at_precision(lr: Any, param: Tensor) -> Any:
    """A tensor ``lr`` (``capturable``: kept on the device) at ``param``'s
    precision or above, as the coefficients folded from it: a float32 ``lr``
    times a Python number stays float32, 1e-9 off for float64 parameters."""
    return at_precision(lr, param) if isinstance(lr, Tensor) else lr


def bias_corrections(beta1: float, beta2: float, step: Any) -> tuple[Any, Any]:
    """Both moments' bias corrections for ``step`` (a number, or a tensor of step counts).

    A tensor below float64 takes the ``expm1`` form of
    :func:`qhoptim.rules.bias_correction` (the float32 policy); Python numbers
    and float64 tensors the plain ``1 - beta**step``.
    """
    expm1 = torch.expm1 if isinstance(step, Tensor) and step.dtype != torch.float64 else None
    return (
        rules.bias_correction(beta1, step, expm1=expm1),
        rules.bias_correction(beta2, step, expm1=expm1),
    )


# ------------------------------------------------------- coefficient kernels
# The few multi-tensor primitives the kernels need, for any kind of
# coefficient: a Python number goes to the fused scalar overloads
# (``alpha=``, ``value=``), a tensor (or one per tensor) is multiplied in.
def _on_host(c: Coefficient) -> bool:
    return not isinstance(c, (Tensor, list))


def _nonzero(c: Coefficient) -> bool:
    """Whether a term with coefficient ``c`` must be applied (device values always are)."""
    return not _on_host(c) or c != 0


# The largest finite value of each floating dtype, for _fits.
_MAX = {
    dtype: torch.finfo(dtype).max
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
}


def _fits(c: Coefficient, like: Tensor, *, opmath: bool = False) -> bool:
    """Whether ``c`` can go to a fused scalar overload for tensors like ``like``.

    A Python number is converted there with an overflow check -- to the
    tensors' dtype for ``alpha=`` (``_foreach_add``), to float32 or float64 for
    ``value=`` (``opmath``: ``_foreach_addcmul``, ``_foreach_addcdiv``) -- and a
    finite value beyond that type's range, such as ``lr * nu`` for ``lr=1e308``
    or ``weight_decay=1e5`` on float16, raises ("value cannot be converted to
    type float without overflow") halfway through a step. Such a coefficient is
    multiplied in instead (``_foreach_mul``, which rounds it as IEEE arithmetic
    does, to inf), so the step completes with the arithmetic's inf or NaN.
    Device coefficients and non-finite numbers always fit.
    """
    if not _on_host(c) or not math.isfinite(c):
        return True
    dtype = like.dtype
    if opmath and dtype != torch.float64:
        dtype = torch.float32
    return bool(abs(c) <= _MAX.get(dtype, math.inf))


def _opmath(c: Coefficient, like: Tensor) -> Coefficient:
    """A host coefficient as the scalar of a multiplication of tensors like ``like``:
    rounded to the arithmetic's type (float32 below float64) as IEEE arithmetic
    rounds it, so ``1e308`` becomes inf for float32 tensors.

    The CPU kernels take a number beyond float32's range and round it so
    themselves; CUDA's refuse it ("value cannot be converted to type float
    without overflow"), halfway through a step.
    """
    if (
        not _on_host(c)
        or not math.isfinite(c)
        or like.dtype in (torch.float64, torch.complex128)
        or abs(c) <= _MAX[torch.float32]
    ):
        return c
    return float(torch.tensor(c, dtype=torch.float64).to(torch.float32))


def _add_scaled_(ys: list[Tensor], xs: list[Tensor], c: Coefficient) -> None:
    """``ys += c * xs``."""
    if _on_host(c) and _fits(c, ys[0]):
        torch._foreach_add_(ys, xs, alpha=c)
    else:
        torch._foreach_add_(ys, torch._foreach_mul(xs, _opmath(c, xs[0])))


def _plus_scaled(ys: list[Tensor], xs: list[Tensor], c: Coefficient) -> list[Tensor]:
    """``ys + c * xs`` (new tensors)."""
    if _on_host(c) and _fits(c, ys[0]):
        return cast(list[Tensor], torch._foreach_add(ys, xs, alpha=c))
    out = cast(list[Tensor], torch._foreach_mul(xs, _opmath(c, xs[0])))
    torch._foreach_add_(out, ys)
    return out


def _is_one(c: Coefficient) -> bool:
    return _on_host(c) and c == 1


def _scaled(xs: list[Tensor], c: Coefficient) -> list[Tensor]:
    """``c * xs``: new tensors, or ``xs`` themselves for the number 1."""
    return xs if _is_one(c) else cast(list[Tensor], torch._foreach_mul(xs, _opmath(c, xs[0])))


def _grad_sq(grads: list[Tensor], grad_sqs: list[Tensor] | None, c: Coefficient) -> list[Tensor]:
    """``c * |grad|**2`` (new tensors); ``grad_sqs`` holds ``|grad|**2`` of complex grads."""
    if grad_sqs is not None:
        return _scaled(grad_sqs, c)
    out = cast(list[Tensor], torch._foreach_mul(grads, grads))
    if not _is_one(c):
        torch._foreach_mul_(out, _opmath(c, out[0]))
    return out


def _add_grad_sq_(
    ys: list[Tensor], grads: list[Tensor], grad_sqs: list[Tensor] | None, c: Coefficient
) -> None:
    """``ys += c * |grad|**2``; ``grad_sqs`` holds ``|grad|**2`` of complex grads."""
    if grad_sqs is not None:
        _add_scaled_(ys, grad_sqs, c)
    elif _on_host(c) and _fits(c, ys[0], opmath=True):
        torch._foreach_addcmul_(ys, grads, grads, c)
    else:
        torch._foreach_add_(ys, _grad_sq(grads, None, c))


def _plus_grad_sq(
    ys: list[Tensor], grads: list[Tensor], grad_sqs: list[Tensor] | None, c: Coefficient
) -> list[Tensor]:
    """``ys + c * |grad|**2`` (new tensors); ``grad_sqs`` holds ``|grad|**2`` of complex grads."""
    if grad_sqs is not None:
        return _plus_scaled(ys, grad_sqs, c)
    if _on_host(c) and _fits(c, ys[0], opmath=True):
        return cast(list[Tensor], torch._foreach_addcmul(ys, grads, grads, c))
    out = _grad_sq(grads, None, c)
    torch._foreach_add_(out, ys)
    return out


def _addcdiv_(ys: list[Tensor], xs: list[Tensor], den: list[Tensor], c: Coefficient) -> None:
    """``ys += c * xs / den``."""
    if _on_host(c) and _fits(c, ys[0], opmath=True):
        torch._foreach_addcdiv_(ys, xs, den, c)
        return
    out = torch._foreach_mul(xs, _opmath(c, xs[0]))
    torch._foreach_div_(out, den)
    torch._foreach_add_(ys, out)


def decay_grads(
    params: list[Tensor], grads: list[Tensor], hp: QHMHyperparameters | QHAdamHyperparameters
) -> list[Tensor]:
    """The gradients after ``maximize`` and weight decay (:func:`qhoptim.rules.weight_decay_terms`).

    Decoupled decay scales ``params`` in place by
    :func:`~qhoptim.rules.decoupled_decay_factor` (a tensor for a tensor ``lr``);
    coupled decay adds ``weight_decay * param`` to the gradients. The given
    gradients are never written to.
    """
    if hp.maximize:
        grads = cast(list[Tensor], torch._foreach_neg(grads))
    if hp.weight_decay != 0:
        if hp.decoupled_weight_decay:
            lr = lr_at_precision(hp.lr, params[0])
            factor = rules.decoupled_decay_factor(lr, hp.weight_decay)
            torch._foreach_mul_(params, _opmath(factor, params[0]))
        elif hp.maximize:  # reuse the negated copy
            _add_scaled_(grads, params, hp.weight_decay)
        else:
            grads = _plus_scaled(grads, params, hp.weight_decay)
    return grads


def _real_views(*lists: list[Tensor]) -> tuple[list[Tensor], ...]:
    """The lists of complex tensors (of one dtype) as real views."""
    return tuple([torch.view_as_real(t) for t in ts] for ts in lists)


# ------------------------------------------------------------------------ QHM
def qhm_(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    hp: QHMHyperparameters,
    *,
    per_tensor: bool = False,
) -> None:
    """One QHM step in place, on tensors of one device and dtype or, ``per_tensor``, any.

    ``momentum_buffer.lerp_(grad, 1 - beta)``, then ``param -= lr * nu * momentum_buffer``
    and ``param -= lr * (1 - nu) * grad`` (:func:`qhoptim.rules.qhm_coefficients`;
    a zero weight skips its pass). ``hp.lr`` may be a tensor.
    """
    c = rules.qhm_coefficients(hp.momentum, hp.nu)
    lr = lr_at_precision(hp.lr, params[0]) if params else hp.lr
    buffer_value, grad_value = rules.fold_qhm(c, lr)
    for chunk in _chunks(params, per_tensor):
        ps, gs, bufs = params[chunk], grads[chunk], momentum_buffers[chunk]
        if ps[0].dtype.is_complex:
            ps, gs, bufs = _real_views(ps, gs, bufs)
        gs = decay_grads(ps, gs, hp)
        torch._foreach_lerp_(bufs, gs, c.grad_to_buffer)
        if _nonzero(buffer_value):
            _add_scaled_(ps, bufs, buffer_value)
        if _nonzero(grad_value):
            _add_scaled_(ps, gs, grad_value)


# --------------------------------------------------------------------- QHAdam
@functools.lru_cache(maxsize=256)
def host_fold(
    step: float, lr: float, beta1: float, beta2: float, nu1: float, nu2: float, eps: float
) -> rules.FoldedQHAdam:
    bc1, bc2 = bias_corrections(beta1, beta2, step)
    c = rules.qhadam_coefficients(nu1, nu2, bc1, bc2)
    return rules.fold_qhadam(c, lr, eps, rules.qhadam_denominator(nu2))


def _device_folded(
    steps: list[Tensor], param: Tensor, hp: QHAdamHyperparameters
) -> rules.FoldedQHAdam:
    """QHAdam's coefficients evaluated on the device: a tensor per field, one value per step.

    Nothing is factored out (``factor_out=False``): only the two weights that
    depend on the step, ``nu1 / (1 - beta1**t)`` and ``nu2 / (1 - beta2**t)``,
    (and a tensor ``lr``) make per-tensor values.
    """
    t = at_precision(torch.stack(steps), param)
    bc1, bc2 = bias_corrections(hp.beta1, hp.beta2, t)
    c = rules.qhadam_coefficients(hp.nu1, hp.nu2, bc1, bc2)
    return rules.fold_qhadam(
        c,
        lr_at_precision(hp.lr, param),
        hp.eps,
        rules.qhadam_denominator(hp.nu2),
        factor_out=False,
        sqrt=_sqrt,
    )


def _device_fold(
    steps: list[Tensor], param: Tensor, hp: QHAdamHyperparameters
) -> rules.FoldedQHAdam:
    """:func:`_device_folded` for the multi-tensor kernels: one 0-d tensor per parameter."""
    f = _device_folded(steps, param, hp)
    # Terms whose weight is known on the host to be zero are skipped.
    f = f._replace(
        exp_avg_value=f.exp_avg_value if hp.nu1 != 0 else 0.0,
        grad_value=f.grad_value if hp.nu1 != 1 else 0.0,
    )
    return rules.FoldedQHAdam._make(
        list(x.unbind()) if isinstance(x, Tensor) and x.dim() == 1 else x for x in f
    )


def device_coefficients(
    steps: list[Tensor], param: Tensor, hp: QHAdamHyperparameters, *constants: float
) -> Tensor:
    """:func:`_device_folded` for the fused kernels: one row per parameter.

    The columns: ``exp_avg_sq_weight, grad_sq_weight, eps, exp_avg_value,
    grad_value`` (:class:`qhoptim.rules.FoldedQHAdam`), the decoupled decay
    factor (:func:`qhoptim.rules.decoupled_decay_factor`, 1 without it), then
    ``constants``. Built with device ops only, so a CUDA graph can capture it.
    """
    f = _device_folded(steps, param, hp)
    decay: Any = 1.0
    if hp.weight_decay != 0 and hp.decoupled_weight_decay:
        decay = rules.decoupled_decay_factor(lr_at_precision(hp.lr, param), hp.weight_decay)
    like = cast(Tensor, f.exp_avg_value)  # a tensor of one value per step
    columns = [torch.zeros_like(like) + x for x in (*f[1:], decay, *constants)]
    return torch.stack(columns, dim=1)


def _take(f: rules.FoldedQHAdam, chunk: slice) -> rules.FoldedQHAdam:
    """The coefficients of the parameters in ``chunk`` (per-parameter lists are cut)."""
    return rules.FoldedQHAdam._make(x[chunk] if isinstance(x, list) else x for x in f)


def _qhadam_update_(
    f: rules.FoldedQHAdam,
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    grad_sqs: list[Tensor] | None,
) -> None:
    """``param += exp_avg_value * m / d + grad_value * g / d``.

    The coefficients are those of :class:`qhoptim.rules.FoldedQHAdam`.

    The denominator's form is chosen once, here, for every path.
    """
    form = f.denominator
    if form is rules.Denominator.EXP_AVG_SQ:
        den = cast(list[Tensor], torch._foreach_sqrt(_scaled(exp_avg_sqs, f.exp_avg_sq_weight)))
    elif form is rules.Denominator.GRAD and grad_sqs is None and _is_one(f.grad_sq_weight):
        den = cast(list[Tensor], torch._foreach_abs(grads))
    elif form is rules.Denominator.GRAD:
        den = _grad_sq(grads, grad_sqs, f.grad_sq_weight)
        torch._foreach_sqrt_(den)
    elif _is_one(f.exp_avg_sq_weight):
        den = _plus_grad_sq(exp_avg_sqs, grads, grad_sqs, f.grad_sq_weight)
        torch._foreach_sqrt_(den)
    else:  # both terms; the second moment's weight is not 1, so _scaled makes new tensors
        den = _scaled(exp_avg_sqs, f.exp_avg_sq_weight)
        _add_grad_sq_(den, grads, grad_sqs, f.grad_sq_weight)
        torch._foreach_sqrt_(den)
    torch._foreach_add_(den, _opmath(f.eps, den[0]))
    if grad_sqs is not None:  # complex: the real denominator spans both parts of the views
        den = [d.unsqueeze(-1) for d in den]
    # Two in-place passes over ``param`` cost less than a temporary numerator.
    if _nonzero(f.exp_avg_value):
        _addcdiv_(params, exp_avgs, den, f.exp_avg_value)
    if _nonzero(f.grad_value):
        _addcdiv_(params, grads, den, f.grad_value)


def qhadam_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: Sequence[float] | Sequence[Tensor],
    hp: QHAdamHyperparameters,
    *,
    per_tensor: bool = False,
    max_exp_avg_sqs: list[Tensor] | None = None,
) -> None:
    """One QHAdam step in place, on tensors of one device and dtype or, ``per_tensor``, any.

    ``steps[i]`` is parameter ``i``'s step number *including* this step (1 on
    the first): Python numbers (the coefficients are folded on the host) or
    0-d tensors on the device (folded there, one coefficient per parameter;
    nothing is read back, so the step is capturable). Complex parameters take
    real views, with ``|g|**2`` and a real second moment.

    With ``hp.amsgrad``, ``max_exp_avg_sqs`` (real, like the second moments)
    take the running maximum :func:`qhoptim.rules.amsgrad_maximum` after the
    second moments' EWMA, and the denominator reads them in their place, with
    the same folded coefficients.
    """
    maxes = amsgrad_maxes(hp, max_exp_avg_sqs, params)
    device_fold = None
    if isinstance(steps[0], Tensor):
        device_fold = _device_fold(cast(list[Tensor], list(steps)), params[0], hp)
        host_folds = {}
    else:  # parameters differ in step only if some missed steps
        host_folds = {
            step: host_fold(step, hp.lr, hp.beta1, hp.beta2, hp.nu1, hp.nu2, hp.eps)
            for step in set(cast(Sequence[float], steps))
        }
    (one_fold,) = host_folds.values() if len(host_folds) == 1 else (None,)
    w = rules.qhadam_moment_weights(hp.beta1, hp.beta2)
    for chunk in _chunks(params, per_tensor):
        ps, gs, ms, ss = params[chunk], grads[chunk], exp_avgs[chunk], exp_avg_sqs[chunk]
        vs = ss if maxes is None else maxes[chunk]  # what the denominator reads
        gs = decay_grads(ps, gs, hp)
        grad_sqs = None
        if ps[0].dtype.is_complex:
            grad_sqs = [abs_sq(g) for g in gs]
            ps, gs, ms = _real_views(ps, gs, ms)
        # Each moment is a QH average (paper, Sec. 5): its EWMA weights are QHM's.
        torch._foreach_lerp_(ms, gs, w.grad_to_exp_avg)
        torch._foreach_mul_(ss, w.exp_avg_sq_decay)
        if grad_sqs is None:
            torch._foreach_addcmul_(ss, gs, gs, w.grad_sq_to_exp_avg_sq)
        else:
            torch._foreach_add_(ss, grad_sqs, alpha=w.grad_sq_to_exp_avg_sq)
        if maxes is not None:
            torch._foreach_maximum_(vs, ss)
        if device_fold is not None:
            _qhadam_update_(_take(device_fold, chunk), ps, gs, ms, vs, grad_sqs)
            continue
        if one_fold is not None:
            _qhadam_update_(one_fold, ps, gs, ms, vs, grad_sqs)
            continue
        chunk_steps = cast(Sequence[float], steps[chunk])
        for step in set(chunk_steps):
            f = host_folds[step]
            idx = [k for k, s in enumerate(chunk_steps) if s == step]
            p_, g_, m_, s_ = ([lst[k] for k in idx] for lst in (ps, gs, ms, vs))
            sqs = None if grad_sqs is None else [grad_sqs[k] for k in idx]
            _qhadam_update_(f, p_, g_, m_, s_, sqs)


def amsgrad_maxes(
    hp: QHAdamHyperparameters, max_exp_avg_sqs: list[Tensor] | None, params: list[Tensor]
) -> list[Tensor] | None:
    """The running maxima the step keeps: ``max_exp_avg_sqs`` with ``hp.amsgrad``, else None."""
    if not hp.amsgrad:
        return None
    if max_exp_avg_sqs is None or len(max_exp_avg_sqs) != len(params):
        raise ValueError(
            "amsgrad=True needs max_exp_avg_sqs, one per parameter (zeros before the first step)"
        )
    return max_exp_avg_sqs


# ------------------------------------------------------------------ formulas
def _formula_step(
    param: Tensor,
    grad: Tensor,
    update: Any,
    hp: QHMHyperparameters | QHAdamHyperparameters,
    differentiable: bool,
) -> None:
    """One out-of-place step of the rules: ``update(grad)`` writes the state, returns the update."""
    theta = param.clone() if differentiable else param  # autograd may save it; param is overwritten
    if hp.maximize:
        grad = torch.neg(grad)
    lr = lr_at_precision(hp.lr, param)
    decay: Any = 1
    if hp.weight_decay != 0:
        grad, decay = rules.weight_decay_terms(
            grad,
            theta,
            lr=lr,
            weight_decay=hp.weight_decay,
            decoupled=hp.decoupled_weight_decay,
        )
    param.copy_(rules.apply_update(theta, update(grad), lr, decay))


def formula_qhm_(
    param: Tensor,
    grad: Tensor,
    momentum_buffer: Tensor,
    hp: QHMHyperparameters,
    differentiable: bool,
) -> None:
    """One parameter's QHM step through :func:`qhoptim.rules.qhm_update`, out of place."""

    def update(g: Tensor) -> Tensor:
        new_buf, direction = rules.qhm_update(g, momentum_buffer, momentum=hp.momentum, nu=hp.nu)
        momentum_buffer.copy_(new_buf)
        return cast(Tensor, direction)

    _formula_step(param, grad, update, hp, differentiable)


def formula_qhadam_(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    step: Any,
    hp: QHAdamHyperparameters,
    differentiable: bool,
    max_exp_avg_sq: Tensor | None = None,
) -> None:
    """One parameter's QHAdam step through :func:`qhoptim.rules.qhadam_update`, out of place.

    ``step`` counts this step: a number, or a tensor (capturable, compiled),
    whose bias corrections are then taken at the parameter's precision. With
    ``hp.amsgrad`` the step is :func:`qhoptim.rules.qhadam_amsgrad_update`'s
    and ``max_exp_avg_sq`` its running maximum.
    """
    if isinstance(step, Tensor):
        step = at_precision(step, param)
    bc1, bc2 = bias_corrections(hp.beta1, hp.beta2, step)
    maxes = amsgrad_maxes(hp, None if max_exp_avg_sq is None else [max_exp_avg_sq], [param])
    hparams: dict[str, Any] = {
        "beta1": hp.beta1,
        "beta2": hp.beta2,
        "nu1": hp.nu1,
        "nu2": hp.nu2,
        "eps": hp.eps,
        "bias_correction1": bc1,
        "bias_correction2": bc2,
        "sqrt": torch.sqrt,
        "square": abs_sq,
    }

    def update(g: Tensor) -> Tensor:
        if maxes is None:
            new_exp_avg, new_exp_avg_sq, u = rules.qhadam_update(g, exp_avg, exp_avg_sq, **hparams)
        else:
            # Autograd saves maximum's inputs: a copy of the state it then overwrites.
            running_max = maxes[0].clone() if differentiable else maxes[0]
            new_exp_avg, new_exp_avg_sq, new_max, u = rules.qhadam_amsgrad_update(
                g, exp_avg, exp_avg_sq, running_max, maximum=torch.maximum, **hparams
            )
            maxes[0].copy_(new_max)
        exp_avg.copy_(new_exp_avg)
        exp_avg_sq.copy_(new_exp_avg_sq)
        return cast(Tensor, u)

    _formula_step(param, grad, update, hp, differentiable)


# ------------------------------------------------ whole lists (any device/dtype)
def _by_device_and_dtype(
    tensorlists: list[list[Tensor]], *extra: Sequence[Any]
) -> list[list[list[Any]]]:
    """The lists split by device and dtype; ``extra`` lists (of numbers) split alike."""
    grouped = group_by_device_and_dtype(tensorlists, with_indices=True)
    return [
        [cast(list[Any], ts) for ts in lists] + [[e[i] for i in indices] for e in extra]
        for lists, indices in grouped.values()
    ]


def foreach_qhm(
    params: list[Tensor], grads: list[Tensor], momentum_buffers: list[Tensor], **hparams: Any
) -> None:
    """:func:`qhm_` over tensors of any devices and dtypes.

    ``hparams`` as :class:`QHMHyperparameters`.
    """
    hp = QHMHyperparameters(**hparams)
    for ps, gs, bufs in _by_device_and_dtype([params, grads, momentum_buffers]):
        qhm_(ps, gs, bufs, hp)


def foreach_qhadam(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: Sequence[float],
    max_exp_avg_sqs: list[Tensor] | None = None,
    **hparams: Any,
) -> None:
    """:func:`qhadam_` over tensors of any devices and dtypes.

    ``steps`` are Python numbers (the step being taken, 1 on the first);
    ``hparams`` as :class:`QHAdamHyperparameters`; ``max_exp_avg_sqs`` the
    running maxima of ``amsgrad=True``.
    """
    hp = QHAdamHyperparameters(**hparams)
    if not hp.amsgrad:
        for ps, gs, ms, ss, ts in _by_device_and_dtype(
            [params, grads, exp_avgs, exp_avg_sqs], steps
        ):
            qhadam_(ps, gs, ms, ss, ts, hp)
        return
    maxes = amsgrad_maxes(hp, max_exp_avg_sqs, params)
    lists = [params, grads, exp_avgs, exp_avg_sqs, cast(list[Tensor], maxes)]
    for ps, gs, ms, ss, vs, ts in _by_device_and_dtype(lists, steps):
        qhadam_(ps, gs, ms, ss, ts, hp, max_exp_avg_sqs=vs)
