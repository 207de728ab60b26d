r"""Fused QHM and QHAdam steps on CUDA: one Triton launch per device and dtype.

One launch covers every tensor of a device-and-dtype group: a table lists,
for each block of ``_BLOCK`` elements, its tensor and its offset, and each
program reads the tensors' addresses from the table and makes one pass over
its block -- parameter, gradient and state read once, parameter and state
written once. Nothing else runs on the device in a step that is not
capturable:

* the coefficients come from :mod:`qhoptim.rules`, computed on the host from
  the step counts (which live on the host) and passed as the launch's scalar
  arguments -- one set for the group when its tensors agree in step count,
  the normal case; a row per tensor, copied to the device, otherwise;
* the address table stays on the device while the tensors stay put, and is
  copied again only when one moves (gradients reallocated by
  ``zero_grad(set_to_none=True)`` usually come back at the same addresses);
  the blocks' table depends on the tensors' sizes alone.

Float64 parameters take their coefficients from a small float64 table on the
device instead (a launch's float arguments are float32). A capturable step
(and a tensor ``lr``) keeps its coefficients on the device, evaluated there
from the device step counts (:func:`qhoptim.torch._kernels.device_coefficients`),
so that it reads nothing back and can be captured in a CUDA graph; there
``found_inf`` of ``torch.amp.GradScaler`` is read by the kernel, which skips
the step (state and step counts included). ``grad_scale`` is always read by
the kernel: gradients are unscaled in registers.

Under ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors (Triton's
interpreter, NumPy underneath), which is how CI tests them.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
import operator
import os
from typing import Any, NamedTuple, TypeVar, cast

import torch
import triton
import triton.language as tl
from torch import Tensor

from qhoptim import rounding, rules
from qhoptim.torch import _kernels, _tensors

__all__ = ["Layout", "known_layout", "qhadam_", "qhm_"]

_BLOCK = 1024  # elements per program (H200: 0.91x fused Adam at 1e8 vs 1.17x with 2048)
_NUM_WARPS = 4
_TL_DTYPES = {
    torch.float32: tl.float32,
    torch.float64: tl.float64,
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
}
_MAX_CACHED = 64
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_TRITON_VERSION = tuple(int(v) for v in triton.__version__.split(".")[:2] if v.isdigit())
# Integers and pointers are not specialized on their values (see _launch):
# compiled once per dtype and constexprs.
_JIT = {"do_not_specialize": ["n_tensors", "row_stride"]}
if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
    _JIT["do_not_specialize_on_alignment"] = [
        *("addrs", "numels", "block_tensor", "block_start", "table", "scale_ptr", "inf_ptr"),
        "seeds",
        *("counts", "rows", "hyper", "lr_ptr"),
    ]


# --------------------------------------------------------------------- tables
class _Blocks(NamedTuple):
    """The blocks of a list of tensors (on the device): each tensor's size, and
    each block's tensor and first element."""

    numels: Tensor
    block_tensor: Tensor
    block_start: Tensor


# By (device, sizes): kept for as long as the tensors keep their sizes.
_BLOCKS: dict[tuple[Any, ...], _Blocks] = {}
# By (device, addresses): kept while the tensors stay put. A CUDA graph
# replays the table it captured.
_ADDRESSES: dict[tuple[Any, ...], Tensor] = {}


_V = TypeVar("_V")


def _remember(cache: dict[tuple[Any, ...], _V], key: tuple[Any, ...], value: _V) -> _V:
    if len(cache) >= _MAX_CACHED:
        cache.pop(next(iter(cache)))
    cache[key] = value
    return value


