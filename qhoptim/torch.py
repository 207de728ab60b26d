r"""QHM, QHAdam and QHAdamW for PyTorch (``torch.optim.Optimizer`` subclasses).

The math comes from :mod:`qhoptim.rules`; validation from
:mod:`qhoptim.validation`. The layout follows ``torch/optim/adam.py``: each
class gathers its parameters, gradients and state in ``_init_group`` and calls
a functional entry point (:func:`qhm`, :func:`qhadam`) which dispatches to a
per-tensor implementation (``_single_tensor_qhm``) or a multi-tensor one built
on ``torch._foreach_*`` kernels (``_multi_tensor_qhm``).

Each implementation has two ways of taking a step:

* the *fast* way, used when every coefficient is a Python number (eager mode,
  float ``lr``, not ``differentiable``): the coefficients of
  :func:`qhoptim.rules.qhm_coefficients` / :func:`~qhoptim.rules.qhadam_coefficients`
  applied with in-place kernels (``lerp_``, ``addcmul_``, ``addcdiv_`` and their
  ``_foreach_`` twins), with as few passes over memory as possible;
* the *formula* way, used with a tensor ``lr``, ``capturable=True``,
  ``differentiable=True`` or under ``torch.compile`` (where the step count is a
  tensor): :func:`qhoptim.rules.qhm_update` / :func:`~qhoptim.rules.qhadam_update`
  evaluated on tensors, the results copied into the state. It is out of place,
  differentiable, free of host synchronisation, and ``torch.compile`` fuses it.
  The multi-tensor implementation takes ``capturable=True`` (not differentiable,
  not compiled) a third way: the coefficients of ``qhadam_coefficients``
  evaluated on the device step counts, one per parameter, applied by
  ``_foreach_`` kernels with tensor operands, so nothing is read back to the
  host and the step can be captured in a CUDA graph.

This module imports only torch and the qhoptim core.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import torch
from torch import Tensor
from torch.optim.optimizer import (
    Optimizer,
    ParamsT,
    _capturable_doc,
    _default_to_fused_or_foreach,
    _differentiable_doc,
    _foreach_doc,
    _foreach_supported_types,
    _get_scalar_dtype,
    _get_value,
    _maximize_doc,
    _params_doc,
    _to_scalar,
    _use_grad_for_differentiable,
    _view_as_real,
    required,
)

from qhoptim import rules, validation

__all__ = ["QHM", "QHAdam", "QHAdamW", "qhadam", "qhm"]

_WEIGHT_DECAY_TYPES = ("grad", "direct")
_TORCH_FLAGS = {"maximize": False, "foreach": None, "capturable": False, "differentiable": False}


# --------------------------------------------------------------------- helpers
# torch's own helpers, untyped there: the dtype of step counters, and a step's
# value (a float, or the tensor itself under torch.compile / capturable).
_scalar_dtype: Callable[[], torch.dtype] = _get_scalar_dtype
_value_of: Callable[[Tensor], Any] = _get_value


def _lr_value(lr: Any) -> Any:
    """The value of ``lr`` to validate: a 1-element tensor is read once, here, never in ``step``."""
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError(f"Tensor lr must be 1-element; received a tensor of shape {lr.shape}")
        return float(lr.detach())
    if lr is required:
        return 0.0  # torch's add_param_group reports the missing lr, after these checks
    return lr


def _numbers_only(hparams: dict[str, Any]) -> None:
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


def _at_precision(step: Tensor, param: Tensor) -> Tensor:
    """Step counts (float32 tensors) at ``param``'s precision, for its bias corrections."""
    return step.to(torch.promote_types(step.dtype, param.real.dtype))


def _abs_sq(x: Tensor) -> Tensor:
    """``|x|**2`` (real, without a square root): ``x * x`` for real tensors."""
    return torch.real(x * x.conj()) if x.is_complex() else x * x


def _needs_formula(lr: Any, capturable: bool, differentiable: bool) -> bool:
    """Whether a coefficient may be a tensor, so in-place kernels with scalars cannot be used."""
    return differentiable or capturable or isinstance(lr, Tensor) or torch.compiler.is_compiling()


def _formula_step(
    param: Tensor,
    grad: Tensor,
    update: Callable[[Tensor], Tensor],
    *,
    lr: float | Tensor,
    weight_decay: float,
    decoupled_weight_decay: bool,
    differentiable: bool,
) -> None:
    """One out-of-place step of the rules: ``update(grad)`` writes the state, returns the update."""
    theta = param.clone() if differentiable else param  # autograd may save it; param is overwritten
    decay: Any = 1
    if weight_decay != 0:
        grad, decay = rules.weight_decay_terms(
            grad, theta, lr=lr, weight_decay=weight_decay, decoupled=decoupled_weight_decay
        )
    param.copy_(rules.apply_update(theta, update(grad), lr, decay))


def _qhm_formula(grad: Tensor, *, buf: Tensor, momentum: float, nu: float) -> Tensor:
    new_buf, direction = rules.qhm_update(grad, buf, momentum=momentum, nu=nu)
    buf.copy_(new_buf)
    return cast(Tensor, direction)


def _qhadam_formula(grad: Tensor, *, exp_avg: Tensor, exp_avg_sq: Tensor, **kwargs: Any) -> Tensor:
    new_exp_avg, new_exp_avg_sq, update = rules.qhadam_update(
        grad, exp_avg, exp_avg_sq, sqrt=torch.sqrt, square=_abs_sq, **kwargs
    )
    exp_avg.copy_(new_exp_avg)
    exp_avg_sq.copy_(new_exp_avg_sq)
    return cast(Tensor, update)


