r"""Fused QHM and QHAdam steps (``fused=True``): one pass over memory per step.

A fused step reads each parameter, its gradient and its state once and writes
the parameter and the state once -- the 20 bytes per float32 parameter of QHM
and 28 of QHAdam that torch's fused SGD and Adam move too -- instead of the
several passes of the multi-tensor kernels. The coefficients are those of the
kernel layer (:mod:`qhoptim.torch._kernels`, from :mod:`qhoptim.rules`); only
their application is fused:

* **CPU**: a C++ kernel (``csrc/fused_cpu.cpp``), vectorized and parallel over
  elements, compiled with ``torch.utils.cpp_extension`` on first use (under
  a minute) and cached on disk (``TORCH_EXTENSIONS_DIR``) for every later
  process. It needs a C++ compiler and ninja.
* **CUDA**: Triton kernels (:mod:`qhoptim.torch._triton`), one launch per
  device and dtype over every tensor of a param group, and nothing else on
  the device: the step counts live on the host (on the device when
  ``capturable``), which computes the coefficients. Under
  ``TRITON_INTERPRET=1`` CPU tensors take these kernels too (Triton's
  interpreter), in place of the C++ one.

As in ``torch.optim.Adam(fused=True)``, the step reads ``grad_scale`` and
``found_inf`` that ``torch.amp.GradScaler`` sets: gradients are unscaled inside
the kernel (never written), and a step with an inf or NaN gradient is skipped,
state and step counts included (QHM's kernel and a capturable QHAdam step read
``found_inf`` on the device; a QHAdam step whose counts the host keeps reads it
on the host). Low-precision parameters are computed in float32.
"""

from __future__ import annotations

import functools
import itertools
import sys
from typing import Any, cast

import torch
from torch import Tensor

from qhoptim import rounding, rules
from qhoptim.torch import _kernels, _state_dtype, _tensors
from qhoptim.torch._extension import cpu_extension, cpu_kernel_available, loaded_cpu_extension
from qhoptim.torch._tensors import (
    group_by_device_and_dtype,
    local_shard,
    local_shards,
    runs_triton,
)

__all__ = [
    "check_fused",
    "check_fused_device",
    "fused_qhadam",
    "fused_qhadam_host_steps",
    "fused_qhm",
    "kernel_available",
    "skipped",
]

_DEVICES = ("cpu", "cuda")
_TRITON_MODULE = f"{__package__}._triton"


def check_fused(params: list[Tensor], *, foreach: bool | None, differentiable: bool) -> None:
    """Refuse what ``fused=True`` cannot do, with torch's own wording where it has one.

    A parameter's device is checked when its state is made, at its first step
    (:func:`check_fused_device`), as torch does: a model built on ``meta`` and
    materialized later (``to_empty``) takes a fused optimizer built before that.
    """
    if foreach:
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
    if differentiable:
        raise RuntimeError("`fused` does not support `differentiable`")
    for p in params:
        if not torch.is_floating_point(p):
            raise _unsupported(p)


def check_fused_device(param: Tensor) -> None:
    """Refuse a parameter on a device the fused kernels do not run on."""
    if local_shard(param).device.type not in _DEVICES or not torch.is_floating_point(param):
        raise _unsupported(param)


def _unsupported(p: Tensor) -> RuntimeError:
    return RuntimeError(
        "`fused=True` requires all the params to be floating point Tensors of "
        f"supported devices: {list(_DEVICES)}; received a {p.dtype} tensor on {p.device}"
    )


def kernel_available(device: torch.device) -> bool:
    """Whether the fused kernel of ``device``'s tensors can be had: the C++ one
    (built, or loaded from the disk cache), or Triton's. For callers that fall
    back to the multi-tensor kernels (``qhoptim.keras`` on torch)."""
    if not runs_triton(device):
        return cpu_kernel_available()
    try:
        _triton()
    except RuntimeError:
        return False
    return True


@functools.cache
def _triton() -> Any:
    """The Triton kernels (imported on first CUDA use: Triton ships with CUDA builds of torch)."""
    try:
        from qhoptim.torch import _triton as kernels
    except ImportError as error:
        raise RuntimeError(
            f"fused=True on CUDA needs Triton, which is not installed ({error}); "
            "it ships with torch's CUDA builds (`pip install triton`), "
            "or use fused=False (the multi-tensor kernels)."
        ) from error
    return kernels


