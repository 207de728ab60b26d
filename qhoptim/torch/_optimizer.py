"""The machinery QHM and QHAdam share: validation of param groups, gathering the
parameters with gradients, state-dict checks and the upgrade of older state
dicts (qhoptim 1.1.0's included), the choice of implementation, ``step``.

Tensor arithmetic lives in :mod:`qhoptim.torch._kernels`; each optimizer module
(``_qhm.py``, ``_qhadam.py``) adds its hyperparameters and state.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import torch
from torch import Tensor
from torch.optim.optimizer import Optimizer
from torch.optim.optimizer import (
    required as required,  # torch's sentinel (add_param_group checks it); for qhoptim.pyt
)

from qhoptim import validation

_TORCH_FLAGS = {
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
}

_F = TypeVar("_F", bound=Callable[..., Any])

# ---------------------------------------------------------------------------
# Private torch names qhoptim.torch still uses. torch.optim's own optimizers
# are built on helpers private to torch.optim.optimizer (``_to_scalar``,
# ``_get_value``, ``_get_scalar_dtype``, ``_default_to_fused_or_foreach``,
# ``_use_grad_for_differentiable``, the ``_*_doc`` fragments, ...), which older
# releases lack and newer ones change without notice; qhoptim has its own
# equivalents of these below, built on public API only. What is left, each
# because there is no public way to do it (tests/torch/
# test_torch_public_api_only.py fails on any other private torch name):
#
# * ``Optimizer._group_tensors_by_device_and_dtype`` (a staticmethod of the
#   public class, in C++; used only through :func:`group_by_device_and_dtype`):
#   the split of tensor lists by device and dtype before the multi-tensor
#   kernels, with torch's check that the tensors of one index agree. A Python
#   equivalent with that check took 2.2x as long (torch 2.13, 2 CPU cores: 560
#   vs 260 us for 5 lists of 500 tensors, 68 vs 28 us for 62), +4% on a QHAdam
#   step over 500 CPU tensors of 1,000 elements, and more on an accelerator,
#   where the step's time is mostly the host's.
# * ``torch._foreach_*`` (``_kernels.py``, ``_qhadam.py``, ``_triton.py``):
#   torch's multi-tensor ops, documented (beta) under this spelling only.
# * ``Optimizer._optimizer_load_state_dict_pre_hooks`` (``load_state_dict``):
#   the load-state-dict pre-hooks are run once before qhoptim checks the state
#   dict and are then hidden from torch's ``load_state_dict``; torch has no
#   public accessor for them.
# * ``_step_supports_amp_scaling`` (set by ``fused=True`` optimizers): the
#   attribute ``torch.amp.GradScaler`` reads to hand a fused step its
#   ``grad_scale`` and ``found_inf``, as torch's fused Adam sets it.


def group_by_device_and_dtype(
    tensorlists: Sequence[Sequence[Tensor]], with_indices: bool = False
) -> dict[tuple[Any, Any], tuple[list[list[Tensor | None]], list[int]]]:
    """The lists split by the device and dtype of the first list's tensors:
    ``{(device, dtype): (lists, indices)}``, ``indices`` the group's positions
    (with ``with_indices``). Under ``torch.compile`` one group of everything."""
    return Optimizer._group_tensors_by_device_and_dtype(
        tensorlists,  # type: ignore[arg-type]
        with_indices=with_indices,
    )


# ---------------------------------------------------------------------------
# qhoptim's own equivalents of torch.optim.optimizer's private helpers (as of
# torch 2.13), built on public API.


state_dtype_doc = r"""state_dtype (torch.dtype, optional): store the state in this
            dtype, e.g. ``torch.bfloat16`` for half a float32 model's state
            memory, or ``torch.uint8`` for 8-bit blockwise state (a byte per
            value and a float32 scale per 256 values); the arithmetic stays in
            the parameters' dtype (default: None, the parameters' own; see
            docs/torch.md)
        stochastic_rounding (bool, optional): write a bfloat16 or 8-bit state
            back with unbiased, counter-based stochastic rounding (default:
            None, i.e. True for bfloat16 and 8-bit; False rounds to nearest)"""


def _copy(count: Any) -> Any:
    """A copy of a step count (a tensor, or a number)."""
    return count.clone() if isinstance(count, Tensor) else count


def scalar_dtype() -> torch.dtype:
    """The dtype of a new (non-fused) step count: float64 under a float64 default
    dtype, else float32 (as torch's ``_get_scalar_dtype``)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def value_of(x: Any) -> Any:
    """A step count's value: a Python number in eager mode (``item()`` is faster
    than arithmetic with a CPU tensor), the tensor itself under ``torch.compile``
    (as torch's ``_get_value``)."""
    if torch.compiler.is_compiling():
        return x
    return x.item() if isinstance(x, Tensor) else x


def scalar_lr(lr: Any) -> Any:
    """``lr`` for the step: a 1-element tensor of any shape as a 0-d tensor, anything
    else unchanged (as torch's ``_to_scalar``)."""
    if isinstance(lr, Tensor) and lr.dim() != 0:
        return lr.squeeze()
    return lr


# Device types with multi-tensor kernels, besides a PrivateUse1 backend (torch
# 2.13's list; CPU is handled apart, see default_foreach).
_FOREACH_DEVICES = ("cuda", "xpu", "mtia")


def _is_foreach_device(device_type: str) -> bool:
    """Whether torch has multi-tensor kernels for ``device_type`` (CPU aside)."""
    if device_type in _FOREACH_DEVICES:
        return True
    # An out-of-tree backend registered as PrivateUse1 (and maybe renamed, e.g.
    # "npu"): "privateuseone" parses to it, and its type reads back its name.
    return device_type == torch.device("privateuseone").type


def _is_foreach_type(cls: type) -> bool:
    """Whether the multi-tensor kernels take tensors of type ``cls`` by default:
    plain tensors and parameters, and DTensors (FSDP2, tensor parallelism) --
    exactly these types, no other subclasses -- as in torch, whose list gains
    DTensor when torch.distributed imports it."""
    if cls is Tensor or cls is torch.nn.Parameter:
        return True
    # DTensor by name, so as not to import torch.distributed (a DTensor exists only
    # once it is imported): torch.distributed.tensor's, torch.distributed._tensor's
    # before torch 2.5.
    return cls.__name__ == "DTensor" and cls.__module__.startswith("torch.distributed.")


def use_grad_for_differentiable(step: _F) -> _F:
    """Run ``step`` with autograd on only for ``differentiable=True`` optimizers.

    As torch's ``_use_grad_for_differentiable``: under ``torch.compile`` the step
    is also split off from the code around it (a graph break before and after),
    so that it is traced as the inference graph it is and updates its tensors in
    place rather than allocating new ones (pytorch/pytorch#104053).
    """

    @functools.wraps(step)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        prev_grad = torch.is_grad_enabled()
        try:
            torch.set_grad_enabled(self.defaults["differentiable"])
            if torch.compiler.is_compiling():
                _graph_break()
            result = step(self, *args, **kwargs)
        finally:
            if torch.compiler.is_compiling():
                _graph_break()
            torch.set_grad_enabled(prev_grad)
        return result

    return cast(_F, wrapper)


def _graph_break() -> None:
    """Break ``torch.compile``'s graph here (torch itself calls the private
    ``torch._dynamo.graph_break``). Dynamo does not trace into
    ``torch.compiler.disable``, nor into the function it returns, so the call
    breaks the graph; it is made only while compiling, because
    ``torch.compiler.disable`` imports ``torch._dynamo`` (seconds), which a
    compilation has imported already."""
    torch.compiler.disable(_nothing)()  # type: ignore[no-untyped-call]


def _nothing() -> None:
    pass


# Docstring fragments for the flags QHM and QHAdam share with torch.optim.
params_doc = r"""params (iterable): the parameters to optimize: an iterable of tensors or
            of dicts defining parameter groups (or of ``named_parameters()``, in
            torch releases whose ``Optimizer`` takes them)"""

maximize_doc = r"""maximize (bool, optional): step along the gradient, maximizing the
            objective, instead of against it (default: False)"""

foreach_doc = r"""foreach (bool, optional): whether the multi-tensor (foreach)
            implementation runs the step instead of the per-tensor loop. ``None``
            picks foreach for non-differentiable steps of plain tensors,
            parameters or DTensors that are all on CPU (where it was measured
            faster, unlike torch's optimizers) or all on a device with multi-tensor
            kernels (CUDA, XPU, ...), and the loop otherwise. Its intermediates
            are tensor lists: up to about the parameters' size in extra peak
            memory (default: None)"""

capturable_doc = r"""capturable (bool, optional): whether the step can be captured in a
            CUDA graph (or compiled with ``torch.compile``): it then reads nothing
            back to the host (step counts live on the parameters' devices).
            Slower outside a graph, so leave it False unless you capture the step
            (default: False)"""

differentiable_doc = r"""differentiable (bool, optional): whether autograd records the
            step, so that gradients flow through it; otherwise ``step()`` runs
            under ``torch.no_grad()``. Slower, so leave it False unless you
            differentiate through the step (default: False)"""


def lr_value(lr: Any) -> Any:
    """The value of ``lr`` to validate: a 1-element tensor is read once, here, never in ``step``."""
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError(f"Tensor lr must be 1-element; received a tensor of shape {lr.shape}")
        return float(lr.detach())
    if lr is required:
        return 0.0  # torch's add_param_group reports the missing lr, after these checks
    return lr


def numbers_only(hparams: dict[str, Any]) -> None:
    """Refuse tensors for the hyperparameters that are not ``lr``.

    The steps fold them into Python-float coefficients (the in-place kernels'
    scalars), so a tensor would fail inside ``step`` or be read once and then
    ignored when changed; only ``lr`` may be a tensor, as in ``torch.optim``.
    """
    for name, value in hparams.items():
        if isinstance(value, Tensor):
            raise TypeError(
                f"{name} must be a Python number (only lr may be a tensor); "
                f"received {name}={value!r}"
            )


# The hyperparameters a param group may hold as numbers (QHM's and QHAdam's).
_HPARAMS = ("lr", "momentum", "nu", "weight_decay", "eps")
_PAIRS = ("betas", "nus")


def _number(value: Any) -> Any:
    # A concrete scalar of another kind (a NumPy scalar or 0-d array, a JAX
    # array) as the Python float it holds; torch tensors are left to
    # lr_value / numbers_only (lr may stay a tensor, the others are refused).
    return value if isinstance(value, Tensor) else validation.as_float(value)


def as_numbers(group: dict[str, Any]) -> dict[str, Any]:
    """``group`` with its hyperparameters' concrete scalars as Python floats.

    The steps fold hyperparameters into Python-float coefficients of in-place
    kernels; a 0-d NumPy array there fails (``_foreach_add``) once the step
    count has advanced. So, as in every backend, a concrete scalar is read once,
    when the group is made (constructor, ``add_param_group``, ``load_state_dict``).
    """
    out = dict(group)
    for key in _HPARAMS:
        if key in out:
            out[key] = _number(out[key])
    for key in _PAIRS:
        pair = out.get(key)
        if isinstance(pair, (tuple, list)) and len(pair) == 2:
            values = [_number(v) for v in pair]
            out[key] = tuple(values) if isinstance(pair, tuple) else values
    return out


def needs_formula(lr: Any, capturable: bool, differentiable: bool) -> bool:
    """Whether a coefficient may be a tensor, so in-place kernels with scalars cannot be used."""
    return differentiable or capturable or isinstance(lr, Tensor) or torch.compiler.is_compiling()


def default_foreach(params: list[Tensor], differentiable: bool) -> bool:
    """The implementation ``foreach=None`` picks (see ``benchmarks/torch_step.py``).

    torch's rule picks the multi-tensor kernels on accelerators only, and the
    per-tensor loop on CPU. Here the CPU multi-tensor path works in cache-sized
    chunks (:data:`_CPU_CHUNK_NUMEL`), and so measured faster than the loop on
    CPU too: on ResNet-18 shapes as fast or faster (QHAdam 21 vs 22 ms), on 500
    tensors of 1,000 elements 1.5x faster (Python dispatch per tensor and op).
    So foreach is the default on CPU as well, for non-differentiable steps of
    the tensor types torch's multi-tensor kernels take: plain tensors and
    parameters, and DTensors (FSDP2 or tensor parallelism on CPU), for which
    the loop pays DTensor's dispatch per tensor and op: QHAdam on 200 DTensors
    of 1,000 elements sharded over 2 gloo ranks takes 28 ms with foreach and
    200 ms in the loop.

    Otherwise the rule is torch's (``_default_to_fused_or_foreach`` in torch
    2.13): the per-tensor loop for differentiable steps and for tensors of other
    types, foreach when all parameters are on devices with multi-tensor kernels
    (so not for a mix of CPU and CUDA parameters).
    """
    if differentiable:
        return False
    # As before: torch's rule passes a None entry, qhoptim's CPU rule does not.
    if not all(p is None or _is_foreach_type(type(p)) for p in params):
        return False
    if all(p is not None and p.device.type == "cpu" for p in params):
        return True
    return all(p is None or _is_foreach_device(p.device.type) for p in params)


def _storage_ptr(t: Tensor) -> int | None:
    """The address of ``t``'s storage, or None where it has none to read (e.g. DTensor)."""
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def unalias_grads(params: list[Tensor], grads: list[Tensor]) -> list[Tensor]:
    """``grads`` with each gradient that shares storage with its parameter cloned.

    ``p.grad = p.detach()`` (the gradient of ``|p|**2 / 2``) or a view of ``p``
    would otherwise be read by the in-place kernels after they have written
    ``p`` (weight decay, the update's several passes). The check compares the
    storages' addresses, so it catches views of the parameter too; it costs
    about 0.3 us per parameter (135 us for 500, against a 6.4 ms QHAdam step;
    2 CPU cores, torch 2.13), and only an aliased gradient is copied. The
    fused CPU kernel makes the same check in C++, where it costs nothing
    measurable, so the fused path calls this only for CUDA tensors.

    Skipped under ``torch.compile``: Dynamo cannot trace ``data_ptr`` without a
    graph break (tests/torch/test_torch_graphs.py checks there is none), and a
    compiled step takes the out-of-place formula path
    (:func:`qhoptim.torch._kernels.formula_qhm_`), which reads the whole
    gradient before it writes the parameter, and whose functionalized graph
    respects the aliasing.
    """
    if torch.compiler.is_compiling():
        return grads
    out = grads
    for i, (p, g) in enumerate(zip(params, grads, strict=True)):
        if g is None or p is None:
            continue
        ptr = _storage_ptr(g)
        if ptr is None or ptr == 0 or ptr != _storage_ptr(p):
            continue
        if out is grads:
            out = list(grads)
        out[i] = g.clone()
    return out


def cast_complex_state(param: Tensor, state: dict[str, Any]) -> None:
    """Cast a complex parameter's loaded state to its precision.

    torch's ``load_state_dict`` casts state only for floating-point parameters;
    for a complex one it would keep, e.g., complex128 moments for a complex64
    parameter (and the foreach kernels would then refuse the mix).
    """
    if not param.is_complex():
        return
    for key, value in state.items():
        if key != "step" and torch.is_tensor(value):
            state[key] = value.to(param.dtype if value.is_complex() else param.real.dtype)


def _eight_bit(dtype: Any) -> bool:
    return bool(dtype == torch.uint8)


def _check_param_state(
    what: str,
    key: Any,
    param: Tensor,
    p_state: Any,
    allowed: tuple[frozenset[str], ...],
    *,
    packed: bool = False,
) -> None:
    """One parameter's saved state: the optimizer's keys, tensors that fit the parameter.

    Keys that are none of the optimizer's are another component's and pass
    unchecked, as ``torch.optim`` keeps them: timm's ``Lookahead`` and
    similar wrappers store their own buffers in the wrapped optimizer's state.
    They are accepted only beside a complete layout of the optimizer's own keys,
    so that another optimizer's state (SGD's ``momentum_buffer`` in QHAdam) is
    still refused. ``packed``: the state is 8-bit, one flat tensor of
    :func:`qhoptim.torch._state_dtype.packed_numel` values per state.
    """
    if not isinstance(p_state, dict):
        raise TypeError(
            f"{what}: the state of parameter {key!r} is a {type(p_state).__name__}, not a dict"
        )
    own = frozenset().union(*allowed)
    keys = frozenset(p_state) & own
    if keys not in allowed or (not keys and p_state):
        want = " or ".join(str(sorted(a)) for a in allowed if a)
        raise ValueError(
            f"{what}: the state of parameter {key!r} has keys {sorted(p_state)}, expected "
            f"{want}; is this the state dict of another optimizer?"
        )
    for name in sorted(keys):
        value = p_state[name]
        if name in ("step", "beta1_weight", "beta2_weight"):
            number = value
            if torch.is_tensor(value):
                if value.numel() != 1 or value.is_complex():
                    raise ValueError(
                        f"{what}: {name} of parameter {key!r} must be a real number or a "
                        f"1-element tensor; received a tensor of shape {tuple(value.shape)}"
                    )
                number = value.item()
            if isinstance(number, bool) or not isinstance(number, (int, float)):
                raise TypeError(
                    f"{what}: {name} of parameter {key!r} must be a number; received {value!r}"
                )
            if not (math.isfinite(number) and number >= 0):
                raise ValueError(
                    f"{what}: {name} of parameter {key!r} must be in [0, inf); received {number!r}"
                )
            continue
        if not torch.is_tensor(value):
            raise TypeError(
                f"{what}: {name} of parameter {key!r} must be a tensor; "
                f"received {type(value).__name__}"
            )
        if packed:
            from qhoptim.torch._state_dtype import packed_numel

            packed_shape = (packed_numel(param.numel()),)
            if tuple(value.shape) != packed_shape or value.is_complex():
                raise ValueError(
                    f"{what}: {name} of parameter {key!r} has shape {tuple(value.shape)}; "
                    f"the 8-bit state of a parameter of {param.numel()} values has "
                    f"{packed_shape}"
                )
            continue
        if value.shape != param.shape:
            raise ValueError(
                f"{what}: {name} of parameter {key!r} has shape {tuple(value.shape)}, "
                f"the parameter {tuple(param.shape)}"
            )
        # |g|^2 is real, and so are the second moment and its running maximum.
        complex_ok = param.is_complex() and name not in ("exp_avg_sq", "max_exp_avg_sq")
        if not (value.is_floating_point() or (value.is_complex() and complex_ok)) or (
            complex_ok and not value.is_complex()
        ):
            raise ValueError(
                f"{what}: {name} of parameter {key!r} has dtype {value.dtype}, which cannot "
                f"hold the state of a {param.dtype} parameter"
            )


# On CPU the multi-tensor kernels run over runs of whole tensors of about this
# many elements: each kernel then finds its operands still in cache from the
# previous one (as the per-tensor loop does), while small tensors still share
# kernel calls. Measured with 2 threads (benchmarks/torch_step.py): QHAdam on
# ResNet-18 shapes takes 21 ms in chunks of 2**13 to 2**21 elements, 29 ms


def on_device_kernels(capturable: bool, differentiable: bool) -> bool:
    """Whether a capturable multi-tensor step keeps its coefficients on the device.

    ``capturable=True`` must not read anything back to the host (a CUDA graph
    replays the step with new gradients and a new tensor ``lr``), so the
    coefficients become tensors and the kernels take them as tensor operands.
    Differentiable steps and ``torch.compile`` take the out-of-place formula
    path instead (autograd; the compiler fuses it).
    """
    return capturable and not differentiable and not torch.compiler.is_compiling()


def sparse_error(optimizer: str) -> RuntimeError:
    return RuntimeError(f"{optimizer} does not support sparse gradients")


class QHOptimizer(Optimizer):
    """Plumbing shared by QHM and QHAdam: flags of older state dicts, gathering
    the parameters that have a gradient, and ``step`` over the param groups."""

    # The spelling of decoupled weight decay in qhoptim 1.1.0 and before: QHM's
    # ``weight_decay_type`` ("grad" | "direct"), QHAdam's ``decouple_weight_decay``.
    # qhoptim.torch reads it with a DeprecationWarning, qhoptim.pyt silently.
    _LEGACY_DECAY_KEY = ""
    _WARN_LEGACY = True

    @staticmethod
    def _decoupled_from_legacy(value: Any) -> bool:
        """The ``decoupled_weight_decay`` that the legacy setting ``value`` means."""
        raise NotImplementedError

    def _renamed(self, group: dict[str, Any], *, warn: bool) -> dict[str, Any]:
        """``group`` with its legacy weight-decay key read into ``decoupled_weight_decay``."""
        key = self._LEGACY_DECAY_KEY
        if key not in group:
            return group
        group = dict(group)
        value = group.pop(key)
        decoupled = self._decoupled_from_legacy(value)
        if warn and self._WARN_LEGACY:
            warnings.warn(
                f"{type(self).__name__}: {key}={value!r} is deprecated; "
                f"use decoupled_weight_decay={decoupled}",
                DeprecationWarning,
                stacklevel=3,
            )
        group["decoupled_weight_decay"] = decoupled
        return group

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for i, group in enumerate(self.param_groups):
            # Older state dicts (qhoptim 1.1.0's included) lack torch's flags.
            for flag, default in _TORCH_FLAGS.items():
                group.setdefault(flag, default)
            group = self.param_groups[i] = self._renamed(group, warn=False)
            group.setdefault("decoupled_weight_decay", False)
            self._upgrade_group(group)

    def _upgrade_group(self, group: dict[str, Any]) -> None:
        """Fill in what an older state dict lacks in ``group`` and its state."""
        raise NotImplementedError

    # What a state dict of this optimizer holds: the hyperparameters every param
    # group must have, and the sets of keys a parameter's state may have (the
    # empty set: not stepped yet).
    _GROUP_KEYS: tuple[str, ...] = ()
    _STATE_KEYS: tuple[frozenset[str], ...] = ()
    # Whether each state list the step takes holds negative values (an 8-bit
    # state encodes a sign only where it does).
    _SIGNED: tuple[bool, ...] = ()

    def _check_group(self, group: dict[str, Any]) -> None:
        """Validate a param group's hyperparameters (``validation``'s checks)."""
        raise NotImplementedError

    @classmethod
    def _from_conversion(cls, params: Any, converted: Any, expected: type, **kwargs: Any) -> Any:
        if not isinstance(converted, expected):
            raise TypeError(
                f"{cls.__name__}.from_params expects qhoptim.convert.{expected.__name__}; "
                f"received {type(converted).__name__}"
            )
        return cls(params, **converted.as_kwargs(), **kwargs)  # type: ignore[attr-defined]

    def _step_lists(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        state_lists: list[list[Tensor]],
        steps: list[Any],
        run: Callable[..., None],
        *,
        count_steps: bool,
    ) -> None:
        """``run(params, grads, state_lists, steps, state_seeds)``, the functional step,
        for a group whose state may be stored narrower than its parameters
        (``state_dtype``).

        Parameters whose state has their own dtype step as usual. A bfloat16
        state of float32 parameters with ``fused=True`` on CPU steps in the
        fused kernel itself, which rounds it stochastically with the seeds it is
        given; any other narrow state steps on working copies
        (:func:`qhoptim.torch._state_dtype.step_with_narrow_state`). The seeds
        are made of the number of the step being taken (the count in ``steps``
        plus one; the count is advanced here, except by QHAdam's fused step,
        which advances its own) and the parameter's position in the optimizer.
        ``count_steps``: the counts are only for the seeds (QHM's).
        """
        if group.get("state_dtype") is None:
            run(params, grads, state_lists, steps, None)
            return
        from qhoptim.torch import _state_dtype

        narrow = [_state_dtype.narrow(group, p) for p in params]
        for keep in (False, True):
            at = [i for i, n in enumerate(narrow) if n is keep]
            if not at:
                continue
            ps, gs = [params[i] for i in at], [grads[i] for i in at]
            lists, counts = [[lst[i] for i in at] for lst in state_lists], [steps[i] for i in at]
            if not keep:
                run(ps, gs, lists, counts, None)
                continue
            everything = (q for g in self.param_groups for q in g["params"])
            position = {p: i for i, p in enumerate(everything)}
            # The seeds of the step about to be taken: its number and the
            # parameter's position.
            seeds = [
                [_state_dtype.rounding_seed(value_of(c) + 1, 4 * position[p] + k) for k in range(3)]
                for p, c in zip(ps, counts, strict=True)
            ]
            if _state_dtype.in_fused_kernel(group, ps):
                run(ps, gs, lists, counts, seeds)  # QHAdam's fused step counts itself
                if count_steps:
                    for c in counts:
                        c += 1
                continue
            # Working copies, a slice of a large tensor at a time: each slice
            # steps from a copy of its tensor's count; the count then takes
            # the value its copies reached (QHM's is advanced here).
            reached: dict[int, Any] = {}

            def piece_step(
                at: list[int],
                cps: Any,
                cgs: Any,
                work: Any,
                counts: Any = counts,
                reached: dict[int, Any] = reached,
            ) -> None:
                copies = [_copy(counts[i]) for i in at]
                run(cps, cgs, work, copies, None)
                reached.update(zip(at, copies, strict=True))

            _state_dtype.step_with_narrow_state(
                ps, gs, lists, piece_step, seeds, group.get("stochastic_rounding"), self._SIGNED
            )
            for i, c in enumerate(counts):
                if count_steps:
                    c += 1
                elif i in reached:
                    c.copy_(reached[i])

    def _narrow_state(self, group: dict[str, Any], keys: tuple[str, ...]) -> None:
        """Store ``keys`` of the group's state in its ``state_dtype`` (torch's
        ``load_state_dict`` casts loaded state to the parameter's dtype)."""
        dtype = group.get("state_dtype")
        if dtype is None:
            return
        for p in group["params"]:
            state = self.state.get(p, {})
            for key in keys:
                if key in state and state[key].dtype != dtype and not p.is_complex():
                    state[key] = state[key].to(dtype)

    def _check_decay(self, group: dict[str, Any]) -> None:
        decoupled = self._renamed(group, warn=False).get("decoupled_weight_decay", False)
        if not isinstance(decoupled, bool):
            raise TypeError(
                "decoupled_weight_decay must be a bool; "
                f"received decoupled_weight_decay={decoupled!r}"
            )

    def __init__(self, params: Any, defaults: dict[str, Any]) -> None:
        super().__init__(params, as_numbers(defaults))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if isinstance(param_group, dict):
            param_group = self._renamed(param_group, warn=True)
        self._check_group({**self.defaults, **param_group})
        if isinstance(param_group, dict):
            param_group = as_numbers(param_group)
        super().add_param_group(param_group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the optimizer state, after checking it fits this optimizer.

        The state dict must come from this optimizer class (or qhoptim 1.1.0's
        class of the same name): its param groups must match this optimizer's in
        number and size and hold valid hyperparameters, and each parameter's
        state must have this optimizer's keys, with tensors of the parameter's
        shape and a floating-point dtype (torch casts them to the parameter's
        dtype, as for its own optimizers). Anything else -- a state dict of
        ``torch.optim.Adam`` or of another QH optimizer, wrong shapes, missing
        keys -- raises ``ValueError`` or ``TypeError`` and leaves the optimizer
        unchanged. Load-state-dict pre-hooks run first, once, as in torch.
        """
        hooks = self._optimizer_load_state_dict_pre_hooks
        state_dict = state_dict.copy() if isinstance(state_dict, dict) else state_dict
        for hook in hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._check_state_dict(state_dict)
        # Concrete scalars in the saved groups as floats, as in add_param_group.
        state_dict = {
            **state_dict,
            "param_groups": [as_numbers(g) for g in state_dict["param_groups"]],
        }
        self._optimizer_load_state_dict_pre_hooks = type(hooks)()  # already run
        try:
            super().load_state_dict(state_dict)
        finally:
            self._optimizer_load_state_dict_pre_hooks = hooks

    def _check_state_dict(self, state_dict: Any) -> None:
        name = type(self).__name__
        what = f"{name}.load_state_dict"
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= state_dict.keys():
            keys = sorted(map(str, state_dict)) if isinstance(state_dict, dict) else None
            raise TypeError(
                f"{what} expects a dict with 'state' and 'param_groups' (from state_dict()); "
                f"received {type(state_dict).__name__}" + (f" with keys {keys}" if keys else "")
            )
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"{what}: the state dict has {len(saved_groups)} param groups, "
                f"this optimizer {len(self.param_groups)}"
            )
        params: dict[Any, Tensor] = {}
        packed: set[Any] = set()  # the ids of parameters whose state is 8-bit
        for i, (saved, group) in enumerate(zip(saved_groups, self.param_groups, strict=True)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"{what}: param group {i} of the state dict has {len(saved['params'])} "
                    f"parameters, this optimizer's {len(group['params'])}"
                )
            missing = [k for k in self._GROUP_KEYS if k not in saved]
            if missing:
                raise ValueError(
                    f"{what}: param group {i} lacks {missing}; is this the state dict "
                    f"of another optimizer? {name} needs {list(self._GROUP_KEYS)}"
                )
            self._check_group({**self.defaults, **saved})
            params.update(zip(saved["params"], group["params"], strict=True))
            if _eight_bit(saved.get("state_dtype")):
                packed.update(saved["params"])
        for key, p_state in state_dict["state"].items():
            if key not in params:
                raise ValueError(
                    f"{what}: the state dict has state for parameter {key!r}, "
                    "which none of its param groups lists"
                )
            _check_param_state(
                what, key, params[key], p_state, self._STATE_KEYS, packed=key in packed
            )

    def _gather(
        self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor]
    ) -> tuple[list[dict[str, Any]], bool]:
        """Append the params with a gradient (and their grads); return their states."""
        states = []
        has_complex = False
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise sparse_error(type(self).__name__)
            has_complex |= torch.is_complex(p)
            params.append(p)
            grads.append(p.grad)
            states.append(self.state[p])
        return states, has_complex

    def _step_group(self, group: dict[str, Any]) -> None:
        raise NotImplementedError

    def _setup_fused(self) -> None:
        """Check a ``fused=True`` optimizer's params; take GradScaler's scale and infs."""
        if self.defaults.get("fused"):
            from qhoptim.torch._fused import check_fused

            check_fused(
                [p for g in self.param_groups for p in g["params"]],
                foreach=self.defaults["foreach"],
                differentiable=self.defaults["differentiable"],
            )
            # torch.amp.GradScaler then sets grad_scale and found_inf instead
            # of unscaling the gradients itself; the fused kernels read them.
            self._step_supports_amp_scaling = True

    def _amp_tensors(self) -> dict[str, Tensor | None]:
        return {
            "grad_scale": getattr(self, "grad_scale", None),
            "found_inf": getattr(self, "found_inf", None),
        }

    def _step_dtype_and_device(self, group: dict[str, Any], p: Tensor) -> dict[str, Any]:
        """Where a new step count lives: on the parameter's device for capturable and
        fused steps (float32 for fused, as torch's), else a CPU tensor."""
        if group["fused"]:
            return {"dtype": torch.float32, "device": p.device}
        if group["capturable"]:
            return {"dtype": scalar_dtype(), "device": p.device}
        return {"dtype": scalar_dtype()}

    @use_grad_for_differentiable
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Perform a single optimization step.

        Args:
            closure (Callable, optional): A closure that reevaluates the model
                and returns the loss.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss
