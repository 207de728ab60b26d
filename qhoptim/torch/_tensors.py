"""The bottom layer of :mod:`qhoptim.torch`: tensor lists and the flags that pick a path.

Grouping tensor lists by device and dtype, DTensors' local shards, gradients
that alias their parameters, step counts' values, the implementation
``foreach=None`` picks, and the hyperparameter tuples the kernels take. It
holds no arithmetic on tensor values (``_kernels.py`` does) and imports only
torch and the qhoptim core; every other module of the package may import it.
"""

from __future__ import annotations

import itertools
import operator
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.optim.optimizer import Optimizer

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
# * ``torch._C`` (its ``_group_tensors_by_device_and_dtype`` alone): the C++
#   function that staticmethod calls outside ``torch.compile``, called
#   directly there.
#   torch.optim's helper wraps it in ``no_grad``, a context entered and left
#   on every step around a call that only sorts tensors into lists; after a
#   fused step over a million values has pushed the interpreter out of the
#   CPU's caches, that wrapper cost about 5 us of the next step's host work
#   (the grouping 11.5 -> 6.7 us; torch 2.13, 2 CPU cores).
# * ``torch._foreach_*`` (``_kernels.py``, ``_tensors.py``, ``_triton.py``):
#   torch's multi-tensor ops, documented (beta) under this spelling only.
# * ``Optimizer._optimizer_load_state_dict_pre_hooks`` (``load_state_dict``):
#   the load-state-dict pre-hooks are run once before qhoptim checks the state
#   dict and are then hidden from torch's ``load_state_dict``; torch has no
#   public accessor for them.
# * ``_step_supports_amp_scaling`` (set by ``fused=True`` optimizers): the
#   attribute ``torch.amp.GradScaler`` reads to hand a fused step its
#   ``grad_scale`` and ``found_inf``, as torch's fused Adam sets it.

# ---------------------------------------------------------------------------
# qhoptim's own equivalents of torch.optim.optimizer's private helpers (as of
# torch 2.13), built on public API.


def group_by_device_and_dtype(
    tensorlists: Sequence[Sequence[Tensor]], with_indices: bool = False
) -> dict[tuple[Any, Any], tuple[list[list[Tensor | None]], list[int]]]:
    """The lists split by the device and dtype of the first list's tensors:
    ``{(device, dtype): (lists, indices)}``, ``indices`` the group's positions
    (with ``with_indices``). Under ``torch.compile`` one group of everything."""
    if torch.compiler.is_compiling():
        return Optimizer._group_tensors_by_device_and_dtype(
            tensorlists,  # type: ignore[arg-type]
            with_indices=with_indices,
        )
    # What that helper calls outside torch.compile, less its no_grad wrapper
    # (see the list above).
    return torch._C._group_tensors_by_device_and_dtype(
        tensorlists,  # type: ignore[arg-type]
        with_indices,
    )


def copy_count(count: Any) -> Any:
    """A copy of a step count (a tensor, or a number)."""
    return count.clone() if isinstance(count, Tensor) else count


def values_of(counts: Sequence[Any]) -> list[Any]:
    """:func:`value_of` of each step count; in eager mode, for tensors, at C
    speed (CPU counts: an ``item()`` each, cheaper than stacking one-value
    tensors) or in one read of them stacked (on a device: one synchronization)."""
    tensors = all(map(isinstance, counts, itertools.repeat(Tensor)))
    if counts and tensors and not torch.compiler.is_compiling():
        if all(map(_IS_CPU, counts)):
            return list(map(Tensor.item, counts))
        try:
            return torch.stack(list(counts)).tolist()
        except RuntimeError:  # counts on different devices: one read each
            pass
    return [value_of(c) for c in counts]


_IS_CPU = operator.attrgetter("is_cpu")


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


def needs_formula(lr: Any, capturable: bool, differentiable: bool) -> bool:
    """Whether a coefficient may be a tensor, so in-place kernels with scalars cannot be used."""
    return differentiable or capturable or isinstance(lr, Tensor) or torch.compiler.is_compiling()