def _default_foreach(params: list[Tensor], differentiable: bool) -> bool:
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
    """
    _, foreach = _default_to_fused_or_foreach(params, differentiable, use_fused=False)
    if foreach or differentiable:
        return foreach
    return all(type(p) in _foreach_supported_types and p.device.type == "cpu" for p in params)


def _cast_complex_state(param: Tensor, state: dict[str, Any]) -> None:
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


def _check_param_state(
    what: str, key: Any, param: Tensor, p_state: Any, allowed: tuple[frozenset[str], ...]
) -> None:
    """One parameter's saved state: the optimizer's keys, tensors that fit the parameter."""
    if not isinstance(p_state, dict):
        raise TypeError(
            f"{what}: the state of parameter {key!r} is a {type(p_state).__name__}, not a dict"
        )
    keys = frozenset(p_state)
    if keys not in allowed:
        want = " or ".join(str(sorted(a)) for a in allowed if a)
        raise ValueError(
            f"{what}: the state of parameter {key!r} has keys {sorted(keys)}, expected {want}; "
            "is this the state dict of another optimizer?"
        )
    for name, value in p_state.items():
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
        if value.shape != param.shape:
            raise ValueError(
                f"{what}: {name} of parameter {key!r} has shape {tuple(value.shape)}, "
                f"the parameter {tuple(param.shape)}"
            )
        complex_ok = param.is_complex() and name != "exp_avg_sq"  # |g|^2 is real
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
# unchunked and 22 ms in the loop; on 500 x 1,000 elements 2**16 to 2**17 are best.
_CPU_CHUNK_NUMEL = 1 << 17


def _chunks(tensors: list[Tensor]) -> list[slice]:
    """Consecutive runs of whole tensors of at most ``_CPU_CHUNK_NUMEL`` elements on CPU."""
    if not tensors or not tensors[0].is_cpu or torch.compiler.is_compiling():
        return [slice(0, len(tensors))]
    chunks, start, total = [], 0, 0
    for i, t in enumerate(tensors):
        n = t.numel()
        if total and total + n > _CPU_CHUNK_NUMEL:
            chunks.append(slice(start, i))
            start, total = i, 0
        total += n
    chunks.append(slice(start, len(tensors)))
    return chunks


def _foreach_decay_grads(
    params: list[Tensor],
    grads: list[Tensor],
    *,
    lr: float | Tensor,
    weight_decay: float,
    decoupled: bool,
    maximize: bool,
) -> list[Tensor]:
    """The multi-tensor paths' gradients after ``maximize`` and weight decay.

    Decoupled decay scales ``params`` in place (``rules.decoupled_decay_factor``,
    a tensor for a tensor ``lr``); coupled decay adds ``weight_decay * param`` to
    the gradients. The given gradients are never written to.
    """
    if maximize:
        grads = cast(list[Tensor], torch._foreach_neg(grads))
    if weight_decay != 0:
        if decoupled:
            torch._foreach_mul_(params, rules.decoupled_decay_factor(lr, weight_decay))
        elif maximize:  # reuse the negated copy
            torch._foreach_add_(grads, params, alpha=weight_decay)
        else:
            grads = cast(list[Tensor], torch._foreach_add(grads, params, alpha=weight_decay))
    return grads


def _on_device_kernels(capturable: bool, differentiable: bool) -> bool:
    """Whether a capturable multi-tensor step keeps its coefficients on the device.

    ``capturable=True`` must not read anything back to the host (a CUDA graph
    replays the step with new gradients and a new tensor ``lr``), so the
    coefficients become tensors and the kernels take them as tensor operands.
    Differentiable steps and ``torch.compile`` take the out-of-place formula
    path instead (autograd; the compiler fuses it).
    """
    return capturable and not differentiable and not torch.compiler.is_compiling()


def _foreach_sub_scaled(params: list[Tensor], updates: list[Tensor], lr: float | Tensor) -> None:
    """``param -= lr * update`` for every pair; ``updates`` are overwritten for a tensor ``lr``."""
    if isinstance(lr, Tensor):
        torch._foreach_mul_(updates, lr)
        torch._foreach_sub_(params, updates)
    else:
        torch._foreach_add_(params, updates, alpha=-lr)


def _sparse_error(optimizer: str) -> RuntimeError:
    return RuntimeError(f"{optimizer} does not support sparse gradients")


class _QHOptimizer(Optimizer):
    """Plumbing shared by QHM and QHAdam: flags of older state dicts, gathering
    the parameters that have a gradient, and ``step`` over the param groups."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            # Older state dicts (qhoptim 1.1.0's included) lack torch's flags.
            for flag, default in _TORCH_FLAGS.items():
                group.setdefault(flag, default)
            self._upgrade_group(group)

    def _upgrade_group(self, group: dict[str, Any]) -> None:
        """Fill in what an older state dict lacks in ``group`` and its state."""
        raise NotImplementedError

    # What a state dict of this optimizer holds: the hyperparameters every param
    # group must have, and the sets of keys a parameter's state may have (the
    # empty set: not stepped yet).
    _GROUP_KEYS: tuple[str, ...] = ()
    _STATE_KEYS: tuple[frozenset[str], ...] = ()

    def _check_group(self, group: dict[str, Any]) -> None:
        """Validate a param group's hyperparameters (``validation``'s checks)."""
        raise NotImplementedError

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._check_group({**self.defaults, **param_group})
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
        for key, p_state in state_dict["state"].items():
            if key not in params:
                raise ValueError(
                    f"{what}: the state dict has state for parameter {key!r}, "
                    "which none of its param groups lists"
                )
            _check_param_state(what, key, params[key], p_state, self._STATE_KEYS)

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
                raise _sparse_error(type(self).__name__)
            has_complex |= torch.is_complex(p)
            params.append(p)
            grads.append(p.grad)
            states.append(self.state[p])
        return states, has_complex

    def _step_group(self, group: dict[str, Any]) -> None:
        raise NotImplementedError

    @_use_grad_for_differentiable
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


