"""Optimizer state in a narrower dtype than the parameters (``state_dtype``).

QHM's momentum buffer and QHAdam's moments are stored in ``state_dtype``
(``torch.bfloat16`` halves a float32 model's state: QHAdam 8 -> 4 bytes per
parameter, QHM 4 -> 2). A fused kernel reads and writes the narrow state
itself where it can (:func:`in_fused_kernel`: the C++ kernel on CPU, every
path; the Triton kernels with ``fused=True`` on CUDA); any other
step runs the ordinary kernels (per-tensor, foreach or fused) on working
copies in the parameters' dtype, made for a few million values at a time, so
that the step's peak memory falls with the stored state, and writes the
result back rounded to ``state_dtype``.

Rounding to bfloat16 is stochastic by default: bfloat16 keeps 8 significant
bits, and round-to-nearest would lose every EWMA increment smaller than half
a unit in the last place -- with ``beta2 = 0.999`` the second moment would
stop moving once ``(1 - beta2) * g**2`` falls below about ``2**-9`` of it.
Stochastic rounding is unbiased, so the stored moments follow the float32
ones on average. Its randomness is counter-based, the rule of
:mod:`qhoptim.rounding` (every backend's): a hash of the step number, the
parameter's position in the optimizer and each element's position, never
torch's global generator, so a run resumed from a checkpoint rounds exactly as
the uninterrupted run. Other narrow dtypes (float16) round to nearest.

``state_dtype=torch.uint8`` is an 8-bit blockwise state (:func:`eight_bit`):
a byte per value and a float32 scale per block, decoded into the working
copies and encoded back with the same noise.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from qhoptim import rounding
from qhoptim.torch import _extension
from qhoptim.torch._tensors import runs_triton

__all__ = [
    "PARAM_SHAPE",
    "STATE_DTYPES",
    "check_state_dtype",
    "converted",
    "eight_bit_levels",
    "hash32",
    "in_fused_kernel",
    "narrow",
    "rounding_seed",
    "state_seeds",
    "step_narrow_state",
    "step_with_narrow_state",
    "stochastic_round_",
]

#: The dtypes ``state_dtype`` may name (``None``: the parameter's own);
#: ``torch.uint8`` is the 8-bit blockwise state (:func:`eight_bit`).
STATE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.uint8)
BLOCK = rounding.EIGHT_BIT_BLOCK

# Working copies are made for about this many values at a time, and the
# rounding noise for this many.
CHUNK_VALUES = 1 << 22
NOISE_VALUES = 1 << 20

_MASK32 = (1 << 32) - 1
_DTYPE = operator.attrgetter("dtype")
_DEVICE = operator.attrgetter("device")
# torch has no uint32 arithmetic: values below 2**32 in int64, products
# wrapped back (an int64 product past 2**63 wraps too; its low 32 bits are exact).
_INT64_BITS = rounding.Bits(wrap=lambda x: x & _MASK32, select=torch.where)


def check_state_dtype(group: dict[str, Any]) -> None:
    """A param group's ``state_dtype`` and ``stochastic_rounding``, with the flags they exclude."""
    dtype = group.get("state_dtype")
    name = _name(dtype) if dtype in STATE_DTYPES else None
    allowed = tuple(_name(d) for d in STATE_DTYPES)
    rounding.check_state_dtype(name, dtype, allowed=allowed, spelled="torch.")
    rounding.check_stochastic_rounding(
        group.get("stochastic_rounding"), name, allowed=allowed, spelled="torch."
    )
    if dtype is None:
        return
    for flag in ("capturable", "differentiable"):
        if group.get(flag):
            raise ValueError(
                f"state_dtype is not supported with {flag}=True: the step makes working "
                "copies of the state and draws its rounding noise on the host"
            )
    check_params(dtype, group.get("params", []))


