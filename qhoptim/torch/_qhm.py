"""QHM for PyTorch: the optimizer class and its functional entry :func:`qhm`."""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from qhoptim import convert, validation
from qhoptim.torch import _fused, _kernels, _state_dtype, _tensors
from qhoptim.torch._optimizer import (
    Gathered,
    MomentumBufferState,
    QHOptimizer,
    capturable_doc,
    differentiable_doc,
    foreach_doc,
    lr_value,
    maximize_doc,
    numbers_only,
    one_number_each,
    params_doc,
    required,
    state_dtype_doc,
)
from qhoptim.torch._state_dict import cast_complex_state
from qhoptim.torch._tensors import (
    default_foreach,
    needs_formula,
    on_device_kernels,
    scalar_lr,
    unalias_grads,
)

__all__ = ["QHM", "qhm"]

_WEIGHT_DECAY_TYPES = {"grad": False, "direct": True}
_MOMENTUM_BUFFER = operator.itemgetter("momentum_buffer")
_HAS_STEP = operator.methodcaller("__contains__", "step")


def _conversion(name: str) -> Any:
    """A classmethod returning the constructor kwargs of ``qhoptim.convert.<name>``."""
    func: Callable[..., convert.QHMParams] = getattr(convert, name)

    @functools.wraps(func)
    def method(cls: type, *args: Any, **kwargs: Any) -> dict[str, float]:
        return func(*args, **kwargs).as_kwargs()

    return classmethod(method)