def skipped(found_inf: Tensor | None) -> bool:
    """Whether GradScaler found an inf or NaN gradient, read on the host (on CUDA,
    for a step whose counts the host keeps: one synchronization)."""
    return found_inf is not None and bool(found_inf.item() != 0)


def _grad_multiplier(hp: Any, grad_scale: Tensor | None) -> float:
    inv_scale = 1.0 if grad_scale is None else 1.0 / float(grad_scale.item())
    return -inv_scale if hp.maximize else inv_scale


def _decay(lr: float, weight_decay: float, decoupled: bool) -> tuple[float, float]:
    """``(coupled weight decay, decoupled decay factor)`` (see ``rules.weight_decay_terms``)."""
    if weight_decay == 0:
        return 0.0, 1.0
    if decoupled:
        return 0.0, rules.decoupled_decay_factor(lr, weight_decay)
    return weight_decay, 1.0


@functools.lru_cache(maxsize=64)
def _qhm_terms(
    lr: float, momentum: float, nu: float, weight_decay: float, decoupled: bool
) -> tuple[float, ...]:
    """The C++ QHM kernel's arguments after the gradient's multiplier: ``(coupled
    weight decay, decoupled decay factor, the buffer's weight of the gradient,
    the folded values)``, cached as :func:`_qhadam_terms`'s."""
    c = rules.qhm_coefficients(momentum, nu)
    return (*_decay(lr, weight_decay, decoupled), c.grad_to_buffer, *rules.fold_qhm(c, lr))


@functools.lru_cache(maxsize=64)
def _qhadam_terms(
    lr: float, beta1: float, beta2: float, nu2: float, weight_decay: float, decoupled: bool
) -> tuple[int, tuple[float, ...]]:
    """The C++ QHAdam kernel's arguments that do not change with the step: the
    denominator's form and ``(coupled weight decay, decoupled decay factor, the
    moments' weights)``. Cached: a group's hyperparameters seldom change, and
    each call into the rules is host time that the step waits for -- after a
    step of a million values has pushed the interpreter out of the CPU's caches,
    several times what it costs on a small one."""
    w = rules.qhadam_moment_weights(beta1, beta2)
    return _kernels.DENOMINATOR_FORMS[rules.qhadam_denominator(nu2)], (
        *_decay(lr, weight_decay, decoupled),
        w.grad_to_exp_avg,
        w.exp_avg_sq_decay,
        w.grad_sq_to_exp_avg_sq,
    )


class _Contiguous:
    """Contiguous stand-ins for strided tensors, written back on exit, except for
    the gradients (the second list), which the kernels only read.

    Writing a gradient's copy back would be wrong, not only slow, when the
    gradient is a strided view of its parameter (``p.grad = p.detach().t()``
    for a square ``p``): the write-back would undo the step.
    """

    def __init__(self, params: list[Tensor], grads: list[Tensor], *state: list[Tensor]) -> None:
        self.pairs: list[tuple[Tensor, Tensor]] = []
        if all(map(Tensor.is_contiguous, itertools.chain(params, grads, *state))):
            # The common case, every tensor contiguous: no copies, and one pass.
            self.lists = [params, grads, *state]
            self.unchanged = True
            return
        self.lists = [
            self._contiguous(params),
            grads if _tensors.all_contiguous(grads) else [t.contiguous() for t in grads],
            *(self._contiguous(ts) for ts in state),
        ]
        # Whether every tensor was contiguous (none stands in for another).
        self.unchanged = not self.pairs and self.lists[1] is grads

    def _contiguous(self, ts: list[Tensor]) -> list[Tensor]:
        # The common case, every tensor contiguous: no copies.
        if _tensors.all_contiguous(ts):
            return ts
        out = []
        for t in ts:
            c = t.contiguous()
            if c is not t:
                self.pairs.append((t, c))
            out.append(c)
        return out

    def __enter__(self) -> list[list[Tensor]]:
        return self.lists

    def __exit__(self, *exc: object) -> None:
        for t, c in self.pairs:
            t.copy_(c)