def check_params(dtype: torch.dtype, params: Iterable[Any]) -> None:
    """The parameters a ``state_dtype`` stores state for: real, and wider than it
    (where a group is made, and at each new parameter's first step: one
    appended to a group's ``params`` later)."""
    for p in params:
        if not isinstance(p, Tensor):
            continue
        rounding.check_real(p.is_complex())
        # Dtypes by their names in every framework ("float32", not "torch.float32").
        rounding.check_narrower(_name(dtype), dtype.itemsize, _name(p.dtype), p.dtype.itemsize)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def narrow(group: dict[str, Any], param: Tensor) -> bool:
    """Whether ``param``'s state is stored narrower than the parameter."""
    dtype = group.get("state_dtype")
    return dtype is not None and dtype != param.dtype


def in_fused_kernel(
    fused: bool,
    state_dtype: torch.dtype | None,
    stochastic_rounding: bool | None,
    params: Sequence[Tensor],
) -> bool:
    """Whether a fused kernel steps these parameters' narrow state itself, in
    its one pass: ``fused``, float32 parameters, stochastic rounding, and
    bfloat16 or 8-bit state, in the C++ kernel (CPU) or the Triton kernels
    (CUDA, or CPU under Triton's interpreter)."""
    if not (fused and stochastic_rounding is not False and params):
        return False
    # At C speed: this is asked of every parameter on every step.
    if not all(map(operator.is_, map(_DTYPE, params), itertools.repeat(torch.float32))):
        return False
    devices = set(map(_DEVICE, params))
    if all(runs_triton(d) for d in devices) or all(d.type == "cpu" for d in devices):
        return state_dtype in (torch.bfloat16, torch.uint8)
    return False


def rounding_seed(step: float, index: int) -> int:
    """The seed of state ``index`` (:func:`qhoptim.rounding.state_index`) after
    step ``step``: :func:`qhoptim.rounding.rounding_seed`."""
    return int(rounding.rounding_seed(int(step) & _MASK32, index & _MASK32))


#: From this many parameters on, a step's seeds are computed as one int64
#: tensor (about twenty torch operations, whatever the count) instead of one
#: by one in Python (a 32-bit mix each, about a microsecond).
VECTOR_SEEDS = 24


def state_seeds(
    steps: Sequence[float], positions: Sequence[int], states: int = 3
) -> list[list[int]]:
    """The rounding seeds of each parameter's first ``states`` states (QHM's
    buffer; QHAdam's two moments and AMSGrad's maximum) in step ``steps[i]``
    (the number of the step being taken), the parameter at ``positions[i]`` in
    its optimizer: :func:`qhoptim.rounding.rounding_seed` -- by the fused CPU
    kernel's hash where it is loaded and the step number is one, else on
    Python ints or, for many parameters, on int64 tensors."""
    # Each step number mixed once (a step's parameters usually share one); the
    # positions' half of each seed kept from step to step.
    mixed = {t: rounding.mix32(int(t) & _MASK32) for t in set(steps)}
    spreads = _index_spreads(tuple(positions), states)
    extension = _extension.loaded_cpu_extension()
    if len(mixed) == 1 and extension is not None:  # the fused CPU kernel's own hash
        (step_mix,) = mixed.values()
        return extension.rounding_seeds_(step_mix, spreads, states)  # type: ignore[no-any-return]
    if len(steps) < VECTOR_SEEDS:
        return [
            [
                rounding.rounding_seed_of_spread(mixed[step], spreads[states * i + k])
                for k in range(states)
            ]
            for i, step in enumerate(steps)
        ]
    if len(mixed) == 1:  # one step number for all: a number beside the table
        (step_mix,) = mixed.values()
    else:
        step_mix = torch.tensor([mixed[t] for t in steps], dtype=torch.int64)[:, None]
    table = torch.tensor(spreads, dtype=torch.int64).view(-1, states)
    seeds = rounding.rounding_seed_of_spread(step_mix, table, _INT64_BITS)
    return seeds.tolist()  # type: ignore[no-any-return]


@functools.lru_cache(maxsize=8)
def _index_spreads(positions: tuple[int, ...], states: int) -> list[int]:
    """:func:`qhoptim.rounding.index_spread` of each parameter's first ``states``
    state indices, flat, kept from step to step for the same parameters: a
    step's seeds then cost the mix alone."""
    return [
        rounding.index_spread(rounding.state_index(position, k) & _MASK32)
        for position in positions
        for k in range(states)
    ]