# ------------------------------------------------------------------------- QHM
class QHM(_QHOptimizer):
    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = required,  # type: ignore[assignment]
        momentum: float = 0.999,
        nu: float = 0.7,
        weight_decay: float = 0.0,
        weight_decay_type: str = "grad",
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
    ) -> None:
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "nu": nu,
            "weight_decay": weight_decay,
            "weight_decay_type": weight_decay_type,
            "maximize": maximize,
            "foreach": foreach,
            "capturable": capturable,
            "differentiable": differentiable,
        }
        super().__init__(params, defaults)

    _GROUP_KEYS = ("lr", "momentum", "nu", "weight_decay")
    _STATE_KEYS = (frozenset(), frozenset({"momentum_buffer"}))

    def _check_group(self, group: dict[str, Any]) -> None:
        hparams = {k: group[k] for k in ("momentum", "nu", "weight_decay")}
        _numbers_only(hparams)
        validation.check_qhm(lr=_lr_value(group["lr"]), **hparams)
        weight_decay_type = group.get("weight_decay_type", "grad")  # absent in qhoptim 1.1.0
        if weight_decay_type not in _WEIGHT_DECAY_TYPES:
            raise ValueError(
                "weight_decay_type must be 'grad' or 'direct'; "
                f"received weight_decay_type={weight_decay_type!r}"
            )

    def _upgrade_group(self, group: dict[str, Any]) -> None:
        # qhoptim 1.1.0 groups lack the torch flags; its state is the same.
        group.setdefault("weight_decay_type", "grad")
        for p in group["params"]:
            _cast_complex_state(p, self.state.get(p, {}))

    def _init_group(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        momentum_buffers: list[Tensor],
    ) -> bool:
        states, has_complex = self._gather(group, params, grads)
        for p, state in zip(params, states, strict=True):
            if len(state) == 0:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            momentum_buffers.append(state["momentum_buffer"])
        return has_complex

    def _step_group(self, group: dict[str, Any]) -> None:
        params: list[Tensor] = []
        grads: list[Tensor] = []
        momentum_buffers: list[Tensor] = []
        has_complex = self._init_group(group, params, grads, momentum_buffers)
        qhm(
            params,
            grads,
            momentum_buffers,
            foreach=group["foreach"],
            capturable=group["capturable"],
            differentiable=group["differentiable"],
            has_complex=has_complex,
            lr=group["lr"],
            momentum=group["momentum"],
            nu=group["nu"],
            weight_decay=group["weight_decay"],
            decoupled_weight_decay=group["weight_decay_type"] == "direct",
            maximize=group["maximize"],
        )

    # -- conversions (qhoptim.convert); each returns constructor kwargs -------
    @classmethod
    def from_sgd(cls, lr: float) -> dict[str, float]:
        """Plain SGD; see :func:`qhoptim.convert.from_sgd`."""
        from qhoptim import convert

        return convert.from_sgd(lr).as_kwargs()

    @classmethod
    def from_momentum(cls, lr: float, momentum: float) -> dict[str, float]:
        """``torch.optim.SGD(lr, momentum)``; see :func:`qhoptim.convert.from_momentum`."""
        from qhoptim import convert

        return convert.from_momentum(lr, momentum).as_kwargs()

    @classmethod
    def from_nesterov(cls, lr: float, momentum: float) -> dict[str, float]:
        """``SGD(lr, momentum, nesterov=True)``; see :func:`qhoptim.convert.from_nesterov`."""
        from qhoptim import convert

        return convert.from_nesterov(lr, momentum).as_kwargs()

    @classmethod
    def from_pid(
        cls, k_p: float, k_i: float, k_d: float, *, beta: float | None = None
    ) -> dict[str, float]:
        """Recht's PID optimizer; see :func:`qhoptim.convert.from_pid`."""
        from qhoptim import convert

        return convert.from_pid(k_p, k_i, k_d, beta=beta).as_kwargs()

    @classmethod
    def from_an_pid(cls, r: float, k_d: float, beta: float) -> dict[str, float]:
        """The PID optimizer of An et al. (2018); see :func:`qhoptim.convert.from_an_pid`."""
        from qhoptim import convert

        return convert.from_an_pid(r, k_d, beta).as_kwargs()

    @classmethod
    def from_synthesized_nesterov(
        cls, alpha: float, beta1: float, beta2: float
    ) -> dict[str, float]:
        """Synthesized Nesterov variants; see :func:`qhoptim.convert.from_synthesized_nesterov`."""
        from qhoptim import convert

        return convert.from_synthesized_nesterov(alpha, beta1, beta2).as_kwargs()

    @classmethod
    def from_robust_momentum(
        cls,
        l: float,  # noqa: E741 (the paper's name)
        kappa: float,
        rho: float | None = None,
    ) -> dict[str, float]:
        """Robust Momentum (Triple Momentum if ``rho`` is None).

        See :func:`qhoptim.convert.from_robust_momentum`.
        """
        from qhoptim import convert

        return convert.from_robust_momentum(l, kappa, rho).as_kwargs()

    @classmethod
    def from_triple_momentum(cls, l: float, kappa: float) -> dict[str, float]:  # noqa: E741
        """Triple Momentum; see :func:`qhoptim.convert.from_triple_momentum`."""
        from qhoptim import convert

        return convert.from_triple_momentum(l, kappa).as_kwargs()

    @classmethod
    def from_accsgd(
        cls, delta: float, kappa: float, xi: float, eps: float = 0.7
    ) -> dict[str, float]:
        """AccSGD (Kidambi et al., 2018); see :func:`qhoptim.convert.from_accsgd`."""
        from qhoptim import convert

        return convert.from_accsgd(delta, kappa, xi, eps).as_kwargs()

    @classmethod
    def from_two_state_optimizer(
        cls,
        h: float,
        k: float,
        l: float,  # noqa: E741 (the paper's name)
        m: float,
        q: float,
        z: float,
    ) -> dict[str, float]:
        """A two-state optimizer (TSO); see :func:`qhoptim.convert.from_two_state_optimizer`.

        QHM reproduces the TSO only from the initial momentum buffer given by
        :func:`qhoptim.convert.two_state_initial_buffer` (write it into
        ``optimizer.state[p]["momentum_buffer"]`` before the first step).
        """
        from qhoptim import convert

        return convert.from_two_state_optimizer(h, k, l, m, q, z).as_kwargs()


QHM.__doc__ = rf"""Quasi-hyperbolic momentum (QHM) of `Ma and Yarats (2019)`_.

    .. math::
        g_{{t+1}} &\leftarrow \beta g_t + (1 - \beta) \nabla_t \\
        \theta_{{t+1}} &\leftarrow \theta_t - \alpha \left[(1 - \nu) \nabla_t + \nu g_{{t+1}}\right]

    :math:`g` is a *normalized* (dampened) momentum buffer started at zero.
    :math:`\nu = 0` is SGD, :math:`\nu = 1` momentum, :math:`\nu = \beta`
    Nesterov's accelerated gradient. The paper's rule of thumb is
    :math:`\nu = 0.7, \beta = 0.999` (the defaults); plain momentum
    ``SGD(lr, momentum)`` converts to ``QHM(lr=lr / (1 - momentum), momentum, nu=1)``
    (see :meth:`from_momentum` and :meth:`from_nesterov`).

    A drop-in superset of ``qhoptim.pyt.QHM`` of qhoptim 1.1.0: same positional
    arguments, same meaning, same state (checkpoints load unchanged).

    Args:
        {_params_doc}
        lr (float, Tensor): learning rate :math:`\alpha` (required, as in 1.1.0,
            unless every param group sets its own). A tensor must have one element.
        momentum (float, optional): :math:`\beta`, in [0, 1) (default: 0.999)
        nu (float, optional): immediate discount factor :math:`\nu`, any finite
            real (default: 0.7)
        weight_decay (float, optional): weight decay :math:`\lambda` (default: 0)
        weight_decay_type (str, optional): ``"grad"`` adds :math:`\lambda\theta`
            to the gradient (L2, as ``torch.optim.SGD``; ``p.grad`` is not
            modified); ``"direct"`` multiplies :math:`\theta` by
            :math:`1 - \alpha\lambda` before the step (decoupled). (default: ``"grad"``)
        {_maximize_doc}
        {_foreach_doc}
            Here the default also picks foreach on CPU, where it was measured faster.
        {_capturable_doc}
            QHM keeps no step counter, so with float hyperparameters it is always
            capturable; ``capturable=True`` also takes a tensor ``lr`` on the
            device (the loop through :func:`qhoptim.rules.qhm_update`, foreach
            with the tensor as a kernel operand).
        {_differentiable_doc}

    Example:
        >>> optimizer = QHM(model.parameters(), lr=1.0, momentum=0.999, nu=0.7)
        >>> optimizer.zero_grad()
        >>> loss_fn(model(input), target).backward()
        >>> optimizer.step()

    .. _Ma and Yarats (2019): https://arxiv.org/abs/1810.06801
    """