def _groups_with_indices(
    tensorlists: list[list[Tensor]], *, by: int | None = None
) -> list[tuple[torch.device, list[Any]]]:
    """The lists by device and dtype (DTensors as their local shards), each group's
    positions in the lists last.

    ``by``: group by the first ``by`` lists only and take the others at the same
    positions -- for a bfloat16 state beside float32 parameters, which torch's
    grouping (before 2.13) refuses as a mix of dtypes.
    """
    if local_shards(tensorlists[0]) is not tensorlists[0]:  # DTensors: the lists share placements
        tensorlists = [local_shards(ts) for ts in tensorlists]
    if by is None:  # the common case, at the least host work
        grouped = group_by_device_and_dtype(tensorlists, with_indices=True)
        return [(device, [*lists, indices]) for (device, _), (lists, indices) in grouped.items()]
    grouped = group_by_device_and_dtype(tensorlists[:by], with_indices=True)
    return [
        (device, [*lists, *([ts[i] for i in indices] for ts in tensorlists[by:]), indices])
        for (device, _), (lists, indices) in grouped.items()
    ]


def fused_qhm(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    hp: _tensors.QHMHyperparameters,
    *,
    grad_scale: Tensor | None,
    found_inf: Tensor | None,
    state_seeds: list[list[int]] | None = None,
) -> None:
    """One fused QHM step (coefficients of :func:`qhoptim.rules.qhm_coefficients`).

    ``state_seeds`` (float32 parameters): the momentum buffers are bfloat16
    or 8-bit, rounded stochastically with these seeds (``[seed]``
    per tensor, :mod:`qhoptim.torch._state_dtype`).
    """
    if not params:  # nothing to step (torch's grouping refuses empty lists)
        return
    if state_seeds is None:
        layout = _known_layout([params, grads, momentum_buffers])
        if layout is not None:  # the tensors of an earlier step, where they were
            _triton().qhm_(
                params, grads, momentum_buffers, hp, grad_scale=grad_scale, found_inf=found_inf,
                layout=layout,
            )  # fmt: skip
            return
    by = None if state_seeds is None else 2  # a bfloat16 state: group by params and grads
    for device, (*lists, indices) in _groups_with_indices([params, grads, momentum_buffers], by=by):
        seeds = _seed_table(state_seeds, indices, device)
        with (contiguous := _Contiguous(*lists)) as (ps, gs, bufs):
            if runs_triton(device):  # a gradient overlapping its parameter: copied there
                _triton().qhm_(
                    ps, gs, bufs, hp, grad_scale=grad_scale, found_inf=found_inf,
                    seeds=None if state_seeds is None else seeds,
                    eight_bit=_eight_bit(bufs),
                    whole=_whole(state_seeds, indices, params, contiguous),
                )  # fmt: skip
                continue
            if skipped(found_inf):
                continue
            terms = _qhm_terms(
                float(hp.lr), hp.momentum, hp.nu, hp.weight_decay, hp.decoupled_weight_decay
            )
            numbers = (_grad_multiplier(hp, grad_scale), *terms, seeds)
            if _eight_bit(bufs):
                cpu_extension().qhm8_(ps, gs, bufs, *numbers, *_ladders(signed=(True,)))
            else:
                cpu_extension().qhm_(ps, gs, bufs, *numbers)


_NO_SEEDS = torch.empty(0, dtype=torch.int64)


def _eight_bit(states: list[Tensor]) -> bool:
    """Whether a state list is 8-bit (:func:`qhoptim.torch._state_dtype.eight_bit`)."""
    return bool(states) and _state_dtype.eight_bit(states[0].dtype)


def _ladders(signed: tuple[bool, ...]) -> tuple[Any, ...]:
    """The 8-bit kernels' ladder arguments: the level tables (``signed``) and
    the levels per octave, :mod:`qhoptim.rounding`'s."""
    cpu = torch.device("cpu")
    return (
        *(_state_dtype.eight_bit_levels(s, cpu) for s in signed),
        rounding.EIGHT_BIT_PER_OCTAVE,
    )


def _seed_table(
    state_seeds: list[list[int]] | None, indices: list[int], device: torch.device
) -> Tensor | list[int]:
    """The kernels' ``seeds`` for the tensors at ``indices``: for the Triton
    kernels an int64 ``[n, 3]`` tensor on the device (empty for a state of the
    parameters' dtype); for the C++ kernel the numbers themselves, flat, as
    many per tensor as it has states (none for a state of the parameters'
    dtype) -- a list passes to it at no cost, where a tensor would be made on
    every step."""
    if not runs_triton(device):
        if state_seeds is None:
            return []
        return list(itertools.chain.from_iterable(map(state_seeds.__getitem__, indices)))
    if state_seeds is None:
        return _NO_SEEDS
    rows = [[*state_seeds[i], 0, 0, 0][:3] for i in indices]
    return torch.tensor(rows, dtype=torch.int64).to(device)


