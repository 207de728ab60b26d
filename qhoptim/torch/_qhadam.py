"""QHAdam and QHAdamW for PyTorch: the classes and their functional entry :func:`qhadam`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from qhoptim import convert, rounding, rules, validation
from qhoptim.torch import _fused, _kernels, _state_dtype, _tensors
from qhoptim.torch._optimizer import (
    Gathered,
    QHOptimizer,
    capturable_doc,
    differentiable_doc,
    foreach_doc,
    fresh_step,
    lr_value,
    maximize_doc,
    numbers_only,
    one_number_each,
    params_doc,
    state_dtype_doc,
)
from qhoptim.torch._state_dict import cast_complex_state
from qhoptim.torch._tensors import (
    default_foreach,
    group_by_device_and_dtype,
    needs_formula,
    on_device_kernels,
    scalar_lr,
    unalias_grads,
    value_of,
)

__all__ = ["QHAdam", "QHAdamW", "qhadam"]


class QHAdam(QHOptimizer):
    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        nus: tuple[float, float] = (1.0, 1.0),
        weight_decay: float = 0.0,
        decoupled_weight_decay: bool | None = None,
        eps: float = 1e-8,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        amsgrad: bool = False,
        state_dtype: torch.dtype | None = None,
        stochastic_rounding: bool | None = None,
        **legacy: Any,
    ) -> None:
        unknown = set(legacy) - {"decouple_weight_decay"}
        if unknown:
            raise TypeError(
                f"{type(self).__name__} got unexpected keyword arguments {sorted(unknown)}"
            )
        defaults = {
            "lr": lr,
            "betas": betas,
            "nus": nus,
            "weight_decay": weight_decay,
            "decoupled_weight_decay": decoupled_weight_decay,
            "eps": eps,
            "maximize": maximize,
            "foreach": foreach,
            "capturable": capturable,
            "differentiable": differentiable,
            "fused": fused,
            "amsgrad": amsgrad,
            "state_dtype": state_dtype,
            "stochastic_rounding": stochastic_rounding,
        }
        super().__init__(params, self._defaults_read(defaults, legacy))
        self._setup_fused()

    _GROUP_KEYS = ("lr", "betas", "nus", "weight_decay", "eps")
    _LEGACY_DECAY_KEY = "decouple_weight_decay"

    @staticmethod
    def _decoupled_from_legacy(value: Any) -> bool:
        if not isinstance(value, bool):
            raise TypeError(
                f"decouple_weight_decay must be a bool; received decouple_weight_decay={value!r}"
            )
        return value

    _STATE_KEYS = (
        frozenset(),
        frozenset({"step", "exp_avg", "exp_avg_sq"}),
        frozenset({"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}),  # amsgrad
        frozenset({"beta1_weight", "beta2_weight", "exp_avg", "exp_avg_sq"}),  # qhoptim 1.1.0
    )
    _SIGNED = (True, False, False)  # exp_avg; exp_avg_sq and its maximum are >= 0
    _STATE_LISTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")

    def _check_group(self, group: dict[str, Any]) -> None:
        beta1, beta2 = validation.check_pair(group["betas"], "betas")
        nu1, nu2 = validation.check_pair(group["nus"], "nus")
        hparams = {
            "betas[0]": beta1,
            "betas[1]": beta2,
            "nus[0]": nu1,
            "nus[1]": nu2,
            "eps": group["eps"],
            "weight_decay": group["weight_decay"],
        }
        numbers_only(hparams)
        validation.check_qhadam(
            lr=lr_value(group["lr"]),
            beta1=beta1,
            beta2=beta2,
            nu1=nu1,
            nu2=nu2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            names={"beta1": "betas[0]", "beta2": "betas[1]", "nu1": "nus[0]", "nu2": "nus[1]"},
        )
        one_number_each({"lr": group["lr"], **hparams})
        self._check_switches(group)
        validation.check_bool(group.get("amsgrad", False), "amsgrad")
        _state_dtype.check_state_dtype(group)
        if group.get("state_dtype") == torch.float16:
            rounding.check_second_moment_dtype("float16")

    def _upgrade_group(self, group: dict[str, Any]) -> None:
        # State dicts of qhoptim before amsgrad (1.1.0's included) lack the flag;
        # as torch.optim.Adam, a loaded group keeps its own hyperparameters.
        group.setdefault("amsgrad", False)
        group.setdefault("state_dtype", None)
        group.setdefault("stochastic_rounding", None)
        self._narrow_state(group, self._STATE_LISTS)
        for p in group["params"]:
            p_state = self.state.get(p, {})
            if len(p_state) == 0:
                continue
            cast_complex_state(p, p_state)
            if "beta1_weight" in p_state:
                _from_qhoptim_1_1(p_state, group["betas"])
            # The step count as a fresh state would have it (float32, or float64
            # under a float64 default dtype; on the parameter's device when
            # capturable or fused, as torch's Adam moves it): a saved int64 or
            # float16 count would make every multi-tensor step fail on the mix
            # of dtypes.
            p_state["step"] = fresh_step(p_state["step"], **self._step_dtype_and_device(group, p))

    def _init_group(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        states: list[dict[str, Any] | None],
        exp_avgs: list[Tensor],
        exp_avg_sqs: list[Tensor],
        max_exp_avg_sqs: list[Tensor],
        state_steps: list[Tensor],
    ) -> None:
        made = self.state
        amsgrad, differentiable = group["amsgrad"], group["differentiable"]
        for p, state in zip(params, states, strict=True):
            if state is None:
                state = made[p]
            if len(state) == 0:
                # As torch's Adam: the step count lives on the CPU unless
                # capturable or fused.
                state["step"] = torch.zeros((), **self._step_dtype_and_device(group, p))
                narrow = group["state_dtype"] if _state_dtype.narrow(group, p) else None
                state["exp_avg"] = _state_dtype.zeros_state(p, narrow)
                # |g|^2 is real: a complex parameter has a real second moment.
                state["exp_avg_sq"] = _state_dtype.zeros_state(p, narrow or p.real.dtype)
                if _state_dtype.eight_bit(narrow):
                    state[_state_dtype.PARAM_SHAPE] = _state_dtype.shape_record(p)
            if amsgrad and "max_exp_avg_sq" not in state:
                # New state, or amsgrad switched on in a group stepped without it:
                # the running maximum starts at zero, max(0, s) = s, as torch's.
                state["max_exp_avg_sq"] = torch.zeros_like(
                    state["exp_avg_sq"], memory_format=torch.preserve_format
                )
            if differentiable and state["step"].requires_grad:
                raise RuntimeError(
                    "`requires_grad` is not supported for `step` in differentiable mode"
                )
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            if amsgrad:
                max_exp_avg_sqs.append(state["max_exp_avg_sq"])
            state_steps.append(state["step"])

    def _step_group(self, group: dict[str, Any], gathered: Gathered) -> None:
        params, grads, states = gathered
        exp_avgs: list[Tensor] = []
        exp_avg_sqs: list[Tensor] = []
        max_exp_avg_sqs: list[Tensor] = []
        state_steps: list[Tensor] = []
        self._init_group(group, params, states, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps)
        moments = [exp_avgs, exp_avg_sqs, *([max_exp_avg_sqs] if group["amsgrad"] else [])]
        if group.get("state_dtype") is None:  # the common case, at the least host work
            self._qhadam(group, params, grads, moments, state_steps, None)
            return
        self._step_lists(
            group,
            params,
            grads,
            moments,
            state_steps,
            lambda ps, gs, lists, steps, seeds: self._qhadam(group, ps, gs, lists, steps, seeds),
            count_steps=False,
        )

    def _qhadam(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        moments: list[list[Tensor]],
        state_steps: list[Tensor],
        state_seeds: list[list[int]] | None,
    ) -> None:
        beta1, beta2 = group["betas"]
        nu1, nu2 = group["nus"]
        exp_avgs, exp_avg_sqs, *maxes = moments
        qhadam(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            state_steps,
            foreach=group["foreach"],
            capturable=group["capturable"],
            differentiable=group["differentiable"],
            fused=group["fused"],
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            nu1=nu1,
            nu2=nu2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            decoupled_weight_decay=group["decoupled_weight_decay"],
            maximize=group["maximize"],
            amsgrad=group["amsgrad"],
            max_exp_avg_sqs=maxes[0] if maxes else [],
            state_seeds=state_seeds,
            **self._amp_tensors(),
        )

    @classmethod
    def from_params(cls, params: ParamsT, converted: convert.QHAdamParams, **kwargs: Any) -> QHAdam:
        """Build from :class:`qhoptim.convert.QHAdamParams`, e.g. a conversion's result.

        ``QHAdam.from_params(model.parameters(), convert.from_nadam(1e-3, (0.9, 0.999), 1e-8))``
        is NAdam modulo bias correction; ``kwargs`` (``weight_decay``, ...) go
        to the constructor.
        """
        return cls._from_conversion(params, converted, convert.QHAdamParams, **kwargs)  # type: ignore[no-any-return]

    # -- qhoptim 1.1.0's conversions; each returns constructor kwargs ---------
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
        return cls._kwargs(convert.from_adam(lr, betas, 1e-8 if eps is None else eps), eps)

    @classmethod
    def from_nadam(
        cls, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float | None = None
    ) -> dict[str, Any]:
        """NAdam, modulo bias correction; see :func:`qhoptim.convert.from_nadam`."""
        return cls._kwargs(convert.from_nadam(lr, betas, 1e-8 if eps is None else eps), eps)

    @classmethod
    def from_rmsprop(
        cls, lr: float = 1e-2, alpha: float = 0.99, eps: float | None = None
    ) -> dict[str, Any]:
        """``RMSprop``, modulo bias correction; see :func:`qhoptim.convert.from_rmsprop`."""
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

    ``amsgrad=True`` is the AMSGrad variant (the paper's "analogously
    modified" QHAdam, Sec. 5) with ``torch.optim.Adam``'s convention: the
    running maximum :math:`\hat s_{t+1} = \max(\hat s_t, s_{t+1})` of the
    *uncorrected* second moment (state ``max_exp_avg_sq``) takes the place of
    :math:`s_{t+1}` in the denominator, divided by :math:`1 - \beta_2^{t+1}`.
    :math:`\nu = (1, 1)` is then ``Adam(amsgrad=True)``.
"""