class QHM(MomentumBufferState, QHOptimizer):
    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = required,  # type: ignore[assignment]
        momentum: float = 0.999,
        nu: float = 0.7,
        weight_decay: float = 0.0,
        decoupled_weight_decay: bool | None = None,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        state_dtype: torch.dtype | None = None,
        stochastic_rounding: bool | None = None,
        **legacy: Any,
    ) -> None:
        if isinstance(decoupled_weight_decay, str):  # 1.1.0's positional weight_decay_type
            legacy.setdefault("weight_decay_type", decoupled_weight_decay)
            decoupled_weight_decay = None
        unknown = set(legacy) - {"weight_decay_type"}
        if unknown:
            raise TypeError(f"QHM got unexpected keyword arguments {sorted(unknown)}")
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "nu": nu,
            "weight_decay": weight_decay,
            "decoupled_weight_decay": decoupled_weight_decay,
            "maximize": maximize,
            "foreach": foreach,
            "capturable": capturable,
            "differentiable": differentiable,
            "fused": fused,
            "state_dtype": state_dtype,
            "stochastic_rounding": stochastic_rounding,
        }
        super().__init__(params, self._defaults_read(defaults, legacy))
        self._setup_fused()

    _GROUP_KEYS = ("lr", "momentum", "nu", "weight_decay")
    _LEGACY_DECAY_KEY = "weight_decay_type"

    @staticmethod
    def _decoupled_from_legacy(value: Any) -> bool:
        if not isinstance(value, str) or value not in _WEIGHT_DECAY_TYPES:
            raise ValueError(
                "weight_decay_type must be 'grad' or 'direct'; "
                f"received weight_decay_type={value!r}"
            )
        return _WEIGHT_DECAY_TYPES[value]

    def _check_group(self, group: dict[str, Any]) -> None:
        hparams = {k: group[k] for k in ("momentum", "nu", "weight_decay")}
        numbers_only(hparams)
        validation.check_qhm(lr=lr_value(group["lr"]), **hparams)
        one_number_each({"lr": group["lr"], **hparams})
        self._check_switches(group)
        _state_dtype.check_state_dtype(group)

    def _upgrade_group(self, group: dict[str, Any]) -> None:
        # qhoptim 1.1.0's state is the same; only complex state needs a cast.
        group.setdefault("state_dtype", None)
        group.setdefault("stochastic_rounding", None)
        for p in group["params"]:
            cast_complex_state(p, self.state.get(p, {}))
        self._upgrade_step(group)
        self._narrow_state(group, self._STATE_LISTS)

    def _init_group(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        states: list[dict[str, Any] | None],
        momentum_buffers: list[Tensor],
    ) -> None:
        """Append the buffers of ``params``, made where new."""
        if all(states) and (group["state_dtype"] is None or all(map(_HAS_STEP, states))):
            # The common case, every state made (a narrow one's step count
            # too): taken at C speed, since the step's host work is per parameter.
            momentum_buffers.extend(map(_MOMENTUM_BUFFER, cast(list[dict[str, Any]], states)))
            return
        made = self.state
        for p, state in zip(params, states, strict=True):
            state = made[p] if state is None else state
            momentum_buffers.append(self._momentum_buffer(group, p, state))

    def _step_group(self, group: dict[str, Any], gathered: Gathered) -> None:
        params, grads, states = gathered
        momentum_buffers: list[Tensor] = []
        self._init_group(group, params, states, momentum_buffers)
        if group.get("state_dtype") is None:  # the common case, at the least host work
            self._qhm(group, params, grads, momentum_buffers, None)
            return
        # The step counts of narrow states: the rounding's seed.
        steps = [self.state[p].get("step") for p in params]
        self._step_lists(
            group,
            params,
            grads,
            [momentum_buffers],
            steps,
            lambda ps, gs, lists, _, seeds: self._qhm(group, ps, gs, lists[0], seeds),
            count_steps=True,
        )

    def _qhm(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        momentum_buffers: list[Tensor],
        state_seeds: list[list[int]] | None,
    ) -> None:
        qhm(
            params,
            grads,
            momentum_buffers,
            foreach=group["foreach"],
            capturable=group["capturable"],
            differentiable=group["differentiable"],
            fused=group["fused"],
            lr=group["lr"],
            momentum=group["momentum"],
            nu=group["nu"],
            weight_decay=group["weight_decay"],
            decoupled_weight_decay=group["decoupled_weight_decay"],
            maximize=group["maximize"],
            state_seeds=state_seeds,
            **self._amp_tensors(),
        )

    @classmethod
    def from_params(cls, params: ParamsT, converted: convert.QHMParams, **kwargs: Any) -> QHM:
        """Build from :class:`qhoptim.convert.QHMParams`, e.g. a conversion's result.

        ``QHM.from_params(model.parameters(), convert.from_nesterov(lr=0.1, momentum=0.9))``
        steps exactly as ``SGD(lr=0.1, momentum=0.9, nesterov=True)``; ``kwargs``
        (``weight_decay``, ``foreach``, ...) go to the constructor.
        """
        return cls._from_conversion(params, converted, convert.QHMParams, **kwargs)  # type: ignore[no-any-return]

    # qhoptim 1.1.0's conversions, each returning constructor kwargs.
    from_sgd = _conversion("from_sgd")
    from_momentum = _conversion("from_momentum")
    from_nesterov = _conversion("from_nesterov")
    from_pid = _conversion("from_pid")
    from_an_pid = _conversion("from_an_pid")
    from_synthesized_nesterov = _conversion("from_synthesized_nesterov")
    from_robust_momentum = _conversion("from_robust_momentum")
    from_triple_momentum = _conversion("from_triple_momentum")
    from_accsgd = _conversion("from_accsgd")
    from_two_state_optimizer = _conversion("from_two_state_optimizer")


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

    The successor of qhoptim 1.1.0's ``qhoptim.pyt.QHM`` (which stays available,
    unchanged): the same state (checkpoints load unchanged) and arguments, with
    1.1.0's ``weight_decay_type`` now spelled ``decoupled_weight_decay``.

    Args:
        {params_doc}
        lr (float, Tensor): learning rate :math:`\alpha` (required, as in 1.1.0,
            unless every param group sets its own). A tensor must have one element.
        momentum (float, optional): :math:`\beta`, in [0, 1) (default: 0.999)
        nu (float, optional): immediate discount factor :math:`\nu`, any finite
            real (default: 0.7)
        weight_decay (float, optional): weight decay :math:`\lambda` (default: 0)
        decoupled_weight_decay (bool, optional): ``False`` adds :math:`\lambda\theta`
            to the gradient (L2, as ``torch.optim.SGD``; ``p.grad`` is not
            modified); ``True`` multiplies :math:`\theta` by
            :math:`1 - \alpha\lambda` before the step, as AdamW. 1.1.0's
            ``weight_decay_type="grad"`` / ``"direct"`` is still read, with a
            ``DeprecationWarning`` (and refused beside a ``decoupled_weight_decay``
            that says otherwise). (default: None, which is False)
        {maximize_doc}
        {foreach_doc}
        {capturable_doc}
            QHM keeps no step counter, so with float hyperparameters it is always
            capturable; ``capturable=True`` also takes a tensor ``lr`` on the
            device (the loop through :func:`qhoptim.rules.qhm_update`, foreach
            with the tensor as a kernel operand).
        {differentiable_doc}
        fused (bool, optional): one pass over memory per step: a C++ kernel on
            CPU, Triton kernels on CUDA (default: None, i.e. False)
        {state_dtype_doc}

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
    hp: _tensors.QHMHyperparameters,
    *,
    capturable: bool,
    differentiable: bool,
) -> None:
    if not needs_formula(hp.lr, capturable, differentiable):
        if params:
            _kernels.qhm_(params, grads, momentum_buffers, hp, per_tensor=True)
        return
    for param, grad, buf in zip(params, grads, momentum_buffers, strict=True):
        _kernels.formula_qhm_(param, grad, buf, hp, differentiable)