def fused_qhadam(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    state_steps: list[Tensor],
    hp: _tensors.QHAdamHyperparameters,
    *,
    grad_scale: Tensor | None,
    found_inf: Tensor | None,
    max_exp_avg_sqs: list[Tensor] | None = None,
    state_seeds: list[list[int]] | None = None,
    capturable: bool = False,
) -> None:
    """One fused QHAdam step (coefficients of :func:`qhoptim.rules.fold_qhadam`).

    ``state_steps`` count the steps taken, incremented here unless GradScaler
    found an inf: on the host (CPU tensors), whose values the coefficients are
    computed from, or -- ``capturable`` -- on the parameters' devices, where
    the Triton kernels' coefficients are evaluated. With ``hp.amsgrad``
    ``max_exp_avg_sqs`` are the running maxima the denominator reads.
    ``state_seeds`` (float32 parameters): the moments are bfloat16 or 8-bit,
    rounded stochastically with these seeds (one per moment and tensor).
    """
    if not params:  # nothing to step (torch's grouping refuses empty lists)
        return
    tensorlists = [params, grads, exp_avgs, exp_avg_sqs]
    if hp.amsgrad:
        tensorlists.append(cast(list[Tensor], _kernels.amsgrad_maxes(hp, max_exp_avg_sqs, params)))
    if state_seeds is None:
        layout = _known_layout(tensorlists)
        if layout is not None:  # the tensors of an earlier step, where they were
            _qhadam_group_(
                layout.device, tensorlists, state_steps, hp, grad_scale, found_inf, _NO_SEEDS,
                capturable, layout=layout,
            )  # fmt: skip
            return
    by = None if state_seeds is None else 2  # a bfloat16 state: group by params and grads
    for device, (*lists, steps, indices) in _groups_with_indices(
        [*tensorlists, state_steps], by=by
    ):
        seeds = _seed_table(state_seeds, indices, device)
        with (contiguous := _Contiguous(*lists)) as contiguous_lists:
            _qhadam_group_(
                device, contiguous_lists, steps, hp, grad_scale, found_inf, seeds, capturable,
                whole=_whole(state_seeds, indices, params, contiguous),
            )  # fmt: skip


def _qhadam_group_(
    device: torch.device,
    lists: list[list[Tensor]],
    steps: list[Tensor],
    hp: _tensors.QHAdamHyperparameters,
    grad_scale: Tensor | None,
    found_inf: Tensor | None,
    seeds: Tensor | list[int],
    capturable: bool,
    *,
    layout: Any = None,
    whole: bool = False,
) -> None:
    """:func:`fused_qhadam`'s step of one device and dtype: ``lists`` are the
    parameters, gradients, moments (and maxima), contiguous; ``steps`` their
    counts. ``layout`` and ``whole``: see :func:`qhoptim.torch._triton.qhm_`."""
    ps, gs, ms, ss, *vs = lists
    if capturable and runs_triton(device):  # counts and coefficients on the device
        _triton().qhadam_(
            ps, gs, ms, ss, vs[0] if vs else None, steps, hp, grad_scale=grad_scale,
            found_inf=found_inf, layout=layout, whole=whole,
        )  # fmt: skip
        return
    if skipped(found_inf):
        return
    _qhadam_numbers_(
        device, lists, counted(steps), hp, grad_scale, seeds, layout=layout, whole=whole
    )


def counted(counts: list[Tensor]) -> list[float]:
    """Add one to each step count (one-value tensors of one device) and return
    the new counts: in one C++ call where the fused CPU kernel's extension is
    loaded and the counts are float CPU tensors, else by torch's multi-tensor
    addition and :func:`_tensors.values_of` (under ``torch.compile`` the
    counts themselves)."""
    extension = None if torch.compiler.is_compiling() else loaded_cpu_extension()
    values = None if extension is None else extension.count_steps_(counts)
    if values is None:
        _tensors.advance_counts(counts)
        values = _tensors.values_of(counts)
    return cast(list[float], values)