def hash32(seed: int, start: int, stop: int, device: torch.device, high: bool = False) -> Tensor:
    """The noise of the elements at positions ``start .. stop-1`` of a tensor under
    ``seed`` (int64 values below 2**16; the high halves of their hashes with
    ``high``): :func:`qhoptim.rounding.noise16`, the
    numbers the fused CPU kernel computes per element (``hash32`` in
    ``csrc/fused_cpu.cpp``; a test holds the two paths to the same bits).
    Positions past 2**32 are folded to 32 bits as the kernel folds them."""
    i = torch.arange(start, stop, dtype=torch.int64, device=device)
    if stop > _MASK32:
        i = (i ^ (i >> 32)) & _MASK32
    return rounding.noise16(i, seed, _INT64_BITS, high)  # type: ignore[no-any-return]


def stochastic_round_(dst: Tensor, src: Tensor, seed: int, start: int = 0) -> None:
    """``dst`` (bfloat16) <- ``src`` rounded stochastically: up with probability
    equal to the distance to the value below, in units of bfloat16's last place.

    ``src`` is read as float32 (a float64 copy is first rounded to float32).
    A bfloat16 value is the top half of a float32's bits: 16 random bits added
    to the bottom half, then cut off, round up exactly that often. Values that
    bfloat16 holds exactly (zero and inf included) are unchanged, and NaN stays
    NaN. The noise is :func:`hash32` of ``seed`` and each element's position,
    counted from ``start`` (``src`` a slice of a tensor that starts there). On
    CPU the fused extension rounds in one pass where it can be had (it is
    compiled on first use); otherwise torch operations make the noise
    :data:`NOISE_VALUES` at a time, which bounds their temporaries.
    """
    if not dst.is_contiguous():  # channels_last, a transpose: rounded in row-major order
        rounded = torch.empty(dst.shape, dtype=dst.dtype, device=dst.device)
        stochastic_round_(rounded, src, seed, start)
        dst.copy_(rounded)
        return
    x = src.to(torch.float32).contiguous().view(-1)
    out = dst.view(-1)
    kernel = _cpu_kernel() if x.device.type == "cpu" else None
    if kernel is not None:  # one pass, the fused kernel's own rounding
        kernel.stochastic_round_(out, x, seed, start)
        return
    for a in range(0, x.numel(), NOISE_VALUES):
        b = min(a + NOISE_VALUES, x.numel())
        noise = hash32(seed, start + a, start + b, x.device).to(torch.int32)
        # rounding.round_bits, in int32 (two's complement wraps as uint32 would);
        # a NaN takes no noise and keeps its quiet bit (rounding._carried)
        float32_bits = x[a:b].view(torch.int32)  # src is not written
        nan = torch.isnan(x[a:b])
        quiet = nan.to(torch.int32).mul_(rounding.QUIET_NAN_BIT)
        bits = noise.masked_fill_(nan, 0).add_(float32_bits).bitwise_or_(quiet)
        # The top half as the bfloat16's bits: a conversion of the float32
        # would write its own NaN (0xFFFF where the rule keeps 0x7FC0).
        out[a:b].view(torch.int16).copy_(bits.bitwise_right_shift_(16))


def _cpu_kernel() -> Any:
    """The fused CPU extension where it can be had (it is compiled on first use,
    as for ``fused=True``), else None: torch operations round instead."""
    return _extension.cpu_extension() if _extension.cpu_kernel_available() else None


# ---------------------------------------------------------------- 8-bit state
def eight_bit(dtype: torch.dtype | None) -> bool:
    """Whether ``state_dtype`` is the 8-bit blockwise state.

    A tensor's state is then one flat uint8 tensor of :func:`packed_numel`
    bytes: first the float32 scale (largest magnitude) of each block of
    :data:`BLOCK` values, as bytes, then one code per value
    (:func:`qhoptim.rounding.eight_bit_levels`). One tensor per state keeps
    torch's ``state_dict`` and its load (which casts every state tensor to the
    parameter's dtype and back: bytes survive that exactly) as they are.
    QHAdam's two moments take 2 + 8 / 256 bytes per parameter.
    """
    return dtype == torch.uint8