def _single_tensor_qhm(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    *,
    lr: float | Tensor,
    momentum: float,
    nu: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    maximize: bool,
    capturable: bool,
    differentiable: bool,
    has_complex: bool,
) -> None:
    lr = _to_scalar(lr)
    c = rules.qhm_coefficients(momentum, nu)
    formula = _needs_formula(lr, capturable, differentiable)

    for param, grad, buf in zip(params, grads, momentum_buffers, strict=True):
        grad = grad if not maximize else torch.neg(grad)

        if formula:
            _formula_step(
                param,
                grad,
                functools.partial(_qhm_formula, buf=buf, momentum=momentum, nu=nu),
                lr=lr,
                weight_decay=weight_decay,
                decoupled_weight_decay=decoupled_weight_decay,
                differentiable=differentiable,
            )
            continue

        if torch.is_complex(param):
            param, grad, buf = (torch.view_as_real(t) for t in (param, grad, buf))
        if weight_decay != 0:
            if decoupled_weight_decay:
                param.mul_(rules.decoupled_decay_factor(lr, weight_decay))
            else:
                grad = grad.add(param, alpha=weight_decay)
        buf.lerp_(grad, c.grad_to_buffer)
        if c.buffer_weight != 0:
            param.add_(buf, alpha=-lr * c.buffer_weight)
        if c.grad_weight != 0:
            param.add_(grad, alpha=-lr * c.grad_weight)


def _multi_tensor_qhm(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    *,
    lr: float | Tensor,
    momentum: float,
    nu: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    maximize: bool,
    capturable: bool,
    differentiable: bool,
    has_complex: bool,
) -> None:
    if len(params) == 0:
        return
    lr = _to_scalar(lr)
    on_device = _on_device_kernels(capturable, differentiable)
    if _needs_formula(lr, capturable, differentiable) and not on_device:
        _single_tensor_qhm(
            params,
            grads,
            momentum_buffers,
            lr=lr,
            momentum=momentum,
            nu=nu,
            weight_decay=weight_decay,
            decoupled_weight_decay=decoupled_weight_decay,
            maximize=maximize,
            capturable=capturable,
            differentiable=differentiable,
            has_complex=has_complex,
        )
        return
    c = rules.qhm_coefficients(momentum, nu)
    grouped = Optimizer._group_tensors_by_device_and_dtype([params, grads, momentum_buffers])  # type: ignore[list-item]
    for (device_params_, device_grads_, device_bufs_), _ in grouped.values():
        device_params = cast(list[Tensor], device_params_)
        device_grads = cast(list[Tensor], device_grads_)
        device_bufs = cast(list[Tensor], device_bufs_)
        if has_complex:
            _view_as_real(device_params, device_grads, device_bufs)
        for chunk in _chunks(device_params):
            ps, gs, bufs = device_params[chunk], device_grads[chunk], device_bufs[chunk]
            gs = _foreach_decay_grads(
                ps,
                gs,
                lr=lr,
                weight_decay=weight_decay,
                decoupled=decoupled_weight_decay,
                maximize=maximize,
            )
            torch._foreach_lerp_(bufs, gs, c.grad_to_buffer)
            if isinstance(lr, Tensor):  # capturable: ``lr`` stays on the device
                direction = cast(list[Tensor], torch._foreach_mul(bufs, c.buffer_weight))
                torch._foreach_add_(direction, gs, alpha=c.grad_weight)
                _foreach_sub_scaled(ps, direction, lr)
                continue
            if c.buffer_weight != 0:
                torch._foreach_add_(ps, bufs, alpha=-lr * c.buffer_weight)
            if c.grad_weight != 0:
                torch._foreach_add_(ps, gs, alpha=-lr * c.grad_weight)


def qhm(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    foreach: bool | None = None,
    capturable: bool = False,
    differentiable: bool = False,
    has_complex: bool = False,
    *,
    lr: float | Tensor,
    momentum: float,
    nu: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    maximize: bool,
) -> None:
    r"""Functional API that performs the QHM computation in place.

    See :class:`QHM` for details. ``momentum_buffers`` are the normalized
    buffers (zeros before the first step).
    """
    if foreach is None:
        foreach = _default_foreach(params, differentiable)
    func = _multi_tensor_qhm if foreach else _single_tensor_qhm
    func(
        params,
        grads,
        momentum_buffers,
        lr=lr,
        momentum=momentum,
        nu=nu,
        weight_decay=weight_decay,
        decoupled_weight_decay=decoupled_weight_decay,
        maximize=maximize,
        capturable=capturable,
        differentiable=differentiable,
        has_complex=has_complex,
    )