def _multi_tensor_qhm(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    hp: _tensors.QHMHyperparameters,
    *,
    capturable: bool,
    differentiable: bool,
) -> None:
    if len(params) == 0:
        return
    if needs_formula(hp.lr, capturable, differentiable) and not on_device_kernels(
        capturable, differentiable
    ):
        _single_tensor_qhm(
            params,
            grads,
            momentum_buffers,
            hp,
            capturable=capturable,
            differentiable=differentiable,
        )
        return
    _kernels.foreach_qhm(params, grads, momentum_buffers, **hp._asdict())


def qhm(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    foreach: bool | None = None,
    capturable: bool = False,
    differentiable: bool = False,
    fused: bool | None = None,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    has_complex: bool = False,
    *,
    lr: float | Tensor,
    momentum: float,
    nu: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    maximize: bool,
    state_seeds: list[list[int]] | None = None,
) -> None:
    r"""Functional API that performs the QHM computation in place.

    See :class:`QHM` for details. ``momentum_buffers`` are the normalized
    buffers (zeros before the first step). ``has_complex`` is accepted for
    torch's functional signature; complex tensors are recognised per tensor.
    ``fused=True`` takes the fused kernels (``grad_scale`` and ``found_inf``
    as ``torch.amp.GradScaler`` sets them on the optimizer). ``state_seeds``
    (float32 parameters): the buffers are bfloat16 or 8-bit
    (``QHM(state_dtype=...)``), stepped by the fused CPU kernel whatever
    ``foreach`` and ``fused`` say (on CUDA, with ``fused=True``: the Triton
    kernel) and rounded stochastically with these seeds, ``[seed]`` per
    tensor.
    """
    hp = _tensors.QHMHyperparameters(
        scalar_lr(lr), momentum, nu, weight_decay, decoupled_weight_decay, maximize
    )
    if fused or state_seeds is not None:
        # The fused kernels handle a gradient aliasing its parameter themselves.
        _fused.fused_qhm(
            params,
            grads,
            momentum_buffers,
            hp,
            grad_scale=grad_scale,
            found_inf=found_inf,
            state_seeds=state_seeds,
        )
        return
    # A gradient that shares storage with its parameter is read before it is written.
    grads = unalias_grads(params, grads)
    if foreach is None:
        foreach = default_foreach(params, differentiable)
    func = _multi_tensor_qhm if foreach else _single_tensor_qhm
    func(params, grads, momentum_buffers, hp, capturable=capturable, differentiable=differentiable)