def _blocks(sizes: tuple[int, ...], device: torch.device) -> _Blocks:
    key = (device, sizes)
    found = _BLOCKS.get(key)
    if found is not None:
        return found
    counts = torch.tensor([-(-n // _BLOCK) for n in sizes], dtype=torch.int64)
    block_tensor = torch.repeat_interleave(torch.arange(len(sizes)), counts)
    first_block = torch.cumsum(counts, 0) - counts  # each tensor's
    block_start = (torch.arange(int(counts.sum())) - first_block[block_tensor]) * _BLOCK
    blocks = _Blocks(
        torch.tensor(sizes, dtype=torch.int64).to(device),
        block_tensor.to(device, torch.int32),
        block_start.to(device, torch.int64),
    )
    return _remember(_BLOCKS, key, blocks)


def _pointers(lists: list[list[Tensor]]) -> tuple[int, ...]:
    # map: no bytecode per tensor, on the step's hot path.
    return tuple(itertools.chain.from_iterable([map(Tensor.data_ptr, ts) for ts in lists]))


def _table(pointers: tuple[int, ...], rows: int, device: torch.device) -> Tensor:
    """``pointers`` as an int64 ``[rows, tensors]`` table on the device, made once."""
    key = (device, rows, pointers)
    found = _ADDRESSES.get(key)
    if found is None:
        table = torch.tensor(pointers, dtype=torch.int64).view(rows, -1).to(device)
        found = _remember(_ADDRESSES, key, table)
    return found


# Address tables by (device, addresses, sizes of every tensor): tensors found
# to pass _addresses' checks at these addresses with these sizes.
_CHECKED: dict[tuple[Any, ...], Tensor] = {}


def _addresses(
    lists: list[list[Tensor]], device: torch.device, sizes: tuple[int, ...]
) -> tuple[Tensor, list[Tensor]]:
    """The address table of ``lists`` (parameters, gradients, state; the
    parameters of ``sizes``) on the device, and the gradients it holds.

    For addresses or sizes not seen before, each gradient and state is checked
    to hold its parameter's number of values, and a gradient that overlaps its
    parameter's memory (``p.grad = p.detach()``, or another window of the
    parameter's buffer) is copied first: the kernel reads it block by block as
    it writes the parameter. Tensors seen before at these addresses with these
    sizes were found to pass both.
    """
    pointers = _pointers(lists)
    numels = (sizes, *(tuple(map(Tensor.numel, ts)) for ts in lists[1:]))
    key = (device, pointers, numels)
    found = _CHECKED.get(key)  # the common case: one lookup
    if found is not None:
        return found, lists[1]
    params, grads = lists[0], lists[1]
    n = len(params)
    for ts, counts in zip(lists[1:], numels[1:], strict=True):
        # The kernel reads as many of each (an 8-bit state: their bytes).
        if counts != sizes and list(counts) != _packed(list(sizes), ts):
            raise RuntimeError(
                "fused=True: each gradient and state must have its parameter's number of elements"
            )
    overlapping = [
        i
        for i in range(n)
        if _overlap(pointers[i], pointers[n + i], sizes[i] * params[i].element_size())
    ]
    if not overlapping:
        return _remember(_CHECKED, key, _table(pointers, len(lists), device)), grads
    grads = list(grads)
    for i in overlapping:
        grads[i] = grads[i].clone()
    lists = [params, grads, *lists[2:]]
    return _table(_pointers(lists), len(lists), device), grads


def _packed(sizes: list[int], ts: list[Tensor]) -> list[int] | None:
    """The bytes of 8-bit states of ``sizes`` values (a scale per block of 256
    and a code per value), where ``ts`` are uint8; else None."""
    if not ts or ts[0].dtype != torch.uint8:
        return None
    return [4 * -(-n // rounding.EIGHT_BIT_BLOCK) + n for n in sizes]


def _overlap(a: int, b: int, size: int) -> bool:
    """Whether ``[a, a + size)`` and ``[b, b + size)`` share a byte (``size`` > 0)."""
    return size > 0 and a < b + size and b < a + size


# Coefficient tables (float64 groups, a tensor lr): one device tensor per
# distinct set of values, so that a set that recurs (QHM's, every step) is
# copied to the device once.
_VALUES: dict[tuple[Any, ...], Tensor] = {}


def _values(values: tuple[float, ...], device: torch.device) -> Tensor:
    key = (values, device)
    found = _VALUES.get(key)
    if found is not None:
        return found
    return _remember(_VALUES, key, torch.tensor(values, dtype=torch.float64).to(device))


def _as_float32(c: float) -> float:
    """A host coefficient as the launch's float32 scalar: rounded as IEEE arithmetic
    rounds it (``1e308`` is inf), which a float argument's conversion would refuse."""
    if not math.isfinite(c) or abs(c) <= 3.4028234663852886e38:
        return c
    return math.copysign(math.inf, c)


# -------------------------------------------------------------------- kernels
@triton.jit
def _lerp(start, end, weight):
    # torch.lerp's formula, so that the fused moments round as the foreach ones.
    return tl.where(
        weight < 0.5, start + weight * (end - start), end - (end - start) * (1 - weight)
    )


@triton.jit
def _block(numels, block_tensor, block_start, inf_ptr, HAS_INF, BLOCK):
    """This program's block: its tensor's index, the offsets and the mask (none
    where GradScaler found an inf or NaN: nothing is written)."""
    pid = tl.program_id(0)
    t = tl.load(block_tensor + pid)
    offs = tl.load(block_start + pid) + tl.arange(0, BLOCK)
    mask = offs < tl.load(numels + t)
    if HAS_INF:
        mask = tl.where(tl.load(inf_ptr) == 0, mask, False)
    return t, offs, mask


@triton.jit
def _address(addrs, n_tensors, t, k, DTYPE):
    """The address of tensor ``t`` of list ``k`` in the table."""
    return tl.load(addrs + k * n_tensors + t).to(tl.pointer_type(DTYPE))


@triton.jit
def _coefficient(value, table, k, IN_TABLE, COMPUTE):
    """Coefficient ``k``: the launch's scalar ``value``, or entry ``k`` of ``table``."""
    if IN_TABLE:
        return tl.load(table + k).to(COMPUTE)
    return tl.cast(value, COMPUTE)


@triton.jit
def _mix32(x):
    """qhoptim.rounding.mix32 (lowbias32) on uint32 values."""
    x = x ^ (x >> 16)
    x = x * tl.full((), 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full((), 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


# A state's storage (the kernels' NARROW): the parameters' dtype, bfloat16
# (its bits, as uint16), or 8-bit blocks (qhoptim.torch._state_dtype.eight_bit:
# one flat uint8 tensor, the float32 scales of its blocks of 256, then a code
# per value).
_SAME, _BFLOAT16, _EIGHT_BIT = 0, 1, 2


@triton.jit
def _hash32(offs, seeds, t, k):
    """The hash of the elements at ``offs`` under the seed of state ``k`` of
    tensor ``t`` (positions past 2**32 folded as the CPU kernel folds them),
    whose low half is qhoptim.rounding.noise16."""
    seed = tl.load(seeds + 3 * t + k).to(tl.uint32)
    position = (offs ^ (offs >> 32)).to(tl.uint32) * tl.full((), 0x9E3779B9, tl.uint32)
    return _mix32(position ^ seed)


@triton.jit
def _eight_bit_parts(ptr, n):
    """An 8-bit state's block scales and codes (its tensor holds ``n`` values)."""
    blocks = (n + 255) // 256
    return ptr.to(tl.pointer_type(tl.float32)), ptr + 4 * blocks


@triton.jit
def _level_bits(k, SIGNED):
    """The float32 bits of the 8-bit ladder's level ``k >= 1``
    (qhoptim.rounding.eight_bit_level_bits): its rung, an exponent and the
    mantissa's top three bits, ``k`` rungs above that of code 0."""
    OFFSET: tl.constexpr = 8 * 127 - (127 if SIGNED else 255)  # rounding.eight_bit_rung_offset
    return (k + OFFSET) << 20  # rounding.EIGHT_BIT_RUNG_SHIFT


@triton.jit
def _load_state(ptr, offs, mask, n, SIGNED, NARROW, COMPUTE):
    """A state as the step computes with it: a bfloat16 state's bits widened
    exactly to float32; an 8-bit state's codes decoded (level times scale,
    bit 7 the sign of a ``SIGNED`` state, the non-finite code NaN or +inf:
    qhoptim.rounding.eight_bit_decode_reference), each level made from its
    code's bits rather than read from a table (a load per value)."""
    if NARROW == 1:
        bits = tl.load(ptr + offs, mask=mask).to(tl.uint32) << 16
        return bits.to(tl.float32, bitcast=True).to(COMPUTE)
    if NARROW == 2:
        scales, codes = _eight_bit_parts(ptr, n)
        code = tl.load(codes + offs, mask=mask, other=0).to(tl.int32)
        scale = tl.load(scales + offs // 256, mask=mask, other=0.0)
        k = code & 127 if SIGNED else code
        level = _level_bits(k, SIGNED).to(tl.float32, bitcast=True)
        value = tl.where(k == 0, 0.0, level) * scale
        if SIGNED:
            value = tl.where(code > 128, -value, value)
            nan = tl.full((), 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
            value = tl.where(code == 128, nan, value)
        else:
            inf = tl.full((), 0x7F800000, tl.int32).to(tl.float32, bitcast=True)
            value = tl.where(code == 1, inf, value)
        return value.to(COMPUTE)
    return tl.load(ptr + offs, mask=mask).to(COMPUTE)


@triton.jit
def _in_dtype(x, DTYPE: tl.constexpr):
    """``x`` (float32, or the parameters' COMPUTE dtype) in ``DTYPE``, rounded to
    nearest, ties to even: a bfloat16 one from its float32 bits, as the GPU's
    conversion and the C++ kernel round (Triton's interpreter truncates, which
    moved bfloat16 parameters towards zero); a NaN keeps its quiet bit."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        rounded = bits + 0x7FFF + ((bits >> 16) & 1)
        top = tl.where(x != x, bits | 0x00400000, rounded) >> 16
        return top.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


@triton.jit
def _store_state(ptr, offs, mask, value, n, seeds, t, k, SIGNED, NARROW, DTYPE, BLOCK):
    """Store a state's new ``value``, rounded by qhoptim.rounding's rule with
    the noise of state ``k`` of tensor ``t`` -- the bits the CPU kernel and
    every backend store: bfloat16 (``NARROW`` 1), the noise added to the
    float32's bits and the top half kept (rounding.round_bits); 8-bit
    (``NARROW`` 2), each block of 256 scaled by its largest finite magnitude
    and each value one of the two levels around it
    (rounding.eight_bit_encode_reference and rounding.eight_bit_code)."""
    if NARROW == 1:
        bits = value.to(tl.float32).to(tl.uint32, bitcast=True)
        nan = (0x7F800000 - (bits & 0x7FFFFFFF)) >> 31  # a NaN: no noise, quiet (rounding)
        bits = (bits + (_hash32(offs, seeds, t, k) & 0xFFFF) * (1 - nan)) | (nan << 22)
        tl.store(ptr + offs, (bits >> 16).to(tl.uint16), mask=mask)
    elif NARROW == 2:
        scales, codes = _eight_bit_parts(ptr, n)
        x = value.to(tl.float32)
        absolute = tl.abs(x)
        finite = absolute <= 3.4028234663852886e38
        # Subnormal magnitudes and ratios read as 0 (rounding.EIGHT_BIT_SMALLEST).
        magnitude = tl.where(finite & (absolute >= 1.1754943508222875e-38) & mask, absolute, 0.0)
        rows = tl.reshape(magnitude, (BLOCK // 256, 256))
        scale = tl.max(rows, axis=1)
        # Once per block: ratios are products. Above 2**126 (rounding.
        # EIGHT_BIT_LARGEST_PLAIN_SCALE) the reciprocal of a quarter of the
        # scale, the product then times 1/4: no subnormal reciprocal.
        large = scale > 8.507059173023462e37
        inverse = tl.where(large, 4.0, 1.0) / scale
        after = tl.where(large, 0.25, 1.0)
        ratio = tl.reshape(rows * inverse[:, None] * after[:, None], (BLOCK,))
        ratio = tl.where((ratio != ratio) | (ratio < 1.1754943508222875e-38), 0.0, ratio)
        # The levels around the ratio from its bits, no table read
        # (rounding.eight_bit_levels_around): its rung is the level below's;
        # below the first level, 0 and the first; from the top, the last pair.
        TOP: tl.constexpr = 127 if SIGNED else 255  # the ladder's top code
        OFFSET: tl.constexpr = 8 * 127 - TOP  # rounding.eight_bit_rung_offset
        bits = ratio.to(tl.int32, bitcast=True)
        rung = bits & -(1 << 20)  # the bits under the rung cleared
        low = (bits >> 20) - OFFSET
        under = low < 1
        over = low > TOP - 1
        below = tl.where(under, 0, tl.where(over, _level_bits(TOP - 1, SIGNED), rung))
        above = tl.where(
            under,
            _level_bits(1, SIGNED),
            tl.where(over, _level_bits(TOP, SIGNED), rung + (1 << 20)),
        )
        low = tl.where(under, 0, tl.where(over, TOP - 1, low))
        below = below.to(tl.float32, bitcast=True)
        above = above.to(tl.float32, bitcast=True)
        # rounding.eight_bit_noise_source: the second moment (state 1) takes
        # the high half of its first moment's hash.
        if k == 1:
            noise = _hash32(offs, seeds, t, 0) >> 16
        else:
            noise = _hash32(offs, seeds, t, k) & 0xFFFF
        threshold = noise.to(tl.float32) * (1.0 / 65536.0)
        code = low + (ratio - below > threshold * (above - below)).to(tl.int32)
        if SIGNED:  # no -0: 128 is the non-finite code
            code = tl.where((x < 0) & (code > 0), code + 128, code)
            code = tl.where(finite, code, 128)
        else:  # a positive second moment is never 0, nor the code of inf (1)
            code = tl.where((code <= 1) & (ratio > 0), 2, code)
            code = tl.where(finite, code, 1)
        tl.store(codes + offs, code.to(tl.uint8), mask=mask)
        # The scales of the blocks this program holds values of.
        held = tl.max(tl.reshape(mask.to(tl.int32), (BLOCK // 256, 256)), axis=1) > 0
        first = tl.min(offs, axis=0) // 256 + tl.arange(0, BLOCK // 256)
        tl.store(scales + first, scale, mask=held)
    else:
        tl.store(ptr + offs, _in_dtype(value, DTYPE), mask=mask)


@triton.jit
def _load_grad(g_ptr, offs, mask, p, grad_multiplier, coupled_weight_decay, scale_ptr,
               HAS_SCALE, COMPUTE):  # fmt: skip
    """The gradient as the rule takes it: ``maximize``'s sign, GradScaler's
    scale taken out, coupled weight decay added (where it is not 0)."""
    g = tl.load(g_ptr + offs, mask=mask).to(COMPUTE) * grad_multiplier
    if HAS_SCALE:
        g = g / tl.load(scale_ptr).to(COMPUTE)
    # Without coupled decay g itself: a NaN parameter (0 * NaN) leaves its state alone.
    return tl.where(coupled_weight_decay != 0, g + coupled_weight_decay * p, g)


@triton.jit(**_JIT)
def _qhm_kernel(
    addrs, numels, block_tensor, block_start, n_tensors, table,
    decay, buffer_value, grad_value, grad_multiplier, coupled_weight_decay, grad_to_buffer,
    scale_ptr, inf_ptr, seeds,
    IN_TABLE: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_INF: tl.constexpr,
    NARROW: tl.constexpr, DTYPE: tl.constexpr, COMPUTE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t, offs, mask = _block(numels, block_tensor, block_start, inf_ptr, HAS_INF, BLOCK)
    n = tl.load(numels + t)
    STATE: tl.constexpr = tl.uint16 if NARROW == 1 else (tl.uint8 if NARROW == 2 else DTYPE)
    p_ptr = _address(addrs, n_tensors, t, 0, DTYPE)
    g_ptr = _address(addrs, n_tensors, t, 1, DTYPE)
    b_ptr = _address(addrs, n_tensors, t, 2, STATE)
    # rules.decoupled_decay_factor, rules.fold_qhm, maximize's sign, coupled
    # decay and rules.qhm_coefficients' grad_to_buffer (the order of _QHM_VALUES).
    decay = _coefficient(decay, table, 0, IN_TABLE, COMPUTE)
    buffer_value = _coefficient(buffer_value, table, 1, IN_TABLE, COMPUTE)
    grad_value = _coefficient(grad_value, table, 2, IN_TABLE, COMPUTE)
    grad_multiplier = _coefficient(grad_multiplier, table, 3, IN_TABLE, COMPUTE)
    coupled_weight_decay = _coefficient(coupled_weight_decay, table, 4, IN_TABLE, COMPUTE)
    grad_to_buffer = _coefficient(grad_to_buffer, table, 5, IN_TABLE, COMPUTE)
    p = tl.load(p_ptr + offs, mask=mask).to(COMPUTE)
    g = _load_grad(g_ptr, offs, mask, p, grad_multiplier, coupled_weight_decay, scale_ptr,
                   HAS_SCALE, COMPUTE)  # fmt: skip
    stored = _load_state(b_ptr, offs, mask, n, True, NARROW, COMPUTE)
    b = _lerp(stored, g, grad_to_buffer)
    p = p * decay + buffer_value * b + grad_value * g
    _store_state(b_ptr, offs, mask, b, n, seeds, t, 0, True, NARROW, DTYPE, BLOCK)
    tl.store(p_ptr + offs, _in_dtype(p, DTYPE), mask=mask)


@triton.jit(**_JIT)
def _qhadam_kernel(
    addrs, numels, block_tensor, block_start, n_tensors, table, row_stride,
    exp_avg_sq_weight, grad_sq_weight, eps, exp_avg_value, grad_value, decay,
    grad_multiplier, coupled_weight_decay, grad_to_exp_avg, exp_avg_sq_decay,
    grad_sq_to_exp_avg_sq,
    scale_ptr, inf_ptr, seeds,
    FORM: tl.constexpr, AMSGRAD: tl.constexpr, IN_TABLE: tl.constexpr,
    HAS_SCALE: tl.constexpr, HAS_INF: tl.constexpr, NARROW: tl.constexpr,
    DTYPE: tl.constexpr, COMPUTE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t, offs, mask = _block(numels, block_tensor, block_start, inf_ptr, HAS_INF, BLOCK)
    n = tl.load(numels + t)
    STATE: tl.constexpr = tl.uint16 if NARROW == 1 else (tl.uint8 if NARROW == 2 else DTYPE)
    p_ptr = _address(addrs, n_tensors, t, 0, DTYPE)
    g_ptr = _address(addrs, n_tensors, t, 1, DTYPE)
    m_ptr = _address(addrs, n_tensors, t, 2, STATE)
    s_ptr = _address(addrs, n_tensors, t, 3, STATE)
    # rules.FoldedQHAdam's weights, eps and values, rules.decoupled_decay_factor,
    # maximize's sign, coupled decay and rules.qhadam_moment_weights (the order
    # of _QHADAM_VALUES): scalars, one table row for the group (row_stride 0),
    # or one row per tensor.
    row = table + t * row_stride
    exp_avg_sq_weight = _coefficient(exp_avg_sq_weight, row, 0, IN_TABLE, COMPUTE)
    grad_sq_weight = _coefficient(grad_sq_weight, row, 1, IN_TABLE, COMPUTE)
    eps = _coefficient(eps, row, 2, IN_TABLE, COMPUTE)
    exp_avg_value = _coefficient(exp_avg_value, row, 3, IN_TABLE, COMPUTE)
    grad_value = _coefficient(grad_value, row, 4, IN_TABLE, COMPUTE)
    decay = _coefficient(decay, row, 5, IN_TABLE, COMPUTE)
    grad_multiplier = _coefficient(grad_multiplier, row, 6, IN_TABLE, COMPUTE)
    coupled_weight_decay = _coefficient(coupled_weight_decay, row, 7, IN_TABLE, COMPUTE)
    grad_to_exp_avg = _coefficient(grad_to_exp_avg, row, 8, IN_TABLE, COMPUTE)
    exp_avg_sq_decay = _coefficient(exp_avg_sq_decay, row, 9, IN_TABLE, COMPUTE)
    grad_sq_to_exp_avg_sq = _coefficient(grad_sq_to_exp_avg_sq, row, 10, IN_TABLE, COMPUTE)
    p = tl.load(p_ptr + offs, mask=mask).to(COMPUTE)
    g = _load_grad(g_ptr, offs, mask, p, grad_multiplier, coupled_weight_decay, scale_ptr,
                   HAS_SCALE, COMPUTE)  # fmt: skip
    m = _load_state(m_ptr, offs, mask, n, True, NARROW, COMPUTE)
    m = _lerp(m, g, grad_to_exp_avg)
    s = exp_avg_sq_decay * _load_state(s_ptr, offs, mask, n, False, NARROW, COMPUTE)
    s = s + grad_sq_to_exp_avg_sq * g * g
    # What the denominator reads: the second moment, or (AMSGrad) its running
    # maximum, rules.amsgrad_maximum (NaN if either is NaN, as torch.maximum).
    d = s
    if AMSGRAD:
        v_ptr = _address(addrs, n_tensors, t, 4, STATE)
        v = _load_state(v_ptr, offs, mask, n, False, NARROW, COMPUTE)
        d = tl.where((v != v) | (s != s), v + s, tl.maximum(v, s))
        _store_state(v_ptr, offs, mask, d, n, seeds, t, 2, False, NARROW, DTYPE, BLOCK)
    if FORM == 0:
        base = tl.sqrt(exp_avg_sq_weight * d)
    elif FORM == 1:
        base = tl.sqrt(grad_sq_weight * (g * g))
    else:
        base = tl.sqrt(exp_avg_sq_weight * d + grad_sq_weight * (g * g))
    p = p * decay + (exp_avg_value * m + grad_value * g) / (base + eps)
    _store_state(m_ptr, offs, mask, m, n, seeds, t, 0, True, NARROW, DTYPE, BLOCK)
    _store_state(s_ptr, offs, mask, s, n, seeds, t, 1, False, NARROW, DTYPE, BLOCK)
    tl.store(p_ptr + offs, _in_dtype(p, DTYPE), mask=mask)


@triton.jit
def _minus_expm1(x):
    """``-expm1(x)`` in float64 (:func:`qhoptim.rules.bias_correction`'s form, which
    Triton's language lacks): its series where ``|x| < 1e-2`` (truncated after
    ``x**7``: 2e-19 relative), ``1 - exp(x)`` beyond (1e-14 relative)."""
    series = x * (
        1 + x * (0.5 + x * (1 / 6 + x * (1 / 24 + x * (1 / 120 + x * (1 / 720 + x / 5040)))))
    )
    return -tl.where(tl.abs(x) < 1e-2, series, tl.exp(x) - 1)


@triton.jit(**_JIT)
def _qhadam_rows_kernel(
    counts, rows, hyper, lr_ptr, inf_ptr,
    LR_ON_DEVICE: tl.constexpr, DECOUPLED: tl.constexpr, GRAD_TERM: tl.constexpr,
    HAS_INF: tl.constexpr,
):  # fmt: skip
    """A capturable step's coefficients, on the device, one row per tensor (program):
    its step count advanced (but for a step GradScaler found an inf in), then
    ``_qhadam_kernel``'s row from it -- rules.qhadam_coefficients' weights over
    the bias corrections, times ``-lr`` (rules.fold_qhadam, not factored out)."""
    t = tl.program_id(0)
    count_ptr = tl.load(counts + t).to(tl.pointer_type(tl.float32))
    count = tl.load(count_ptr)
    if HAS_INF:
        count = count + tl.where(tl.load(inf_ptr) == 0, 1.0, 0.0)
    else:
        count = count + 1.0
    tl.store(count_ptr, count)
    step = count.to(tl.float64)
    # hyper: log(beta1), log(beta2), and rules.qhadam_coefficients at bias
    # corrections of 1 (grad_weight, exp_avg_weight, grad_sq_weight,
    # exp_avg_sq_weight), eps, weight_decay, lr, then _constants(hp).
    bias_correction1 = _minus_expm1(step * tl.load(hyper))
    bias_correction2 = _minus_expm1(step * tl.load(hyper + 1))
    if LR_ON_DEVICE:
        lr = tl.load(lr_ptr).to(tl.float64)
    else:
        lr = tl.load(hyper + 8)
    row = rows + 11 * t
    tl.store(row, tl.load(hyper + 5) / bias_correction2)
    tl.store(row + 1, tl.load(hyper + 4))
    tl.store(row + 2, tl.load(hyper + 6))
    tl.store(row + 3, -lr * (tl.load(hyper + 3) / bias_correction1))
    if GRAD_TERM:
        tl.store(row + 4, -lr * tl.load(hyper + 2))
    else:
        tl.store(row + 4, 0.0)
    if DECOUPLED:
        tl.store(row + 5, 1 - lr * tl.load(hyper + 7))
    else:
        tl.store(row + 5, 1.0)
    for k in tl.static_range(5):
        tl.store(row + 6 + k, tl.load(hyper + 9 + k))


# ----------------------------------------------------------------- launching
# Triton's launch of a jitted function binds and specializes every argument
# anew (tens of microseconds a launch, the largest part of a small step's host
# work). The kernels here are compiled for their constexprs and argument dtypes
# only (no specialization on an integer's value or a pointer's alignment), so
# the compiled kernel of a set of those is launched directly, with every
# argument in the signature's order (as Triton's own launch passes them, since
# Triton 3.2). Not under the interpreter, which has no compiled kernels.
_DIRECT = (
    not _INTERPRETED
    and _TRITON_VERSION >= (3, 2)
    and "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters
)
_COMPILED: dict[tuple[Any, ...], Any] = {}


def _launch(kernel: Any, grid: int, *args: Any, **kwargs: Any) -> None:
    """Launch ``kernel`` on ``grid`` programs with ``args`` and the constexprs and
    options ``kwargs`` (one place, so that a benchmark can time a step's host
    work without it)."""
    if not _DIRECT:
        kernel[(grid,)](*args, **kwargs)
        return
    types = tuple([a.dtype if isinstance(a, Tensor) else type(a) for a in args])
    # Tensors by their dtypes: a launch compiled for one found_inf or seed table
    # serves the next step's (the kernels take pointers, not specialized on them).
    options = tuple([(k, v.dtype if isinstance(v, Tensor) else v) for k, v in kwargs.items()])
    key = (kernel, args[0].device, types, options)
    compiled = _COMPILED.get(key)
    if compiled is None:  # the first launch of these: compiled, or found in Triton's caches
        _remember(_COMPILED, key, kernel[(grid,)](*args, **kwargs))
        return
    constexprs = [kwargs[name] for name in kernel.arg_names[len(args) :]]
    compiled[(grid, 1, 1)](*args, *constexprs)


def _flags(
    params: list[Tensor],
    grad_scale: Tensor | None,
    found_inf: Tensor | None,
    seeds: Tensor | None = None,
    eight_bit: bool = False,
) -> dict[str, Any]:
    first = params[0]
    return {
        "scale_ptr": grad_scale if grad_scale is not None else first,
        "inf_ptr": found_inf if found_inf is not None else first,
        "seeds": seeds if seeds is not None else first,
        "BLOCK": _BLOCK,
        "num_warps": _NUM_WARPS,
        **_constexprs(
            first.dtype,
            grad_scale is not None,
            found_inf is not None,
            _SAME if seeds is None else (_EIGHT_BIT if eight_bit else _BFLOAT16),
        ),
    }


@functools.cache
def _constexprs(dtype: torch.dtype, has_scale: bool, has_inf: bool, narrow: int) -> dict[str, Any]:
    """A launch's constexprs and options other than its block and warps (made
    once for each combination: they are part of each step's host work)."""
    return {
        "HAS_SCALE": has_scale,
        "HAS_INF": has_inf,
        "NARROW": narrow,
        "DTYPE": _TL_DTYPES[dtype],
        "COMPUTE": tl.float64 if dtype == torch.float64 else tl.float32,
        # No fused multiply-adds: each product and sum rounded as written, as
        # the C++ kernel computes (and the narrow-state rules are stated).
        "enable_fp_fusion": False,
    }


class Layout(NamedTuple):
    """What a launch needs to know of a list of parameters, their gradients and
    state beyond their values: the address table and the blocks (on the
    device), and what they were found for -- the device, the parameters'
    dtype and sizes."""

    device: torch.device
    dtype: torch.dtype
    sizes: tuple[int, ...]
    addresses: Tensor
    blocks: _Blocks


# The layouts of whole param groups (one device and dtype, contiguous, no
# gradient overlapping its parameter), by their tensors' addresses: where the
# tensors of a group's next step are where they were -- parameters and state
# stay put, and the allocator hands a gradient reallocated by
# ``zero_grad(set_to_none=True)`` its old block back -- the step skips the
# grouping, contiguity and table work, at one lookup and a few checks.
_LAYOUTS: dict[tuple[Any, ...], Layout] = {}
_DTYPE = operator.attrgetter("dtype")


def known_layout(lists: list[list[Tensor]]) -> Layout | None:
    """The layout of ``lists`` (parameters, gradients, state) if a step found it
    for tensors at these addresses and every tensor still has the size it had
    then and is contiguous, and the parameters keep their dtype; else None.

    Tensors at the same addresses are on the same devices (one address space
    for host and GPUs). What can change at an address is checked here: a
    parameter's or state's size and a tensor's strides (``p.data`` set to
    another view of its memory, a state loaded at a freed tensor's address),
    and a parameter's dtype. A gradient has its parameter's size and dtype
    (autograd checks them when it is set, and a parameter resized since then
    fails the parameters' check); the state is this optimizer's, made like its
    parameter."""
    found = _LAYOUTS.get((len(lists), _pointers(lists)))
    if found is None:
        return None
    sizes = found.sizes
    params, _, *states = lists
    if not all(map(operator.is_, map(_DTYPE, params), itertools.repeat(found.dtype))):
        return None
    for ts in (params, *states):
        if tuple(map(Tensor.numel, ts)) != sizes:
            return None
    if not all(map(_tensors.all_contiguous, lists)):
        return None
    return found if _tensors.runs_triton(found.device) else None


def _layout(
    lists: list[list[Tensor]], *, whole: bool = False
) -> tuple[Tensor, _Blocks, list[Tensor]] | None:
    """The address table and the blocks of ``lists`` (parameters, gradients, state),
    and the gradients the table holds (copies of any that overlap their
    parameters); None when the lists hold no element. ``whole``: the lists
    are a param group's own, contiguous, of one device and dtype; their
    layout is kept for :func:`known_layout` where no gradient was copied."""
    params = lists[0]
    device = params[0].device
    sizes = tuple(map(Tensor.numel, params))
    blocks = _blocks(sizes, device)
    if blocks.block_tensor.numel() == 0:
        return None
    addresses, grads = _addresses(lists, device, sizes)
    if whole and grads is lists[1]:
        layout = Layout(device, params[0].dtype, sizes, addresses, blocks)
        _remember(_LAYOUTS, (len(lists), _pointers(lists)), layout)
    return addresses, blocks, grads


def _kept_or_new_layout(
    lists: list[list[Tensor]], layout: Layout | None, whole: bool
) -> tuple[Tensor, _Blocks, list[Tensor]] | None:
    """:func:`_layout` of ``lists``, or the table and blocks of ``layout``, a
    :func:`known_layout` of theirs."""
    if layout is not None:
        return layout.addresses, layout.blocks, lists[1]
    return _layout(lists, whole=whole)


def _scalars(values: tuple[Any, ...], like: Tensor) -> tuple[Tensor, tuple[float, ...]]:
    """``values`` as the launch takes them: the launch's float32 scalars, or for
    float64 parameters a float64 table on the device (and zeros as scalars)."""
    if like.dtype == torch.float64:
        return _values(tuple(map(float, values)), like.device), (0.0,) * len(values)
    return like, tuple(_as_float32(float(v)) for v in values)


def _one_row(
    hp: _tensors.QHAdamHyperparameters, step: float, like: Tensor
) -> tuple[Tensor, tuple[float, ...]]:
    """:func:`_scalars` of the group's one row of coefficients at ``step``."""
    if like.dtype == torch.float64:
        return _scalars(_host_rows(hp, [step])[0], like)
    return like, _float32_row(hp, step)


@functools.lru_cache(maxsize=256)
def _float32_row(hp: _tensors.QHAdamHyperparameters, step: float) -> tuple[float, ...]:
    """The launch's float32 scalars at ``step``, kept: a step's coefficients are
    those of a few hyperparameters and its number, and recur (bias corrections
    stop changing in float32 after a few thousand steps)."""
    return tuple(_as_float32(float(v)) for v in _host_rows(hp, [step])[0])


def _sign(hp: Any) -> float:
    return -1.0 if hp.maximize else 1.0


def _coupled(hp: Any) -> float:
    return 0.0 if hp.decoupled_weight_decay else hp.weight_decay


def _decay_factor(hp: Any) -> Any:
    """:func:`qhoptim.rules.decoupled_decay_factor`, or 1 without decoupled decay."""
    if hp.decoupled_weight_decay and hp.weight_decay != 0:
        return rules.decoupled_decay_factor(hp.lr, hp.weight_decay)
    return 1.0


def qhm_(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    hp: _tensors.QHMHyperparameters,
    *,
    grad_scale: Tensor | None,
    found_inf: Tensor | None,
    seeds: Tensor | None = None,
    eight_bit: bool = False,
    layout: Layout | None = None,
    whole: bool = False,
) -> None:
    """One fused QHM step over tensors of one device and dtype, contiguous.

    ``seeds`` (int64 ``[tensors, 3]`` on the device): the buffers are bfloat16,
    or 8-bit (``eight_bit``), rounded stochastically with each tensor's first seed.
    ``layout``: the lists' :func:`known_layout`; ``whole``: see :func:`_layout`."""
    found = _kept_or_new_layout([params, grads, momentum_buffers], layout, whole)
    if found is None:  # only empty tensors
        return
    addresses, blocks, _grads = found  # _grads: alive until the launch has read them
    scalars: tuple[float, ...]
    if isinstance(hp.lr, Tensor):  # evaluated on the device: nothing is read back
        # Folded in float64, as the table holds them: a float32 lr's products
        # would be 1e-9 off for float64 parameters.
        lr = hp.lr.to(params[0].device, torch.float64)
        values = _qhm_values(hp._replace(lr=lr))
        table, scalars = torch.stack([torch.zeros_like(lr) + v for v in values]), (0.0,) * 6
    elif params[0].dtype == torch.float64:
        table, scalars = _scalars(_qhm_values(hp), params[0])
    else:
        table, scalars = params[0], _qhm_float32_scalars(hp)
    _launch(
        _qhm_kernel,
        blocks.block_tensor.numel(),
        addresses,
        *blocks,
        len(params),
        table,
        *scalars,
        IN_TABLE=table is not params[0],
        **_flags(params, grad_scale, found_inf, seeds, eight_bit),
    )


def _qhm_values(hp: _tensors.QHMHyperparameters) -> tuple[Any, ...]:
    """``_qhm_kernel``'s coefficients, in the order it reads them."""
    c = rules.qhm_coefficients(hp.momentum, hp.nu)
    return (
        _decay_factor(hp),
        *rules.fold_qhm(c, hp.lr),
        _sign(hp),
        _coupled(hp),
        c.grad_to_buffer,
    )


@functools.lru_cache(maxsize=256)
def _qhm_float32_scalars(hp: _tensors.QHMHyperparameters) -> tuple[float, ...]:
    """:func:`_qhm_values` as the launch's float32 scalars, kept: they change only
    with the hyperparameters (a schedule's learning rates recur less often than
    the steps that take them)."""
    return tuple(_as_float32(float(v)) for v in _qhm_values(hp))


def _constants(hp: _tensors.QHAdamHyperparameters) -> tuple[float, ...]:
    """The kernel's coefficients that no step changes: maximize's sign, coupled decay
    and :func:`qhoptim.rules.qhadam_moment_weights` (``_qhadam_kernel``'s 7th to 11th)."""
    w = rules.qhadam_moment_weights(hp.beta1, hp.beta2)
    return _sign(hp), _coupled(hp), w.grad_to_exp_avg, w.exp_avg_sq_decay, w.grad_sq_to_exp_avg_sq


def _host_rows(hp: _tensors.QHAdamHyperparameters, steps: list[float]) -> list[tuple[float, ...]]:
    """The kernel's coefficients of each step number, in ``_qhadam_kernel``'s order:
    :func:`qhoptim.torch._kernels.host_fold`'s, the decay factor, :func:`_constants`."""
    lr = float(hp.lr)
    per_group = (_decay_factor(hp._replace(lr=lr)), *_constants(hp))
    rows: dict[float, tuple[float, ...]] = {}
    for t in steps:
        if t not in rows:
            fold = _kernels.host_fold(t, lr, hp.beta1, hp.beta2, hp.nu1, hp.nu2, hp.eps)
            rows[t] = (*fold[1:], *per_group)
    return [rows[t] for t in steps]


def qhadam_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor] | None,
    steps: list[float] | list[Tensor],
    hp: _tensors.QHAdamHyperparameters,
    *,
    grad_scale: Tensor | None,
    found_inf: Tensor | None,
    seeds: Tensor | None = None,
    eight_bit: bool = False,
    layout: Layout | None = None,
    whole: bool = False,
) -> None:
    """One fused QHAdam step over tensors of one device and dtype, contiguous.

    ``steps``: the number of the step being taken, per tensor, as Python
    numbers (the caller has advanced the counts; ``found_inf`` must then be
    None: a skipped step is the caller's to skip), or the step counts as
    tensors on the device (a capturable step), advanced here -- but for a step
    GradScaler found an inf in, as torch's fused Adam does. With
    ``hp.amsgrad``, ``max_exp_avg_sqs`` are the running maxima. ``seeds``
    (int64 ``[tensors, 3]`` on the device): the moments (and maxima) are
    bfloat16, or 8-bit (``eight_bit``), rounded
    stochastically with these seeds. ``layout`` and ``whole``: see :func:`qhm_`.
    """
    lists = [params, grads, exp_avgs, exp_avg_sqs, *([max_exp_avg_sqs] if hp.amsgrad else [])]
    on_device = isinstance(steps[0], Tensor) if steps else False
    if not on_device and found_inf is not None:
        raise ValueError("steps as numbers: a step GradScaler skips is the caller's to skip")
    counts = cast(list[Tensor], steps) if on_device else []
    scalars: tuple[float, ...] = (0.0,) * 11
    if on_device and all(c.dtype == torch.float32 for c in counts):
        table = _device_rows(counts, hp, found_inf)  # advances the counts
        row_stride = 11
    elif on_device or isinstance(hp.lr, Tensor):
        if on_device:  # counts of another dtype (a functional call's): torch operations
            torch._foreach_add_(counts, 1)
            if found_inf is not None:
                torch._foreach_sub_(counts, [found_inf] * len(counts))
        device_steps = counts if on_device else _on_device(steps, params[0])
        table = _kernels.device_coefficients(device_steps, params[0], hp, *_constants(hp))
        row_stride = table.shape[1]
    else:
        numbers = [float(t) for t in steps]
        if numbers.count(numbers[0]) == len(numbers):  # one step for the group: the normal case
            table, scalars = _one_row(hp, numbers[0], params[0])
            row_stride = 0
        else:  # tensors that missed steps: a row each
            rows = _host_rows(hp, numbers)
            table = torch.tensor(rows, dtype=torch.float64).to(params[0].device)
            row_stride = 11
    found = _kept_or_new_layout(cast(list[list[Tensor]], lists), layout, whole)
    if found is None:  # only empty tensors
        return
    addresses, blocks, _grads = found  # _grads: alive until the launch has read them
    _launch(
        _qhadam_kernel,
        blocks.block_tensor.numel(),
        addresses,
        *blocks,
        len(params),
        table,
        row_stride,
        *scalars,
        FORM=_kernels.DENOMINATOR_FORMS[rules.qhadam_denominator(hp.nu2)],
        AMSGRAD=hp.amsgrad,
        IN_TABLE=table is not params[0],
        **_flags(params, grad_scale, found_inf if on_device else None, seeds, eight_bit),
    )


# Each group's rows of device coefficients (a capturable step's): one buffer
# per device and size, which a CUDA graph replays in place.
_ROWS: dict[tuple[Any, ...], Tensor] = {}


def _device_rows(
    counts: list[Tensor], hp: _tensors.QHAdamHyperparameters, found_inf: Tensor | None
) -> Tensor:
    """The rows of a capturable step, ``[tensors, 11]`` float64 on the device, made
    by one launch that also advances the step counts (``_qhadam_rows_kernel``)."""
    device = counts[0].device
    key = (device, len(counts))
    rows = _ROWS.get(key)
    if rows is None:
        rows = _remember(
            _ROWS, key, torch.empty(len(counts), 11, dtype=torch.float64, device=device)
        )
    c = rules.qhadam_coefficients(hp.nu1, hp.nu2, 1.0, 1.0)
    lr_on_device = isinstance(hp.lr, Tensor)
    hyper = _values(
        (
            math.log(hp.beta1) if hp.beta1 > 0 else -math.inf,
            math.log(hp.beta2) if hp.beta2 > 0 else -math.inf,
            *c,
            hp.eps,
            hp.weight_decay,
            0.0 if lr_on_device else float(hp.lr),
            *_constants(hp),
        ),
        device,
    )
    lr = hp.lr.to(device) if lr_on_device else hyper
    _launch(
        _qhadam_rows_kernel,
        len(counts),
        _table(_pointers([counts]), 1, device),
        rows,
        hyper,
        lr,
        found_inf if found_inf is not None else hyper,
        LR_ON_DEVICE=lr_on_device,
        DECOUPLED=bool(hp.decoupled_weight_decay and hp.weight_decay != 0),
        GRAD_TERM=hp.nu1 != 1,
        HAS_INF=found_inf is not None,
    )
    return rows


def _on_device(steps: list[Any], like: Tensor) -> list[Tensor]:
    """Host step numbers as 0-d float32 tensors on ``like``'s device (a tensor lr)."""
    return list(torch.tensor([float(t) for t in steps], dtype=torch.float32).to(like.device))