# ---------------------------------------------------------------------- QHAdam
class QHAdam(_QHOptimizer):
    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        nus: tuple[float, float] = (1.0, 1.0),
        weight_decay: float = 0.0,
        decouple_weight_decay: bool = False,
        eps: float = 1e-8,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
    ) -> None:
        defaults = {
            "lr": lr,
            "betas": betas,
            "nus": nus,
            "weight_decay": weight_decay,
            "decouple_weight_decay": decouple_weight_decay,
            "eps": eps,
            "maximize": maximize,
            "foreach": foreach,
            "capturable": capturable,
            "differentiable": differentiable,
        }
        super().__init__(params, defaults)

    _GROUP_KEYS = ("lr", "betas", "nus", "weight_decay", "eps")
    _STATE_KEYS = (
        frozenset(),
        frozenset({"step", "exp_avg", "exp_avg_sq"}),
        frozenset({"beta1_weight", "beta2_weight", "exp_avg", "exp_avg_sq"}),  # qhoptim 1.1.0
    )

    def _check_group(self, group: dict[str, Any]) -> None:
        beta1, beta2 = validation.check_pair(group["betas"], "betas")
        nu1, nu2 = validation.check_pair(group["nus"], "nus")
        _numbers_only(
            {
                "betas[0]": beta1,
                "betas[1]": beta2,
                "nus[0]": nu1,
                "nus[1]": nu2,
                "eps": group["eps"],
                "weight_decay": group["weight_decay"],
            }
        )
        validation.check_qhadam(
            lr=_lr_value(group["lr"]),
            beta1=beta1,
            beta2=beta2,
            nu1=nu1,
            nu2=nu2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            names={"beta1": "betas[0]", "beta2": "betas[1]", "nu1": "nus[0]", "nu2": "nus[1]"},
        )

    def _upgrade_group(self, group: dict[str, Any]) -> None:
        group.setdefault("decouple_weight_decay", False)
        for p in group["params"]:
            p_state = self.state.get(p, {})
            if len(p_state) == 0:
                continue
            _cast_complex_state(p, p_state)
            if "beta1_weight" in p_state:
                _from_qhoptim_1_1(p_state, group["betas"])
            if not torch.is_tensor(p_state["step"]):
                step = float(p_state["step"])
                p_state["step"] = (
                    torch.tensor(step, dtype=_scalar_dtype(), device=p.device)
                    if group["capturable"]
                    else torch.tensor(step, dtype=_scalar_dtype())
                )

    def _init_group(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        exp_avgs: list[Tensor],
        exp_avg_sqs: list[Tensor],
        state_steps: list[Tensor],
    ) -> bool:
        states, has_complex = self._gather(group, params, grads)
        for p, state in zip(params, states, strict=True):
            if len(state) == 0:
                # As torch's Adam: the step count lives on the CPU unless capturable.
                state["step"] = (
                    torch.zeros((), dtype=_scalar_dtype(), device=p.device)
                    if group["capturable"]
                    else torch.tensor(0.0, dtype=_scalar_dtype())
                )
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                # |g|^2 is real: a complex parameter has a real second moment.
                state["exp_avg_sq"] = torch.zeros_like(
                    p, dtype=p.real.dtype, memory_format=torch.preserve_format
                )
            if group["differentiable"] and state["step"].requires_grad:
                raise RuntimeError(
                    "`requires_grad` is not supported for `step` in differentiable mode"
                )
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            state_steps.append(state["step"])
        return has_complex

    def _step_group(self, group: dict[str, Any]) -> None:
        params: list[Tensor] = []
        grads: list[Tensor] = []
        exp_avgs: list[Tensor] = []
        exp_avg_sqs: list[Tensor] = []
        state_steps: list[Tensor] = []
        has_complex = self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, state_steps)
        beta1, beta2 = group["betas"]
        nu1, nu2 = group["nus"]
        qhadam(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            state_steps,
            foreach=group["foreach"],
            capturable=group["capturable"],
            differentiable=group["differentiable"],
            has_complex=has_complex,
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            nu1=nu1,
            nu2=nu2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            decoupled_weight_decay=group["decouple_weight_decay"],
            maximize=group["maximize"],
        )

    # -- conversions (qhoptim.convert); each returns constructor kwargs -------
    # ``eps`` is returned only when given, so that ``QHAdam(params, eps=...,
    # **QHAdam.from_nadam(...))`` keeps working as in qhoptim 1.1.0.
    @staticmethod
    def _kwargs(params: Any, eps: float | None) -> dict[str, Any]:
        kwargs = dict(params.as_kwargs())
        if eps is None:
            del kwargs["eps"]
        return kwargs

    @classmethod
    def from_adam(
        cls, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float | None = None
    ) -> dict[str, Any]:
        """Adam (exact); see :func:`qhoptim.convert.from_adam`."""
        from qhoptim import convert

        return cls._kwargs(convert.from_adam(lr, betas, 1e-8 if eps is None else eps), eps)

    @classmethod
    def from_nadam(
        cls, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float | None = None
    ) -> dict[str, Any]:
        """NAdam, modulo bias correction; see :func:`qhoptim.convert.from_nadam`."""
        from qhoptim import convert

        return cls._kwargs(convert.from_nadam(lr, betas, 1e-8 if eps is None else eps), eps)

    @classmethod
    def from_rmsprop(
        cls, lr: float = 1e-2, alpha: float = 0.99, eps: float | None = None
    ) -> dict[str, Any]:
        """``RMSprop``, modulo bias correction; see :func:`qhoptim.convert.from_rmsprop`."""
        from qhoptim import convert

        return cls._kwargs(convert.from_rmsprop(lr, alpha, 1e-8 if eps is None else eps), eps)


_QHADAM_MATH = r"""
    .. math::
        g_{t+1} &\leftarrow \beta_1 g_t + (1 - \beta_1) \nabla_t, \qquad
        s_{t+1} \leftarrow \beta_2 s_t + (1 - \beta_2) |\nabla_t|^2 \\
        \theta_{t+1} &\leftarrow \theta_t - \alpha \,
            \frac{(1 - \nu_1) \nabla_t + \nu_1 g_{t+1} / (1 - \beta_1^{t+1})}
                 {\sqrt{(1 - \nu_2) |\nabla_t|^2 + \nu_2 s_{t+1} / (1 - \beta_2^{t+1})} + \epsilon}

    :math:`\nu = (1, 1)` is Adam (the default), :math:`\nu_1 = \beta_1` NAdam and
    :math:`\nu_1 = 0` RMSProp (both modulo bias correction). The paper's "QH
    default" is :math:`\nu_1 = 0.7, \beta_1 = 0.999` with :math:`\nu_2 = 1` and
    :math:`\beta_2` unchanged (0.999), at :math:`\alpha = 10^{-3}`.
    For complex parameters the second moment is :math:`|\nabla|^2` (real).
"""


def _qhadam_args_doc(weight_decay: str) -> str:
    return rf"""
        {_params_doc}
        lr (float, Tensor, optional): learning rate :math:`\alpha` (default: 1e-3)
        betas (tuple[float, float], optional): :math:`(\beta_1, \beta_2)`, each in
            [0, 1) (default: (0.9, 0.999))
        nus (tuple[float, float], optional): :math:`(\nu_1, \nu_2)`; :math:`\nu_1`
            any finite real, :math:`\nu_2` in [0, 1] (default: (1.0, 1.0))
        weight_decay (float, optional): weight decay :math:`\lambda` (default: {weight_decay})"""


_QHADAM_FLAGS_DOC = rf"""
        eps (float, optional): added to the denominator after the square root
            (default: 1e-8)
        {_maximize_doc}
        {_foreach_doc}
            Here the default also picks foreach on CPU, where it was measured faster.
        {_capturable_doc}
        {_differentiable_doc}
"""