def _qhadam_args_doc(weight_decay: str) -> str:
    return rf"""
        {params_doc}
        lr (float, Tensor, optional): learning rate :math:`\alpha` (default: 1e-3)
        betas (tuple[float, float], optional): :math:`(\beta_1, \beta_2)`, each in
            [0, 1) (default: (0.9, 0.999))
        nus (tuple[float, float], optional): :math:`(\nu_1, \nu_2)`; :math:`\nu_1`
            any finite real, :math:`\nu_2` in [0, 1] (default: (1.0, 1.0))
        weight_decay (float, optional): weight decay :math:`\lambda` (default: {weight_decay})"""


_QHADAM_FLAGS_DOC = rf"""
        eps (float, optional): added to the denominator after the square root
            (default: 1e-8)
        {maximize_doc}
        {foreach_doc}
        {capturable_doc}
        {differentiable_doc}
        fused (bool, optional): one pass over memory per step: a C++ kernel on
            CPU, Triton kernels on CUDA (default: None, i.e. False)
        amsgrad (bool, optional): the AMSGrad variant, as ``torch.optim.Adam``'s
            ``amsgrad`` (default: False)
        {state_dtype_doc}
"""

QHAdam.__doc__ = (
    "QHAdam of `Ma and Yarats (2019)`_.\n"
    + _QHADAM_MATH
    + """
    The successor of qhoptim 1.1.0's ``qhoptim.pyt.QHAdam`` (which stays
    available, unchanged): the same positional arguments and meaning, with
    ``decouple_weight_decay`` now spelled ``decoupled_weight_decay``; 1.1.0
    checkpoints are converted on load.

    Args:"""
    + _qhadam_args_doc("0")
    + r"""
        decoupled_weight_decay (bool, optional): ``False`` adds :math:`\lambda\theta`
            to the gradient (L2); ``True`` multiplies :math:`\theta` by
            :math:`1 - \alpha\lambda` before the step, as AdamW. 1.1.0's
            ``decouple_weight_decay`` is still read, with a ``DeprecationWarning``
            (and refused beside a ``decoupled_weight_decay`` that says otherwise).
            (default: None, which is False)"""
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
        fused: bool | None = None,
        amsgrad: bool = False,
        state_dtype: torch.dtype | None = None,
        stochastic_rounding: bool | None = None,
        **legacy: Any,
    ) -> None:
        for name in ("decoupled_weight_decay", "decouple_weight_decay"):
            if name in legacy:
                # QHAdam's legacy rename would turn this class's True into the value.
                raise TypeError(
                    f"QHAdamW's weight decay is always decoupled: it takes no {name} "
                    f"(QHAdam(decoupled_weight_decay=False) decays as L2); received "
                    f"{name}={legacy[name]!r}"
                )
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
            fused=fused,
            amsgrad=amsgrad,
            state_dtype=state_dtype,
            stochastic_rounding=stochastic_rounding,
            **legacy,
        )