def default_foreach(params: list[Tensor], differentiable: bool) -> bool:
    """The implementation ``foreach=None`` picks (see ``benchmarks/torch_step.py``).

    torch's rule picks the multi-tensor kernels on accelerators only, and the
    per-tensor loop on CPU. Here the CPU multi-tensor path works in cache-sized
    chunks (:data:`qhoptim.torch._kernels.CPU_CHUNK_NUMEL`), and so measured faster than the loop on
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


def on_device_kernels(capturable: bool, differentiable: bool) -> bool:
    """Whether a capturable multi-tensor step keeps its coefficients on the device.

    ``capturable=True`` must not read anything back to the host (a CUDA graph
    replays the step with new gradients and a new tensor ``lr``), so the
    coefficients become tensors and the kernels take them as tensor operands.
    Differentiable steps and ``torch.compile`` take the out-of-place formula
    path instead (autograd; the compiler fuses it).
    """
    return capturable and not differentiable and not torch.compiler.is_compiling()


class QHMHyperparameters(NamedTuple):
    """The hyperparameters of one QHM step (Python numbers; ``lr`` may be a tensor)."""

    lr: Any
    momentum: float
    nu: float
    weight_decay: float
    decoupled_weight_decay: bool
    maximize: bool


class QHAdamHyperparameters(NamedTuple):
    """The hyperparameters of one QHAdam step (Python numbers; ``lr`` may be a tensor)."""

    lr: Any
    beta1: float
    beta2: float
    nu1: float
    nu2: float
    eps: float
    weight_decay: float
    decoupled_weight_decay: bool
    maximize: bool
    #: QHAdam's AMSGrad variant: the denominator reads the running maximum of
    #: the second moment (:func:`qhoptim.rules.qhadam_amsgrad_update`).
    amsgrad: bool = False


def local_shard(t: Tensor) -> Tensor:
    """A DTensor's local shard (FSDP2, tensor parallelism): the step is element-wise,
    and a parameter, its gradient and its state share their placements."""
    to_local = getattr(t, "to_local", None)
    return t if to_local is None else to_local()


_PLAIN = frozenset({Tensor, torch.nn.Parameter})


def local_shards(ts: list[Tensor]) -> list[Tensor]:
    """:func:`local_shard` of each; the list itself when it holds plain tensors only
    (a type per tensor, taken at C speed: cheaper than looking up ``to_local``)."""
    if _PLAIN.issuperset(map(type, ts)):
        return ts
    return [local_shard(t) for t in ts]


def all_contiguous(tensors: list[Tensor]) -> bool:
    """Whether every tensor is contiguous (in one pass, no bytecode per tensor:
    the fused steps ask it of every list on every step)."""
    return all(map(Tensor.is_contiguous, tensors))


def runs_triton(device: torch.device) -> bool:
    """Whether ``fused=True`` steps tensors on ``device`` with the Triton kernels:
    CUDA tensors, and CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``,
    which tests the CUDA kernels on CPU); other CPU tensors take the C++ kernel."""
    kind = device.type
    if kind == "cuda":
        return True
    return kind == "cpu" and _interpreting()


if os.name == "posix" and isinstance(getattr(os.environ, "_data", None), dict):
    # Asked on every fused CPU step: os.environ's own dict (bytes keys on
    # POSIX, kept in step with os.environ by its setters) answers a missing
    # key without the KeyError that os.environ.get raises and catches --
    # measured 6 us against 3 us of a step's host work after a kernel over
    # a million values has pushed the interpreter out of the CPU's caches.
    _ENVIRON: dict[bytes, bytes] = os.environ._data  # type: ignore[attr-defined]

    def _interpreting() -> bool:
        return _ENVIRON.get(b"TRITON_INTERPRET") == b"1"

else:

    def _interpreting() -> bool:
        return os.environ.get("TRITON_INTERPRET") == "1"


# The addend of step counts on the CPU: a CPU tensor keeps torch's multi-tensor
# kernel on its fast path there (a number does not), made once.
_ONE = torch.tensor(1.0, device="cpu")


def advance_counts(counts: list[Tensor]) -> None:
    """Add one to each step count (0-d tensors of one device)."""
    if counts and counts[0].is_cpu:
        torch._foreach_add_(counts, _ONE, alpha=1.0)
    else:
        torch._foreach_add_(counts, 1)