QHAdam.__doc__ = (
    "QHAdam of `Ma and Yarats (2019)`_.\n"
    + _QHADAM_MATH
    + """
    A drop-in superset of ``qhoptim.pyt.QHAdam`` of qhoptim 1.1.0 (same
    positional arguments and meaning; 1.1.0 checkpoints are converted on load).

    Args:"""
    + _qhadam_args_doc("0")
    + r"""
        decouple_weight_decay (bool, optional): ``False`` adds :math:`\lambda\theta`
            to the gradient (L2); ``True`` multiplies :math:`\theta` by
            :math:`1 - \alpha\lambda` before the step, as AdamW (default: False)"""
    + _QHADAM_FLAGS_DOC
    + """
    Example:
        >>> optimizer = QHAdam(model.parameters(), lr=1e-3, nus=(0.7, 1.0), betas=(0.995, 0.999))
        >>> optimizer.zero_grad()
        >>> loss_fn(model(input), target).backward()
        >>> optimizer.step()

    .. _Ma and Yarats (2019): https://arxiv.org/abs/1810.06801
    """
)


class QHAdamW(QHAdam):
    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        nus: tuple[float, float] = (1.0, 1.0),
        weight_decay: float = 1e-2,
        eps: float = 1e-8,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
    ) -> None:
        super().__init__(
            params,
            lr,
            betas,
            nus,
            weight_decay,
            True,
            eps,
            maximize=maximize,
            foreach=foreach,
            capturable=capturable,
            differentiable=differentiable,
        )


QHAdamW.__doc__ = (
    r"""QHAdam with decoupled weight decay, as AdamW (`Loshchilov and Hutter, 2019`_).

    ``QHAdamW(params, ...)`` is ``QHAdam(params, ..., decouple_weight_decay=True)``
    with torch's ``AdamW`` default ``weight_decay=1e-2``: :math:`\theta` is
    multiplied by :math:`1 - \alpha\lambda` before each step. (qhoptim 1.1.0's
    ``QHAdamW`` was a function defaulting to ``weight_decay=0``.)
"""
    + _QHADAM_MATH
    + """
    Args:"""
    + _qhadam_args_doc("1e-2")
    + _QHADAM_FLAGS_DOC
    + """
    .. _Loshchilov and Hutter, 2019: https://arxiv.org/abs/1711.05101
    """
)


def _from_qhoptim_1_1(p_state: dict[str, Any], betas: Sequence[float]) -> None:
    """Convert qhoptim 1.1.0's QHAdam state to this module's, in place.

    1.1.0 keeps ``beta_weight = sum_{i<t} beta**i`` (Python floats) and moments
    that are already bias-corrected: ``exp_avg = g_t / (1 - beta1**t)``. The
    step ``t`` is recovered from the larger beta (``beta**t = 1 - (1 - beta) *
    beta_weight``). Once ``beta**t`` is below float64 resolution the recovered
    ``t`` may be off, but then every bias correction is 1 to that resolution;
    with both betas 0 any ``t`` gives bias corrections of 1, and ``t = 1``.
    """
    weights = (float(p_state.pop("beta1_weight")), float(p_state.pop("beta2_weight")))
    beta, weight = max(zip((float(b) for b in betas), weights, strict=True))
    t = 1
    if beta > 0.0:
        power = max(1.0 - (1.0 - beta) * weight, 2.0**-53)  # beta**t
        t = max(1, round(math.log(power) / math.log(beta)))
    for key, b in (("exp_avg", betas[0]), ("exp_avg_sq", betas[1])):
        p_state[key] = p_state[key] * rules.bias_correction(float(b), t)
    p_state["step"] = float(t)


class _FastQHAdam(NamedTuple):
    """QHAdam's coefficients folded for in-place kernels (all Python floats).

    The update ``-lr * (gw*g + ew*m) / (sqrt(gsw*|g|^2 + esw*s) + eps)`` of
    :func:`qhoptim.rules.qhadam_update` (weights from
    :func:`~qhoptim.rules.qhadam_coefficients`) is applied as
    ``param += exp_avg_value * m / d + grad_value * g / d`` with
    ``d = sqrt(s + den_ratio*|g|^2) + den_eps``: the common factor ``sqrt(esw)``
    moves out of the square root into the two values. A zero weight skips its
    pass, and ``nu2`` in {0, 1} reads ``|g|`` or ``s`` alone. When ``esw`` is
    tiny next to ``gsw`` (``nu2`` near 0, e.g. subnormal), ``gsw / esw`` would
    overflow: then ``d = sqrt(|g|^2 + den_ratio*s) + den_eps`` with the factor
    ``sqrt(gsw)`` taken out instead ("mix_grad").
    """

    den: str  # "exp_avg_sq" | "grad" | "mix" | "mix_grad"
    den_ratio: float
    den_eps: float
    exp_avg_value: float
    grad_value: float


# Largest ``gsw / esw`` folded as ``s + ratio*|g|^2``: ``ratio*|g|^2`` overflows
# only for gradients whose square overflows anyway.
_MAX_DEN_RATIO = 2.0**64


def _fold(c: rules.QHAdamCoefficients, lr: float, eps: float) -> _FastQHAdam:
    if c.exp_avg_sq_weight == 0:
        den, den_ratio, den_scale = "grad", 0.0, math.sqrt(c.grad_sq_weight)
    elif c.grad_sq_weight == 0:
        den, den_ratio, den_scale = "exp_avg_sq", 0.0, math.sqrt(c.exp_avg_sq_weight)
    elif c.grad_sq_weight <= _MAX_DEN_RATIO * c.exp_avg_sq_weight:
        den, den_ratio = "mix", c.grad_sq_weight / c.exp_avg_sq_weight
        den_scale = math.sqrt(c.exp_avg_sq_weight)
    else:
        den, den_ratio = "mix_grad", c.exp_avg_sq_weight / c.grad_sq_weight
        den_scale = math.sqrt(c.grad_sq_weight)
    return _FastQHAdam(
        den,
        den_ratio,
        eps / den_scale,
        -lr * c.exp_avg_weight / den_scale,
        -lr * c.grad_weight / den_scale,
    )