def _whole(
    state_seeds: list[list[int]] | None,
    indices: list[int],
    params: list[Tensor],
    contiguous: _Contiguous,
) -> bool:
    """Whether a group's lists are the optimizer's own (every tensor, each of
    its dtype, contiguous): their layout can be kept for the next step's."""
    return state_seeds is None and len(indices) == len(params) and contiguous.unchanged


def _known_layout(lists: list[list[Tensor]]) -> Any:
    """:func:`qhoptim.torch._triton.known_layout` of ``lists`` once the Triton
    kernels have stepped (None before: nothing is imported to find that out)."""
    kernels = sys.modules.get(_TRITON_MODULE)
    if kernels is None or local_shards(lists[0]) is not lists[0]:  # DTensors: by their shards
        return None
    return kernels.known_layout(lists)


def fused_qhadam_host_steps(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[float],
    hp: _tensors.QHAdamHyperparameters,
    max_exp_avg_sqs: list[Tensor] | None = None,
    state_seeds: list[list[int]] | None = None,
) -> None:
    """One fused QHAdam step whose step numbers are Python numbers.

    ``steps[i]`` is the number of the step being taken (1 on the first), as
    :func:`qhoptim.torch._kernels.foreach_qhadam` takes them; for
    ``qhoptim.keras``, which keeps one step count for every variable.
    ``max_exp_avg_sqs``: the running maxima of ``hp.amsgrad``. ``state_seeds``:
    bfloat16 moments, as in :func:`fused_qhadam`.
    """
    if not params:  # nothing to step (torch's grouping refuses empty lists)
        return
    tensorlists = [params, grads, exp_avgs, exp_avg_sqs]
    if hp.amsgrad:
        tensorlists.append(cast(list[Tensor], _kernels.amsgrad_maxes(hp, max_exp_avg_sqs, params)))
    by = None if state_seeds is None else 2  # a bfloat16 state: group by params and grads
    for device, (*lists, indices) in _groups_with_indices(tensorlists, by=by):
        seeds = _seed_table(state_seeds, indices, device)
        with _Contiguous(*lists) as contiguous_lists:
            numbers = [steps[i] for i in indices]
            _qhadam_numbers_(device, contiguous_lists, numbers, hp, None, seeds)


def _qhadam_numbers_(
    device: torch.device,
    lists: list[list[Tensor]],
    steps: list[float],
    hp: _tensors.QHAdamHyperparameters,
    grad_scale: Tensor | None,
    seeds: Tensor | list[int],
    *,
    layout: Any = None,
    whole: bool = False,
) -> None:
    """One group's step whose step numbers ``steps`` the host has: the Triton
    kernel's (CUDA), or the C++ kernel's (CPU). ``lists`` are the parameters,
    gradients, moments (and with amsgrad the maxima), contiguous; ``seeds``
    see :func:`_seed_table`; ``layout`` and ``whole`` (Triton's) see
    :func:`qhoptim.torch._triton.qhm_`."""
    ps, gs, ms, ss, *vs = lists
    if runs_triton(device):
        _triton().qhadam_(
            ps, gs, ms, ss, vs[0] if vs else None, steps, hp, grad_scale=grad_scale,
            found_inf=None, seeds=seeds if cast(Tensor, seeds).numel() else None,
            eight_bit=_eight_bit(ms), layout=layout, whole=whole,
        )  # fmt: skip
        return
    lr = float(hp.lr)
    # One fold per distinct step number (usually one for the whole list), as
    # Python numbers: one row of 5 for every tensor, else a row per tensor.
    folds = {
        t: _kernels.host_fold(t, lr, hp.beta1, hp.beta2, hp.nu1, hp.nu2, hp.eps)[1:]
        for t in set(steps)
    }
    if len(folds) == 1:
        (coefficients,) = folds.values()
    else:
        coefficients = tuple(x for t in steps for x in folds[t])
    form, terms = _qhadam_terms(
        lr, hp.beta1, hp.beta2, hp.nu2, hp.weight_decay, hp.decoupled_weight_decay
    )
    multiplier = _grad_multiplier(hp, grad_scale)
    arguments = (ps, gs, ms, ss, vs[0] if vs else [], coefficients, form, multiplier, *terms, seeds)
    if _eight_bit(ms):  # the first moment signed, the second (and its maximum) not
        cpu_extension().qhadam8_(*arguments, *_ladders(signed=(True, False)))
    else:
        cpu_extension().qhadam_(*arguments)
