r"""Fused QHM and QHAdam steps on CUDA: Triton kernels over whole tensor lists.

One launch covers every tensor of a device-and-dtype group: a table lists, for
each block of ``_BLOCK`` elements, its tensor and its offset, and each program
reads the tensors' addresses from the table and makes one pass over its block
-- parameter, gradient and state read once, parameter and state written once.

The coefficients come from :mod:`qhoptim.rules` through the kernel layer: for
QHAdam they are evaluated on the device from the step counts
(:func:`qhoptim.torch._kernels.device_coefficients`), one row per tensor, and a
tensor ``lr`` is read on the device, so a step reads nothing back to the host
and can be captured in a CUDA graph. ``grad_scale`` and ``found_inf`` of
``torch.amp.GradScaler`` are read by the kernel: gradients are unscaled in
registers, and a step with an inf is skipped (state and step counts included).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from qhoptim import rules
from qhoptim.torch import _kernels, _tensors

__all__ = ["qhadam_", "qhm_"]

_BLOCK = 1024  # elements per program (H200: 0.91x fused Adam at 1e8 vs 1.17x with 2048)
_NUM_WARPS = 4
_TL_DTYPES = {
    torch.float32: tl.float32,
    torch.float64: tl.float64,
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
}

# Tables of tensor addresses and blocks, kept while the tensors stay put (a
# CUDA graph replays the captured table; grads reallocated each step rebuild it).
_TABLES: dict[tuple[Any, ...], tuple[Tensor, ...]] = {}
_MAX_TABLES = 64


def _table(lists: list[list[Tensor]]) -> tuple[Tensor, ...]:
    """``(addresses [lists, tensors], numels, block_tensor, block_start)`` on the device."""
    first = lists[0]
    key = (_BLOCK, *((t.data_ptr(), t.numel()) for ts in lists for t in ts))
    table = _TABLES.get(key)
    if table is not None:
        return table
    device = first[0].device
    block_tensor, block_start = [], []
    for i, t in enumerate(first):
        for start in range(0, t.numel(), _BLOCK):
            block_tensor.append(i)
            block_start.append(start)
    table = (
        torch.tensor(
            [[t.data_ptr() for t in ts] for ts in lists], dtype=torch.int64, device=device
        ),
        torch.tensor([t.numel() for t in first], dtype=torch.int64, device=device),
        torch.tensor(block_tensor, dtype=torch.int32, device=device),
        torch.tensor(block_start, dtype=torch.int64, device=device),
    )
    if len(_TABLES) >= _MAX_TABLES:
        _TABLES.pop(next(iter(_TABLES)))
    _TABLES[key] = table
    return table


@triton.jit
def _lerp(start, end, weight):
    # torch.lerp's formula, so that the fused moments round as the foreach ones.
    return tl.where(
        weight < 0.5, start + weight * (end - start), end - (end - start) * (1 - weight)
    )


@triton.jit
def _block(addrs, numels, block_tensor, block_start, inf_ptr, HAS_INF, BLOCK):
    """This program's block: its tensor's index, the offsets and the mask (none
    where GradScaler found an inf or NaN: nothing is written)."""
    pid = tl.program_id(0)
    t = tl.load(block_tensor + pid)
    offs = tl.load(block_start + pid) + tl.arange(0, BLOCK)
    mask = offs < tl.load(numels + t)
    if HAS_INF:
        mask = mask & (tl.load(inf_ptr) == 0)
    return t, offs, mask


@triton.jit
def _address(addrs, n_tensors, t, k, DTYPE):
    """The address of tensor ``t`` of list ``k`` in the table."""
    return tl.load(addrs + k * n_tensors + t).to(tl.pointer_type(DTYPE))


@triton.jit
def _load_grad(g_ptr, offs, mask, p, grad_multiplier, coupled_weight_decay, scale_ptr,
               HAS_SCALE, COMPUTE):  # fmt: skip
    """The gradient as the rule takes it: ``maximize``'s sign, GradScaler's
    scale taken out, coupled weight decay added."""
    g = tl.load(g_ptr + offs, mask=mask).to(COMPUTE) * grad_multiplier
    if HAS_SCALE:
        g = g / tl.load(scale_ptr).to(COMPUTE)
    return g + coupled_weight_decay * p


@triton.jit
def _qhm_kernel(
    addrs, numels, block_tensor, block_start, n_tensors, hyper, folded, scale_ptr, inf_ptr,
    HAS_SCALE: tl.constexpr, HAS_INF: tl.constexpr,
    DTYPE: tl.constexpr, COMPUTE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t, offs, mask = _block(addrs, numels, block_tensor, block_start, inf_ptr, HAS_INF, BLOCK)
    p_ptr = _address(addrs, n_tensors, t, 0, DTYPE)
    g_ptr = _address(addrs, n_tensors, t, 1, DTYPE)
    b_ptr = _address(addrs, n_tensors, t, 2, DTYPE)
    # Host scalars, in COMPUTE precision (Python floats would reach Triton as float32).
    grad_multiplier = tl.load(hyper)
    coupled_weight_decay = tl.load(hyper + 1)
    grad_to_buffer = tl.load(hyper + 2)
    # rules.decoupled_decay_factor and rules.fold_qhm: host numbers, or device
    # values of a tensor lr.
    decay = tl.load(folded).to(COMPUTE)
    buffer_value = tl.load(folded + 1).to(COMPUTE)
    grad_value = tl.load(folded + 2).to(COMPUTE)
    p = tl.load(p_ptr + offs, mask=mask).to(COMPUTE)
    g = _load_grad(g_ptr, offs, mask, p, grad_multiplier, coupled_weight_decay, scale_ptr,
                   HAS_SCALE, COMPUTE)  # fmt: skip
    b = _lerp(tl.load(b_ptr + offs, mask=mask).to(COMPUTE), g, grad_to_buffer)
    p = p * decay + buffer_value * b + grad_value * g
    tl.store(b_ptr + offs, b.to(DTYPE), mask=mask)
    tl.store(p_ptr + offs, p.to(DTYPE), mask=mask)


@triton.jit
def _qhadam_kernel(
    addrs, numels, block_tensor, block_start, n_tensors, coefficients, hyper, scale_ptr, inf_ptr,
    FORM: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_INF: tl.constexpr,
    DTYPE: tl.constexpr, COMPUTE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t, offs, mask = _block(addrs, numels, block_tensor, block_start, inf_ptr, HAS_INF, BLOCK)
    p_ptr = _address(addrs, n_tensors, t, 0, DTYPE)
    g_ptr = _address(addrs, n_tensors, t, 1, DTYPE)
    m_ptr = _address(addrs, n_tensors, t, 2, DTYPE)
    s_ptr = _address(addrs, n_tensors, t, 3, DTYPE)
    # rules.qhadam_moment_weights
    grad_multiplier = tl.load(hyper)
    coupled_weight_decay = tl.load(hyper + 1)
    grad_to_exp_avg = tl.load(hyper + 2)
    exp_avg_sq_decay = tl.load(hyper + 3)
    grad_sq_to_exp_avg_sq = tl.load(hyper + 4)
    # One row per tensor: FoldedQHAdam's weights, eps and values, and the decay factor.
    row = coefficients + 6 * t
    exp_avg_sq_weight = tl.load(row).to(COMPUTE)
    grad_sq_weight = tl.load(row + 1).to(COMPUTE)
    eps = tl.load(row + 2).to(COMPUTE)
    exp_avg_value = tl.load(row + 3).to(COMPUTE)
    grad_value = tl.load(row + 4).to(COMPUTE)
    decay = tl.load(row + 5).to(COMPUTE)
    p = tl.load(p_ptr + offs, mask=mask).to(COMPUTE)
    g = _load_grad(g_ptr, offs, mask, p, grad_multiplier, coupled_weight_decay, scale_ptr,
                   HAS_SCALE, COMPUTE)  # fmt: skip
    m = _lerp(tl.load(m_ptr + offs, mask=mask).to(COMPUTE), g, grad_to_exp_avg)
    s = exp_avg_sq_decay * tl.load(s_ptr + offs, mask=mask).to(COMPUTE)
    s = s + grad_sq_to_exp_avg_sq * g * g
    if FORM == 0:
        base = tl.sqrt(exp_avg_sq_weight * s)
    elif FORM == 1:
        base = tl.sqrt(grad_sq_weight * (g * g))
    else:
        base = tl.sqrt(exp_avg_sq_weight * s + grad_sq_weight * (g * g))
    p = p * decay + (exp_avg_value * m + grad_value * g) / (base + eps)
    tl.store(m_ptr + offs, m.to(DTYPE), mask=mask)
    tl.store(s_ptr + offs, s.to(DTYPE), mask=mask)
    tl.store(p_ptr + offs, p.to(DTYPE), mask=mask)


# Host scalars as small device tensors, one per distinct set of values: built
# once (a CUDA graph replays the captured one), so no step copies to the device.
_HYPER: dict[tuple[Any, ...], Tensor] = {}


def _hyper(values: tuple[float, ...], like: Tensor) -> Tensor:
    dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
    key = (values, dtype, like.device)
    tensor = _HYPER.get(key)
    if tensor is None:
        if len(_HYPER) >= _MAX_TABLES:
            _HYPER.pop(next(iter(_HYPER)))
        # Through float64: a value beyond float32's range (lr = 1e308) becomes
        # inf as IEEE arithmetic rounds it; torch.tensor(..., float32) refuses it.
        tensor = _HYPER[key] = torch.tensor(values, dtype=torch.float64).to(like.device, dtype)
    return tensor


def _launch_args(
    params: list[Tensor], grad_scale: Tensor | None, found_inf: Tensor | None
) -> dict[str, Any]:
    dtype = params[0].dtype
    return {
        "scale_ptr": grad_scale if grad_scale is not None else params[0],
        "inf_ptr": found_inf if found_inf is not None else params[0],
        "HAS_SCALE": grad_scale is not None,
        "HAS_INF": found_inf is not None,
        "DTYPE": _TL_DTYPES[dtype],
        "COMPUTE": tl.float64 if dtype == torch.float64 else tl.float32,
        "BLOCK": _BLOCK,
        "num_warps": _NUM_WARPS,
    }


def _check(params: list[Tensor], *others: list[Tensor]) -> None:
    for ts in (params, *others):
        for t in ts:
            if not t.is_contiguous() or t.dtype != params[0].dtype:
                raise RuntimeError(
                    "fused=True on CUDA needs contiguous parameters, gradients and state "
                    "of the parameter's dtype"
                )


def qhm_(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    hp: _tensors.QHMHyperparameters,
    *,
    grad_scale: Tensor | None,
    found_inf: Tensor | None,
) -> None:
    """One fused QHM step over CUDA tensors of one device and dtype."""
    _check(params, grads, momentum_buffers)
    c = rules.qhm_coefficients(hp.momentum, hp.nu)
    addrs, numels, block_tensor, block_start = _table([params, grads, momentum_buffers])
    if block_tensor.numel() == 0:  # only empty tensors
        return
    coupled = 0.0 if hp.decoupled_weight_decay else hp.weight_decay
    decay: Any = 1.0
    if hp.decoupled_weight_decay and hp.weight_decay != 0:
        decay = rules.decoupled_decay_factor(hp.lr, hp.weight_decay)
    values = (decay, *rules.fold_qhm(c, hp.lr))
    if isinstance(hp.lr, Tensor):  # evaluated on the device: nothing is read back
        like = hp.lr.to(params[0].device, torch.float64 if _is_float64(params) else torch.float32)
        folded = torch.stack([torch.zeros_like(like) + v for v in values])
    else:
        folded = _hyper(values, params[0])
    _qhm_kernel[(block_tensor.numel(),)](
        addrs,
        numels,
        block_tensor,
        block_start,
        len(params),
        _hyper((-1.0 if hp.maximize else 1.0, coupled, c.grad_to_buffer), params[0]),
        folded,
        **_launch_args(params, grad_scale, found_inf),
    )


def _is_float64(params: list[Tensor]) -> bool:
    return params[0].dtype == torch.float64


def qhadam_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    state_steps: list[Tensor],
    hp: _tensors.QHAdamHyperparameters,
    *,
    grad_scale: Tensor | None,
    found_inf: Tensor | None,
) -> None:
    """One fused QHAdam step over CUDA tensors of one device and dtype.

    ``state_steps`` (on the device) are incremented here; a step GradScaler
    found an inf in takes them back, as torch's fused Adam does.
    """
    _check(params, grads, exp_avgs, exp_avg_sqs)
    torch._foreach_add_(state_steps, 1)
    if found_inf is not None:
        torch._foreach_sub_(state_steps, [found_inf] * len(state_steps))
    coefficients = _kernels.device_coefficients(state_steps, params[0], hp)
    w = rules.qhadam_moment_weights(hp.beta1, hp.beta2)
    addrs, numels, block_tensor, block_start = _table([params, grads, exp_avgs, exp_avg_sqs])
    if block_tensor.numel() == 0:  # only empty tensors
        return
    _qhadam_kernel[(block_tensor.numel(),)](
        addrs,
        numels,
        block_tensor,
        block_start,
        len(params),
        coefficients,
        _hyper(
            (
                -1.0 if hp.maximize else 1.0,
                0.0 if hp.decoupled_weight_decay else hp.weight_decay,
                w.grad_to_exp_avg,
                w.exp_avg_sq_decay,
                w.grad_sq_to_exp_avg_sq,
            ),
            params[0],
        ),
        FORM=_kernels.DENOMINATOR_FORMS[rules.qhadam_denominator(hp.nu2)],
        **_launch_args(params, grad_scale, found_inf),
    )