def _single_tensor_qhadam(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    state_steps: list[Tensor],
    *,
    lr: float | Tensor,
    beta1: float,
    beta2: float,
    nu1: float,
    nu2: float,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    maximize: bool,
    capturable: bool,
    differentiable: bool,
    has_complex: bool,
) -> None:
    lr = _to_scalar(lr)
    formula = _needs_formula(lr, capturable, differentiable)
    fast_lr = cast(float, lr)
    # Each moment is a QH average (paper, Sec. 5): its EWMA weights are QHM's.
    m1 = rules.qhm_coefficients(beta1, nu1)
    m2 = rules.qhm_coefficients(beta2, nu2)
    folded_step: float | None = None

    for i, param in enumerate(params):
        grad = grads[i] if not maximize else torch.neg(grads[i])
        exp_avg, exp_avg_sq, step_t = exp_avgs[i], exp_avg_sqs[i], state_steps[i]
        step_t += 1

        if formula:
            step = step_t if capturable else _value_of(step_t)
            if isinstance(step, Tensor):  # bias corrections at the parameter's precision
                step = _at_precision(step, param)
            update = functools.partial(
                _qhadam_formula,
                exp_avg=exp_avg,
                exp_avg_sq=exp_avg_sq,
                beta1=beta1,
                beta2=beta2,
                nu1=nu1,
                nu2=nu2,
                eps=eps,
                bias_correction1=rules.bias_correction(beta1, step),
                bias_correction2=rules.bias_correction(beta2, step),
            )
            _formula_step(
                param,
                grad,
                update,
                lr=lr,
                weight_decay=weight_decay,
                decoupled_weight_decay=decoupled_weight_decay,
                differentiable=differentiable,
            )
            continue

        if weight_decay != 0:
            if decoupled_weight_decay:
                param.mul_(rules.decoupled_decay_factor(fast_lr, weight_decay))
            else:
                grad = grad.add(param, alpha=weight_decay)
        step = _value_of(step_t)
        if step != folded_step:  # the parameters of a group usually share their step
            folded_step = step
            f = _fold(
                rules.qhadam_coefficients(
                    nu1, nu2, rules.bias_correction(beta1, step), rules.bias_correction(beta2, step)
                ),
                fast_lr,
                eps,
            )
        complex_param = torch.is_complex(param)
        if complex_param:
            # |g|^2 couples the real and imaginary parts: the second moment and
            # the denominator are real tensors of the parameter's shape.
            grad_sq = _abs_sq(grad)
            param, grad, exp_avg = (torch.view_as_real(t) for t in (param, grad, exp_avg))
            exp_avg_sq.mul_(m2.buffer_decay).add_(grad_sq, alpha=m2.grad_to_buffer)
        else:
            exp_avg_sq.mul_(m2.buffer_decay).addcmul_(grad, grad, value=m2.grad_to_buffer)
        exp_avg.lerp_(grad, m1.grad_to_buffer)

        if f.den == "exp_avg_sq":
            den = exp_avg_sq.sqrt()
        elif f.den == "grad":
            den = grad_sq.sqrt() if complex_param else grad.abs()
        elif f.den == "mix_grad":
            sq = grad_sq if complex_param else grad * grad
            den = sq.add_(exp_avg_sq, alpha=f.den_ratio).sqrt_()
        elif complex_param:
            den = torch.add(exp_avg_sq, grad_sq, alpha=f.den_ratio).sqrt_()
        else:
            den = torch.addcmul(exp_avg_sq, grad, grad, value=f.den_ratio).sqrt_()
        den.add_(f.den_eps)
        if complex_param:
            den = den.unsqueeze(-1)

        # Two in-place passes over ``param`` cost less than a temporary numerator.
        if f.exp_avg_value != 0:
            param.addcdiv_(exp_avg, den, value=f.exp_avg_value)
        if f.grad_value != 0:
            param.addcdiv_(grad, den, value=f.grad_value)


def _multi_tensor_qhadam(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    state_steps: list[Tensor],
    *,
    lr: float | Tensor,
    beta1: float,
    beta2: float,
    nu1: float,
    nu2: float,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    maximize: bool,
    capturable: bool,
    differentiable: bool,
    has_complex: bool,
) -> None:
    if len(params) == 0:
        return
    lr = _to_scalar(lr)
    kwargs: dict[str, Any] = {
        "beta1": beta1,
        "beta2": beta2,
        "nu1": nu1,
        "nu2": nu2,
        "eps": eps,
        "weight_decay": weight_decay,
        "decoupled_weight_decay": decoupled_weight_decay,
        "maximize": maximize,
        "capturable": capturable,
        "differentiable": differentiable,
    }
    on_device = _on_device_kernels(capturable, differentiable)
    if _needs_formula(lr, capturable, differentiable) and not on_device:
        _single_tensor_qhadam(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            state_steps,
            lr=lr,
            has_complex=has_complex,
            **kwargs,
        )
        return
    grouped = Optimizer._group_tensors_by_device_and_dtype(
        [params, grads, exp_avgs, exp_avg_sqs, state_steps]  # type: ignore[list-item]
    )
    for (_, dtype), ((p_, g_, m_, s_, t_), _) in grouped.items():
        device_params = cast(list[Tensor], p_)
        device_grads = cast(list[Tensor], g_)
        device_exp_avgs = cast(list[Tensor], m_)
        device_exp_avg_sqs = cast(list[Tensor], s_)
        device_steps = cast(list[Tensor], t_)
        if dtype is not None and dtype.is_complex:
            # The real second moment of a complex parameter does not share the
            # real view's shape; these take the per-tensor kernels.
            _single_tensor_qhadam(
                device_params,
                device_grads,
                device_exp_avgs,
                device_exp_avg_sqs,
                device_steps,
                lr=lr,
                has_complex=True,
                **kwargs,
            )
            continue

        if device_steps[0].is_cpu:
            torch._foreach_add_(device_steps, torch.tensor(1.0, device="cpu"), alpha=1.0)
        else:
            torch._foreach_add_(device_steps, 1)
        if on_device:
            _foreach_qhadam_group_on_device(
                device_params,
                device_grads,
                device_exp_avgs,
                device_exp_avg_sqs,
                device_steps,
                lr=lr,
                beta1=beta1,
                beta2=beta2,
                nu1=nu1,
                nu2=nu2,
                eps=eps,
                weight_decay=weight_decay,
                decoupled_weight_decay=decoupled_weight_decay,
                maximize=maximize,
            )
            continue
        _foreach_qhadam_group(
            device_params,
            device_grads,
            device_exp_avgs,
            device_exp_avg_sqs,
            [_value_of(t) for t in device_steps],
            lr=cast(float, lr),
            beta1=beta1,
            beta2=beta2,
            nu1=nu1,
            nu2=nu2,
            eps=eps,
            weight_decay=weight_decay,
            decoupled_weight_decay=decoupled_weight_decay,
            maximize=maximize,
        )