QHAdamW.__doc__ = (
    r"""QHAdam with decoupled weight decay, as AdamW (`Loshchilov and Hutter, 2019`_).

    ``QHAdamW(params, ...)`` is ``QHAdam(params, ..., decoupled_weight_decay=True)``
    with torch's ``AdamW`` default ``weight_decay=1e-2``: :math:`\theta` is
    multiplied by :math:`1 - \alpha\lambda` before each step. (qhoptim 1.1.0's
    ``QHAdamW`` was a function defaulting to ``weight_decay=0``, as
    ``qhoptim.pyt.QHAdamW`` still does.)
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


def _single_tensor_qhadam(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    state_steps: list[Tensor],
    hp: _tensors.QHAdamHyperparameters,
    *,
    capturable: bool,
    differentiable: bool,
    max_exp_avg_sqs: list[Tensor] | None = None,
) -> None:
    for step_t in state_steps:
        step_t += 1
    maxes = max_exp_avg_sqs if hp.amsgrad else None
    if not needs_formula(hp.lr, capturable, differentiable):
        if params:
            steps = [value_of(t) for t in state_steps]
            _kernels.qhadam_(
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                steps,
                hp,
                per_tensor=True,
                max_exp_avg_sqs=maxes,
            )
        return
    for i, (param, grad, exp_avg, exp_avg_sq, step_t) in enumerate(
        zip(params, grads, exp_avgs, exp_avg_sqs, state_steps, strict=True)
    ):
        step = step_t if capturable else value_of(step_t)
        _kernels.formula_qhadam_(
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            step,
            hp,
            differentiable,
            max_exp_avg_sq=None if maxes is None else maxes[i],
        )


def _multi_tensor_qhadam(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    state_steps: list[Tensor],
    hp: _tensors.QHAdamHyperparameters,
    *,
    capturable: bool,
    differentiable: bool,
    max_exp_avg_sqs: list[Tensor] | None = None,
) -> None:
    if len(params) == 0:
        return
    on_device = on_device_kernels(capturable, differentiable)
    if needs_formula(hp.lr, capturable, differentiable) and not on_device:
        _single_tensor_qhadam(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            state_steps,
            hp,
            capturable=capturable,
            differentiable=differentiable,
            max_exp_avg_sqs=max_exp_avg_sqs,
        )
        return
    amsgrad = hp.amsgrad and max_exp_avg_sqs is not None
    tensorlists = [params, grads, exp_avgs, exp_avg_sqs, state_steps]
    if amsgrad:
        tensorlists.append(cast(list[Tensor], max_exp_avg_sqs))
    grouped = group_by_device_and_dtype(tensorlists)
    for lists, _ in grouped.values():
        ps, gs, ms, ss, steps, *vs = (cast(list[Tensor], x) for x in lists)
        # The step counts live on the CPU unless capturable.
        if on_device:
            _tensors.advance_counts(steps)
            numbers: list[Any] = steps
        else:
            numbers = _fused.counted(steps)
        _kernels.qhadam_(
            ps,
            gs,
            ms,
            ss,
            numbers,
            hp,
            max_exp_avg_sqs=vs[0] if vs else None,
        )


def qhadam(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    state_steps: list[Tensor],
    foreach: bool | None = None,
    capturable: bool = False,
    differentiable: bool = False,
    fused: bool | None = None,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
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
    amsgrad: bool = False,
    max_exp_avg_sqs: list[Tensor] | None = None,
    state_seeds: list[list[int]] | None = None,
) -> None:
    r"""Functional API that performs the QHAdam computation in place.

    See :class:`QHAdam` for details. ``exp_avgs`` and ``exp_avg_sqs`` are the
    bias-*un*corrected moments (zeros before the first step; ``exp_avg_sqs``
    real even for complex parameters); ``state_steps`` are 0-d tensors that
    count the steps taken, incremented here. ``has_complex`` is accepted for
    torch's functional signature; complex tensors are recognised per tensor.
    ``fused=True`` takes the fused kernels (``grad_scale`` and ``found_inf``
    as ``torch.amp.GradScaler`` sets them on the optimizer). ``amsgrad=True``
    (as ``torch.optim.adam``'s) needs ``max_exp_avg_sqs``, the running maxima
    of the second moments (real, zeros before the first step), updated here.
    ``state_seeds`` (float32 parameters; on CUDA with ``fused=True``): the
    moments are bfloat16 or 8-bit (``QHAdam(state_dtype=...)``), stepped by a
    fused kernel and rounded stochastically with these seeds, one per moment
    and tensor.
    """
    if not torch.compiler.is_compiling() and not all(isinstance(t, Tensor) for t in state_steps):
        raise RuntimeError("`state_steps` must be a list of singleton tensors")
    validation.check_bool(amsgrad, "amsgrad")
    if amsgrad and (max_exp_avg_sqs is None or len(max_exp_avg_sqs) != len(params)):
        raise ValueError(
            "qhadam(amsgrad=True) needs max_exp_avg_sqs, one tensor per parameter "
            "(zeros before the first step)"
        )
    hp = _tensors.QHAdamHyperparameters(
        scalar_lr(lr),
        beta1,
        beta2,
        nu1,
        nu2,
        eps,
        weight_decay,
        decoupled_weight_decay,
        maximize,
        amsgrad,
    )
    maxes = max_exp_avg_sqs if amsgrad else None
    if fused or state_seeds is not None:
        # The fused kernels handle a gradient aliasing its parameter themselves.
        _fused.fused_qhadam(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            state_steps,
            hp,
            grad_scale=grad_scale,
            found_inf=found_inf,
            max_exp_avg_sqs=maxes,
            state_seeds=state_seeds,
            capturable=capturable,
        )
        return
    # A gradient that shares storage with its parameter is read before it is written.
    grads = unalias_grads(params, grads)
    if foreach is None:
        foreach = default_foreach(params, differentiable)
    func = _multi_tensor_qhadam if foreach else _single_tensor_qhadam
    func(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        state_steps,
        hp,
        capturable=capturable,
        differentiable=differentiable,
        max_exp_avg_sqs=maxes,
    )