#: The state key of an 8-bit state's parameter shape, which its flat packed
#: tensors do not keep: a state dict's 8-bit state is loaded only into a
#: parameter of that shape, as a float32 state is.
PARAM_SHAPE = "param_shape"


def shape_record(param: Tensor) -> Tensor:
    """``param``'s shape, as an 8-bit state records it (:data:`PARAM_SHAPE`)."""
    return torch.tensor(tuple(param.shape), dtype=torch.int64)


def packed_numel(n: int) -> int:
    """Bytes of the 8-bit state of ``n`` values: a float32 scale per block, a code per value."""
    return 4 * -(-n // BLOCK) + n


def zeros_state(param: Tensor, dtype: torch.dtype | None) -> Tensor:
    """A fresh state of ``param`` in ``dtype`` (None: the parameter's): zeros of
    its shape and layout, or the zero 8-bit state (all bytes 0: scales 0.0,
    codes of 0)."""
    if eight_bit(dtype):
        return torch.zeros(packed_numel(param.numel()), dtype=torch.uint8, device=param.device)
    return torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)


class _Packed:
    """The values ``start .. stop-1`` of an 8-bit state of ``n`` values: their
    codes and their blocks' scales (views into the packed tensor)."""

    def __init__(self, packed: Tensor, n: int, start: int, stop: int) -> None:
        blocks = -(-n // BLOCK)
        self.codes = packed[4 * blocks + start : 4 * blocks + stop]
        self.scales = packed[: 4 * blocks].view(torch.float32)[start // BLOCK : -(-stop // BLOCK)]


@functools.cache
def eight_bit_levels(signed: bool, device: torch.device) -> Tensor:
    """:func:`qhoptim.rounding.eight_bit_levels` as a float32 tensor on ``device``."""
    return torch.tensor(rounding.eight_bit_levels(signed), dtype=torch.float32, device=device)


def dequantize_(out: Tensor, stored: _Packed, signed: bool) -> None:
    """``out`` (flat, float) <- the values ``stored`` stands for."""
    kernel = _cpu_kernel() if out.device.type == "cpu" and out.dtype == torch.float32 else None
    if kernel is not None and out.is_contiguous():  # one pass, in C++
        levels = eight_bit_levels(signed, out.device)
        kernel.dequantize8_(out.view(-1), stored.codes, stored.scales, levels, signed)
        return
    per_value = stored.scales.repeat_interleave(BLOCK)[: out.numel()]
    value = rounding.eight_bit_value(
        stored.codes.to(torch.int32),
        functools.partial(_level, signed),
        signed,
        per_value.mul,
        torch.where,
    )
    out.view(-1).copy_(value)


def _level(signed: bool, k: Tensor) -> Tensor:
    """The levels of codes ``k`` (int32) from their bits, no table read
    (:func:`qhoptim.rounding.eight_bit_level_bits`): an element-wise kernel
    where a gather would take one of its own."""
    level = rounding.eight_bit_level_bits(k, signed).view(torch.float32)
    return torch.where(k == 0, 0.0, level)


def quantize_(
    stored: _Packed,
    src: Tensor,
    signed: bool,
    seed: int,
    stochastic: bool,
    start: int,
    high: bool = False,
) -> None:
    """``stored`` <- ``src`` (flat) in 8 bits: each block's scale is its largest
    finite magnitude, each value one of the two levels around it, chosen with
    :func:`hash32`'s noise (``stochastic``; ``high``: the high halves of the
    hashes, :func:`qhoptim.rounding.eight_bit_noise_source`) or to nearest. A NaN or an infinity
    takes the non-finite code (:data:`qhoptim.rounding.EIGHT_BIT_NON_FINITE`)
    and leaves its block's scale, and so the other values, alone."""
    x = src.to(torch.float32).reshape(-1)
    n = x.numel()
    kernel = _cpu_kernel() if x.device.type == "cpu" else None
    if kernel is not None:  # one pass, in C++ (the same arithmetic)
        levels = eight_bit_levels(signed, x.device)
        kernel.quantize8_(
            stored.codes,
            stored.scales,
            x.contiguous(),
            levels,
            signed,
            seed,
            stochastic,
            high,
            start,
            rounding.EIGHT_BIT_PER_OCTAVE,  # a first guess of a level; the table decides
        )
        return
    blocks = -(-n // BLOCK)
    finite = torch.isfinite(x)
    smallest = rounding.EIGHT_BIT_SMALLEST  # below it: 0 (the rule's flush)
    magnitudes = torch.where(finite & (x.abs() >= smallest), x.abs(), 0.0)
    padded = torch.nn.functional.pad(magnitudes, (0, blocks * BLOCK - n))
    scale = padded.view(blocks, BLOCK).amax(dim=1)
    stored.scales.copy_(scale)
    # rounding.EIGHT_BIT_LARGEST_PLAIN_SCALE: no subnormal reciprocal.
    large = scale > rounding.EIGHT_BIT_LARGEST_PLAIN_SCALE
    inverse = torch.where(large, scale.new_tensor(4.0), scale.new_tensor(1.0)) / scale
    after = torch.where(large, scale.new_tensor(0.25), scale.new_tensor(1.0))
    ratio = magnitudes * inverse.repeat_interleave(BLOCK)[:n] * after.repeat_interleave(BLOCK)[:n]
    ratio = torch.nan_to_num(ratio, nan=0.0)  # 0 * inf in an all-zero block
    ratio = torch.where(ratio < smallest, 0.0, ratio)
    # The levels around each ratio from its bits, no table (see _level).
    low, below, above = rounding.eight_bit_levels_around(
        ratio.view(torch.int32), signed, torch.where
    )
    below, above = below.view(torch.float32), above.view(torch.float32)
    if stochastic:
        noise = hash32(seed, start, start + n, x.device, high)
        threshold = noise.to(torch.float32) * 2.0**-16
    else:
        threshold = torch.full_like(ratio, 0.5)
    code = rounding.eight_bit_code(
        x, finite, ratio, low, below, above, threshold, signed, torch.where
    )
    stored.codes.copy_(code)


def converted(
    value: Tensor,
    param: Tensor,
    stored_as: torch.dtype | None,
    store_as: torch.dtype | None,
    signed: bool,
) -> Tensor:
    """A state ``value`` of ``param`` stored as ``stored_as`` (None: the
    parameter's dtype), stored as ``store_as`` instead: an 8-bit state decoded,
    an 8-bit one encoded (to nearest: a conversion draws no noise), any other
    cast. For a checkpoint loaded into an optimizer of another ``state_dtype``.
    """
    n = param.numel()
    if eight_bit(stored_as):
        values = torch.empty(param.shape, dtype=torch.float32, device=param.device)
        dequantize_(values.view(-1), _Packed(value, n, 0, n), signed)
    else:
        values = value.reshape(param.shape)
    if eight_bit(store_as):
        packed = zeros_state(param, torch.uint8)
        quantize_(_Packed(packed, n, 0, n), values.reshape(-1), signed, 0, False, 0)
        return packed
    return values.to(param.dtype if store_as is None else store_as)


def write_back_(
    dst: Tensor, src: Tensor, seed: int, stochastic: bool | None, start: int = 0
) -> None:
    """Store the working copy ``src`` in ``dst``'s dtype (``stochastic``: None means
    stochastic for bfloat16); ``start`` as for :func:`stochastic_round_`."""
    if dst.dtype == torch.bfloat16 and stochastic is not False:
        stochastic_round_(dst, src, seed, start)
    else:
        dst.copy_(src)


def _pieces(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    state_lists: Sequence[Sequence[Tensor]],
    whole_tensors: bool = False,
) -> list[list[tuple[int, int, int]]]:
    """Runs of ``(position, start, stop)`` -- whole tensors, and slices of the
    flattened ones larger than :data:`CHUNK_VALUES` -- of about that many values
    together. A tensor whose parameter, gradient or state is not contiguous
    (``channels_last``, a transpose, a slice) is one piece, whatever its size:
    a slice of its flattened values would be a copy, not a view to step in; so
    is every tensor with ``whole_tensors`` (a step that is not element-wise)."""
    runs: list[list[tuple[int, int, int]]] = [[]]
    size = 0
    for i, p in enumerate(params):
        n = p.numel()
        whole = whole_tensors or not (
            p.is_contiguous()
            and grads[i].is_contiguous()
            and all(lst[i].is_contiguous() for lst in state_lists)
        )
        for start in range(0, max(n, 1), n if whole and n else CHUNK_VALUES):
            stop = n if whole else min(start + CHUNK_VALUES, n)
            if size > 0 and size + (stop - start) > CHUNK_VALUES:
                runs.append([])
                size = 0
            runs[-1].append((i, start, stop))
            size += stop - start
    return [run for run in runs if run]


def _piece(t: Tensor, start: int, stop: int) -> Tensor:
    """The slice ``start:stop`` of ``t`` flattened (``t`` itself when whole)."""
    return t if start == 0 and stop == t.numel() else t.view(-1)[start:stop]


def step_with_narrow_state(
    params: list[Tensor],
    grads: list[Tensor],
    state_lists: list[list[Tensor]],
    step: Callable[[list[int], list[Tensor], list[Tensor], list[list[Tensor]]], None],
    seeds: list[list[int]],
    stochastic: bool | None,
    signed: Sequence[bool] = (),
    whole_tensors: bool = False,
) -> None:
    """Run ``step(positions, params, grads, working_lists)`` piece by piece on
    working copies of ``state_lists`` (each aligned with ``params``) in the
    parameters' dtype (float32, with the parameter and gradient, for an 8-bit
    state of a 16-bit parameter), then write each back: the ``k``-th state of the
    parameter at ``position`` rounded with ``seeds[position][k]`` (an 8-bit
    one with the noise :func:`qhoptim.rounding.eight_bit_noise_source` names).

    A piece is a tensor, or a slice of a tensor larger than
    :data:`CHUNK_VALUES` (the update is element-wise), so the working copies
    never hold much more than that many values per state list; the noise of a
    slice is that of the same elements of the whole tensor. ``positions``
    repeats a position for each slice of its tensor. An 8-bit state
    (:func:`eight_bit`) is decoded into its working copy and encoded back;
    ``signed[k]`` says whether state ``k`` takes negative values.
    ``whole_tensors``: no tensor is sliced (a step that is not element-wise).
    """
    runs = _pieces(params, grads, state_lists, whole_tensors)
    # One scratch buffer per state list and dtype for every run's working
    # copies: allocated once per step, not once per piece, so that the memory
    # allocator has one block to reuse instead of many to keep (glibc kept up
    # to ~100 MB of freed working copies of a 5e7-value parameter otherwise).
    scratch: dict[tuple[int, torch.dtype, torch.device], Tensor] = {}

    def working_copy(
        k: int, stored: Tensor | _Packed, like: Tensor, offset: int, dtype: torch.dtype
    ) -> Tensor:
        key = (k, dtype, like.device)
        if key not in scratch:
            size = max(sum(b - a for _, a, b in run) for run in runs)
            scratch[key] = torch.empty(size, dtype=dtype, device=like.device)
        work = scratch[key][offset : offset + like.numel()].view(like.shape)
        if isinstance(stored, _Packed):
            dequantize_(work, stored, signed[k])
            return work
        return work.copy_(stored)

    def stored_piece(lst: list[Tensor], i: int, a: int, b: int) -> Tensor | _Packed:
        if lst[i].dtype == torch.uint8:
            return _Packed(lst[i], params[i].numel(), a, b)
        return _piece(lst[i], a, b)

    for run in runs:
        positions = [i for i, _, _ in run]
        ps = [_piece(params[i], a, b) for i, a, b in run]
        gs = [_piece(grads[i], a, b) for i, a, b in run]
        stored = [[stored_piece(lst, i, a, b) for i, a, b in run] for lst in state_lists]
        offsets = [0]
        for p in ps:
            offsets.append(offsets[-1] + p.numel())
        # An 8-bit state of a 16-bit parameter steps in float32 with its
        # parameter and gradient: in bfloat16, beta2 * v rounds back to v and
        # the second moment would never decay. (The state is float32 values in
        # 8 bits, which the fused kernel steps in float32.)
        widened = [
            p.dtype.itemsize < 4 and any(lst[i].dtype == torch.uint8 for lst in state_lists)
            for p, i in zip(ps, positions, strict=True)
        ]
        dtypes = [torch.float32 if wide else p.dtype for p, wide in zip(ps, widened, strict=True)]
        work = [
            [
                working_copy(k, s, p, o, d)
                for s, p, o, d in zip(lst, ps, offsets, dtypes, strict=False)
            ]
            for k, lst in enumerate(stored)
        ]
        if any(widened):
            # Their scratch keys past the states': -1 the parameters', -2 the gradients'.
            step_ps = [
                working_copy(-1, p, p, o, torch.float32) if wide else p
                for p, o, wide in zip(ps, offsets, widened, strict=False)
            ]
            step_gs = [
                working_copy(-2, g, g, o, torch.float32) if wide else g
                for g, o, wide in zip(gs, offsets, widened, strict=False)
            ]
            step(positions, step_ps, step_gs, work)
            for p, step_p, wide in zip(ps, step_ps, widened, strict=True):
                if wide:
                    p.copy_(step_p)
        else:
            step(positions, ps, gs, work)
        for k, (lst, wl) in enumerate(zip(stored, work, strict=True)):
            for (i, a, _), s, w in zip(run, lst, wl, strict=True):
                if isinstance(s, _Packed):
                    source, high = rounding.eight_bit_noise_source(k)
                    quantize_(s, w, signed[k], seeds[i][source], stochastic is not False, a, high)
                else:
                    write_back_(s, w, seeds[i][k], stochastic, a)


def step_narrow_state(
    params: list[Tensor],
    grads: list[Tensor],
    state_lists: list[list[Tensor]],
    run: Callable[[Sequence[int], list[Tensor], list[Tensor], list[list[Tensor]], Any], None],
    *,
    steps: Sequence[float],
    positions: Sequence[int],
    fused: bool,
    state_dtype: torch.dtype,
    stochastic_rounding: bool | None,
    signed: Sequence[bool] = (),
    whole_tensors: bool = False,
) -> None:
    """One step of parameters whose state is stored in the narrower ``state_dtype``.

    ``run(at, params, grads, state_lists, seeds)`` is the functional step of
    ``params`` (the entries ``at`` of the given lists, repeated for each slice
    of a large tensor). A narrow state of float32 parameters that a fused
    kernel can take (:func:`in_fused_kernel`: the C++ kernel on CPU, the
    Triton kernels on CUDA) steps there, in one call,
    the kernel rounding it with ``seeds`` (:func:`state_seeds` of ``steps``,
    the number of the step being taken, and ``positions``, each parameter's in
    its optimizer); any other steps on working copies
    (:func:`step_with_narrow_state`), ``seeds`` None, written back rounded with
    the same seeds. ``signed[k]``: whether state ``k`` takes negative values
    (8-bit state). ``whole_tensors``: ``run`` takes every tensor whole
    (QHMuon's orthogonalization is not element-wise). ``qhoptim.torch``'s
    optimizers and Keras on torch both step their narrow state here.
    """
    seeds = state_seeds(steps, positions, len(state_lists))
    if in_fused_kernel(fused, state_dtype, stochastic_rounding, params):
        run(range(len(params)), params, grads, state_lists, seeds)
        return

    def on_working_copies(
        at: list[int], ps: list[Tensor], gs: list[Tensor], work: list[list[Tensor]]
    ) -> None:
        run(at, ps, gs, work, None)

    step_with_narrow_state(
        params,
        grads,
        state_lists,
        on_working_copies,
        seeds,
        stochastic_rounding,
        signed,
        whole_tensors,
    )