def _foreach_qhadam_group(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[float],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    nu1: float,
    nu2: float,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    maximize: bool,
) -> None:
    """QHAdam with multi-tensor kernels on real tensors of one device and dtype.

    ``steps[i]`` is parameter ``i``'s step number *after* this step (1 on the
    first). Also the step of ``qhoptim.keras`` on Keras's torch backend, where
    Keras keeps one step counter for all variables.
    """
    m1 = rules.qhm_coefficients(beta1, nu1)
    m2 = rules.qhm_coefficients(beta2, nu2)
    # The folded coefficients depend on the step, which differs between
    # parameters only if some missed steps (grad None).
    folds = {
        step: _fold(
            rules.qhadam_coefficients(
                nu1, nu2, rules.bias_correction(beta1, step), rules.bias_correction(beta2, step)
            ),
            lr,
            eps,
        )
        for step in set(steps)
    }
    for chunk in _chunks(params):
        ps, gs = params[chunk], grads[chunk]
        ms, ss = exp_avgs[chunk], exp_avg_sqs[chunk]
        gs = _foreach_decay_grads(
            ps,
            gs,
            lr=lr,
            weight_decay=weight_decay,
            decoupled=decoupled_weight_decay,
            maximize=maximize,
        )
        _foreach_qhadam_moments(ms, ss, gs, m1, m2)
        chunk_steps = steps[chunk]
        if len(folds) == 1:
            _apply_folded(folds[chunk_steps[0]], ps, gs, ms, ss)
            continue
        for step in set(chunk_steps):
            idx = [k for k, s in enumerate(chunk_steps) if s == step]
            _apply_folded(folds[step], *([lst[k] for k in idx] for lst in (ps, gs, ms, ss)))


def _foreach_qhadam_moments(
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    grads: list[Tensor],
    m1: rules.QHMCoefficients,
    m2: rules.QHMCoefficients,
) -> None:
    """Both moments' EWMAs in place.

    ``m <- lerp(m, g, 1 - beta1)`` and ``s <- beta2 * s + (1 - beta2) * g * g``.
    """
    torch._foreach_lerp_(exp_avgs, grads, m1.grad_to_buffer)
    torch._foreach_mul_(exp_avg_sqs, m2.buffer_decay)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, m2.grad_to_buffer)


def _foreach_qhadam_group_on_device(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    *,
    lr: float | Tensor,
    beta1: float,
    beta2: float,
    nu1: float,
    nu2: float,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    maximize: bool,
) -> None:
    """QHAdam with multi-tensor kernels on real tensors of one device and dtype, capturable.

    ``steps`` are the parameters' step counts on the device, already counting
    this step. The bias corrections and :func:`qhoptim.rules.qhadam_coefficients`
    are evaluated on them there, at the parameters' precision (one coefficient
    per parameter), and a tensor ``lr`` is used as a tensor: nothing is read
    back to the host, so the step can be captured in a CUDA graph.
    """
    t = _at_precision(torch.stack(steps), params[0])
    c = rules.qhadam_coefficients(
        nu1, nu2, rules.bias_correction(beta1, t), rules.bias_correction(beta2, t)
    )
    m1 = rules.qhm_coefficients(beta1, nu1)
    m2 = rules.qhm_coefficients(beta2, nu2)
    grads = _foreach_decay_grads(
        params,
        grads,
        lr=lr,
        weight_decay=weight_decay,
        decoupled=decoupled_weight_decay,
        maximize=maximize,
    )
    _foreach_qhadam_moments(exp_avgs, exp_avg_sqs, grads, m1, m2)
    # sqrt(grad_sq_weight * g^2 + exp_avg_sq_weight * s) + eps
    den = torch._foreach_mul(exp_avg_sqs, list(c.exp_avg_sq_weight.unbind()))
    torch._foreach_addcmul_(den, grads, grads, c.grad_sq_weight)
    torch._foreach_sqrt_(den)
    torch._foreach_add_(den, eps)
    # (grad_weight * g + exp_avg_weight * m) / den
    update = cast(list[Tensor], torch._foreach_mul(exp_avgs, list(c.exp_avg_weight.unbind())))
    torch._foreach_add_(update, grads, alpha=c.grad_weight)
    torch._foreach_div_(update, den)
    _foreach_sub_scaled(params, update, lr)


def _apply_folded(
    f: _FastQHAdam, ps: list[Tensor], gs: list[Tensor], ms: list[Tensor], ss: list[Tensor]
) -> None:
    """``param += exp_avg_value * m / d + grad_value * g / d`` with multi-tensor kernels."""
    if f.den == "exp_avg_sq":
        den = torch._foreach_sqrt(ss)
    elif f.den == "grad":
        den = torch._foreach_abs(gs)
    elif f.den == "mix_grad":
        den = torch._foreach_mul(gs, gs)
        torch._foreach_add_(den, ss, alpha=f.den_ratio)
        torch._foreach_sqrt_(den)
    else:
        den = torch._foreach_addcmul(ss, gs, gs, f.den_ratio)
        torch._foreach_sqrt_(den)
    torch._foreach_add_(den, f.den_eps)
    if f.exp_avg_value != 0:
        torch._foreach_addcdiv_(ps, ms, den, f.exp_avg_value)
    if f.grad_value != 0:
        torch._foreach_addcdiv_(ps, gs, den, f.grad_value)


def qhadam(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    state_steps: list[Tensor],
    foreach: bool | None = None,
    capturable: bool = False,
    differentiable: bool = False,
    has_complex: bool = False,
    *,
    lr: float | Tensor,
    beta1: float,
    beta2: float,
    nu1: float,
    nu2: float,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    maximize: bool,
) -> None:
    r"""Functional API that performs the QHAdam computation in place.

    See :class:`QHAdam` for details. ``exp_avgs`` and ``exp_avg_sqs`` are the
    bias-*un*corrected moments (zeros before the first step; ``exp_avg_sqs``
    real even for complex parameters); ``state_steps`` are 0-d tensors that
    count the steps taken, incremented here.
    """
    if not torch.compiler.is_compiling() and not all(isinstance(t, Tensor) for t in state_steps):
        raise RuntimeError("`state_steps` must be a list of singleton tensors")
    if foreach is None:
        foreach = _default_foreach(params, differentiable)
    func = _multi_tensor_qhadam if foreach else _single_tensor_qhadam
    func(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        state_steps,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        nu1=nu1,
        nu2=nu2,
        eps=eps,
        weight_decay=weight_decay,
        decoupled_weight_decay=decoupled_weight_decay,
        maximize=maximize,
        capturable=capturable,
        differentiable=differentiable,
        has_complex=has_complex,
    )
