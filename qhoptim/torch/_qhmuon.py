r"""QHMuon for PyTorch: ``torch.optim.Muon`` with QHM's immediate discount ``nu``.

The step is ``torch.optim.Muon``'s, operation for operation, with its Nesterov
switch replaced by ``nu`` (:mod:`qhoptim.rules`: :func:`~qhoptim.rules.qhm_coefficients`
for the momentum, :func:`~qhoptim.rules.newton_schulz` on torch's ``addmm``,
:func:`~qhoptim.rules.muon_lr_ratio`): so ``QHMuon(nu=momentum)`` is
``Muon(nesterov=True)`` and ``QHMuon(nu=1)`` is ``Muon(nesterov=False)``, bit
for bit (``tests/torch/test_torch_qhmuon.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from qhoptim import convert, rules, validation
from qhoptim.torch import _state_dtype
from qhoptim.torch._optimizer import (
    MomentumBufferState,
    NarrowStateOptimizer,
    as_numbers,
    lr_value,
    maximize_doc,
    numbers_only,
    one_number_each,
    params_doc,
    state_dtype_doc,
)

__all__ = ["QHMuon", "qhmuon"]

# Newton-Schulz on torch: ``addmm`` (one rounding of b*A + c*A@A in a narrow
# dtype, as torch's Muon computes it) and the Frobenius norm clamped at eps.
_TORCH_MATRIX_OPS = rules.MatrixOps(
    matmul=torch.matmul,
    matmul_add=lambda c, a, b, beta, alpha: torch.addmm(c, a, b, beta=beta, alpha=alpha),
    transpose=lambda x: x.T,
    norm=lambda x: x.norm(),
    clamp_min=lambda x, low: x.clamp(min=low),
)

_NS_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _check_ns_dtype(ns_dtype: Any) -> None:
    if ns_dtype not in _NS_DTYPES:
        names = ", ".join(str(d) for d in _NS_DTYPES)  # torch.bfloat16: a name is no dtype
        raise ValueError(f"ns_dtype must be one of {names}; received ns_dtype={ns_dtype!r}")


def _check_matrix_gradient(grad: Tensor) -> None:
    if grad.ndim != 2:
        raise ValueError(f"QHMuon's gradients must be matrices; received shape {tuple(grad.shape)}")


def _check_matrices(params: list[Any]) -> None:
    for p in params:
        if isinstance(p, Tensor) and p.ndim != 2:
            raise ValueError(
                "QHMuon optimizes 2-D parameters only (matrices of hidden layers; "
                "give biases, norms and embeddings to QHAdam or AdamW); received a "
                f"parameter of shape {tuple(p.shape)}"
            )


class QHMuon(MomentumBufferState, NarrowStateOptimizer):
    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nu: float = 0.95,
        ns_coefficients: tuple[float, float, float] = rules.MUON_NS_COEFFICIENTS,
        eps: float = rules.MUON_EPS,
        ns_steps: int = rules.MUON_NS_STEPS,
        adjust_lr_fn: str | None = None,
        *,
        ns_dtype: torch.dtype = torch.bfloat16,
        maximize: bool = False,
        state_dtype: torch.dtype | None = None,
        stochastic_rounding: bool | None = None,
    ) -> None:
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nu": nu,
            "ns_coefficients": tuple(ns_coefficients)
            if isinstance(ns_coefficients, list)
            else ns_coefficients,
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "ns_dtype": ns_dtype,
            "maximize": maximize,
            "state_dtype": state_dtype,
            "stochastic_rounding": stochastic_rounding,
        }
        self._check_group(defaults)
        super().__init__(params, as_numbers(defaults))

    _GROUP_KEYS = ("lr", "weight_decay", "momentum", "nu", "ns_coefficients", "eps", "ns_steps")

    def _upgrade_groups(self) -> None:
        for group in self.param_groups:
            group.setdefault("state_dtype", None)  # pickled before it was an option
            group.setdefault("stochastic_rounding", None)
            self._upgrade_step(group)
            # torch's load_state_dict casts the state to the parameters' dtype
            self._narrow_state(group, self._STATE_LISTS)

    @staticmethod
    def _check_group(group: dict[str, Any]) -> None:
        numbers_only({k: group[k] for k in ("weight_decay", "momentum", "nu", "eps", "ns_steps")})
        coefficients = group["ns_coefficients"]
        if isinstance(coefficients, (tuple, list)):
            numbers_only({f"ns_coefficients[{i}]": c for i, c in enumerate(coefficients)})
        else:
            numbers_only({"ns_coefficients": coefficients})
        validation.check_qhmuon(
            lr=lr_value(group["lr"]),
            momentum=group["momentum"],
            nu=group["nu"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            ns_steps=group["ns_steps"],
            ns_coefficients=group["ns_coefficients"],
            adjust_lr_fn=group["adjust_lr_fn"],
            adjustments=rules.MUON_LR_ADJUSTMENTS,
        )
        one_number_each({k: group[k] for k in ("lr", "weight_decay", "momentum", "nu", "eps")})
        _check_ns_dtype(group["ns_dtype"])
        validation.check_bool(group["maximize"], "maximize")
        _state_dtype.check_state_dtype(group)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if isinstance(param_group, dict) and hasattr(self, "defaults"):
            self._check_group({**self.defaults, **param_group})
            param_group = as_numbers(param_group)
            # Checked before the group is added: a refused group leaves none behind.
            params = param_group.get("params", [])
            if isinstance(params, Tensor):
                params = [params]
            elif not isinstance(params, set):  # torch's own error for a set
                params = list(params)
            # A named parameter (torch's ("name", tensor) pairs) is checked too.
            _check_matrices([p[1] if isinstance(p, tuple) and len(p) == 2 else p for p in params])
            param_group = {**param_group, "params": params}
        super().add_param_group(param_group)
        if hasattr(self, "defaults"):
            self._remember_checked(self.param_groups[-1])

    @classmethod
    def from_params(cls, params: ParamsT, converted: convert.QHMuonParams, **kwargs: Any) -> QHMuon:
        """A QHMuon from :func:`qhoptim.convert.from_muon`'s settings, e.g.
        ``QHMuon.from_params(params, convert.from_muon(0.95), lr=0.02)``."""
        validation.check_conversion("QHMuon.from_params", converted, convert.QHMuonParams)
        settings: dict[str, Any] = {**converted.as_kwargs(), **kwargs}
        return cls(params, **settings)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Performs a single optimization step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Every group's values and parameters checked before any group moves:
        # a failing step changes nothing.
        changes = self._check_changed_groups()
        gathered = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if torch.is_complex(p):
                    raise RuntimeError("QHMuon does not support complex parameters")
                if p.grad.is_sparse:
                    raise RuntimeError("QHMuon does not support sparse gradients")
                _check_matrix_gradient(p.grad)
            gathered.append(params)
        self._take_changes(changes)  # every check passed
        for group, params in zip(self.param_groups, gathered, strict=True):
            if not params:
                continue
            grads = [p.grad for p in params]
            states = [self.state[p] for p in params]
            buffers = [
                self._momentum_buffer(group, p, s) for p, s in zip(params, states, strict=True)
            ]
            steps = [s.get("step") for s in states]
            hyperparameters = {
                key: group[key]
                for key in (
                    "lr",
                    "weight_decay",
                    "momentum",
                    "nu",
                    "ns_coefficients",
                    "eps",
                    "ns_steps",
                    "adjust_lr_fn",
                    "ns_dtype",
                    "maximize",
                )
            }
            # A narrow state steps on a working copy in the parameter's dtype,
            # each matrix whole (the orthogonalization is not element-wise).
            self._step_lists(
                group,
                params,
                grads,
                [buffers],
                steps,
                lambda ps, gs, lists, _, __, hp=hyperparameters: qhmuon(ps, gs, lists[0], **hp),
                count_steps=True,
                whole_tensors=True,
            )
        return loss


def qhmuon(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    *,
    lr: float | Tensor,
    weight_decay: float,
    momentum: float,
    nu: float,
    ns_coefficients: tuple[float, float, float] = rules.MUON_NS_COEFFICIENTS,
    eps: float = rules.MUON_EPS,
    ns_steps: int = rules.MUON_NS_STEPS,
    adjust_lr_fn: str | None = None,
    ns_dtype: torch.dtype = torch.bfloat16,
    maximize: bool = False,
) -> None:
    r"""Functional QHMuon: one step of every matrix in ``params``, in place.

    See :class:`QHMuon`. The gradients are read, never written.
    """
    lr = float(lr) if isinstance(lr, Tensor) else lr
    c = rules.qhm_coefficients(momentum, nu)
    for grad in grads:  # all first: a refused gradient leaves every parameter as it was
        _check_matrix_gradient(grad)
    for param, grad, buffer in zip(params, grads, momentum_buffers, strict=True):
        if maximize:
            grad = -grad
        buffer.lerp_(grad, c.grad_to_buffer)
        # (1 - nu) * grad + nu * buffer, as torch's Muon forms its Nesterov mix
        direction = grad.lerp(buffer, c.buffer_weight)
        rows, columns = param.shape
        half = ns_dtype == torch.float16  # normalized in float32 first (rules.newton_schulz)
        update = rules.newton_schulz(
            direction.float() if half else direction.to(ns_dtype),
            rows=rows,
            columns=columns,
            ops=_TORCH_MATRIX_OPS,
            coefficients=ns_coefficients,
            steps=ns_steps,
            eps=eps,
            narrow=torch.Tensor.half if half else None,
        )
        param.mul_(rules.decoupled_decay_factor(lr, weight_decay))
        param.add_(update, alpha=-lr * rules.muon_lr_ratio(adjust_lr_fn, rows, columns))


QHMuon.__doc__ = rf"""Muon with quasi-hyperbolic momentum: QHM's direction, orthogonalized.

    For each 2-D parameter :math:`\theta` with gradient :math:`\nabla_t`:

    .. math::

        g_{{t+1}} &= \beta g_t + (1 - \beta) \nabla_t \\
        O_t &= \mathrm{{NS}}_k^{{(a,b,c)}}\big((1 - \nu) \nabla_t + \nu g_{{t+1}}\big) \\
        \theta_{{t+1}} &= (1 - \alpha \lambda) \theta_t - \alpha\, r(\theta)\, O_t

    with :math:`\mathrm{{NS}}` Muon's Newton-Schulz orthogonalization
    (:func:`qhoptim.rules.newton_schulz`) and :math:`r` the shape's learning-rate
    ratio (:func:`qhoptim.rules.muon_lr_ratio`). ``nu=momentum`` is
    ``torch.optim.Muon(nesterov=True)`` and ``nu=1`` ``Muon(nesterov=False)``,
    bit for bit; :func:`qhoptim.convert.from_muon` gives the settings. The
    defaults are Muon's (so ``nu`` defaults to the Nesterov value); QHM's
    decoupling of ``nu`` from ``momentum`` is what is new.

    Like ``torch.optim.Muon``, QHMuon takes 2-D parameters only: give biases,
    norms and embeddings to another optimizer (QHAdam, AdamW).

    Args:
        {params_doc}
        lr (float or Tensor, optional): learning rate :math:`\alpha` (default: 1e-3)
        weight_decay (float, optional): decoupled weight decay :math:`\lambda`
            (default: 0.1)
        momentum (float, optional): :math:`\beta`, the buffer's discount, in
            [0, 1) (default: 0.95)
        nu (float, optional): immediate discount :math:`\nu`, any finite real
            (default: 0.95)
        ns_coefficients (tuple of three floats, optional): :math:`(a, b, c)`
            (default: {rules.MUON_NS_COEFFICIENTS})
        eps (float, optional): floor of the norm the iteration divides by
            (default: {rules.MUON_EPS})
        ns_steps (int, optional): Newton-Schulz steps, in [0, 100) (default:
            {rules.MUON_NS_STEPS})
        adjust_lr_fn (str, optional): ``"original"`` (or None):
            :math:`r = \sqrt{{\max(1, A/B)}}` for an :math:`A \times B` matrix;
            ``"match_rms_adamw"``: :math:`r = 0.2 \sqrt{{\max(A, B)}}` (default: None)
        ns_dtype (torch.dtype, keyword-only): the dtype the orthogonalization
            runs in: bfloat16 as torch's Muon, float32 or float64 for accuracy
            (default: torch.bfloat16)
        {maximize_doc}
        {state_dtype_doc}

    Example:
        >>> import torch
        >>> from qhoptim.torch import QHMuon
        >>> layer = torch.nn.Linear(4, 3, bias=False)
        >>> opt = QHMuon(layer.parameters(), lr=0.02, momentum=0.999, nu=0.7)
        >>> layer(torch.ones(2, 4)).sum().backward()
        >>> opt.step()
    """
