"""qhoptim 1.1.0's import path: ``from qhoptim.pyt import QHM, QHAdam, QHAdamW``.

Drop-ins for qhoptim 1.1.0's classes, built on :mod:`qhoptim.torch`: 1.1.0's
positional arguments and names -- QHM's ``weight_decay_type`` (1.1.0's
``"grad"`` where neither it nor ``decoupled_weight_decay`` is given),
QHAdam's ``decouple_weight_decay`` (read without a warning here) and
``QHAdamW``'s ``weight_decay=0`` -- with everything :mod:`qhoptim.torch` adds
as keyword arguments (``decoupled_weight_decay`` too; a legacy spelling that
says otherwise is refused). QHM's ``momentum`` and ``nu``, which 1.1.0
required, default to the paper's 0.999 and 0.7, as in :mod:`qhoptim.torch`.
New code should use :mod:`qhoptim.torch` (see ``docs/torch.md``, "Migrating
from qhoptim 1.1.0").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# qhoptim.torch first: without torch it says which extra to install.
from qhoptim import torch as _torch

# torch's sentinel of a required lr (add_param_group checks it), after the line above.
from torch.optim.optimizer import required  # isort: skip

if TYPE_CHECKING:
    from torch import Tensor
    from torch.optim.optimizer import ParamsT

__all__ = ["QHM", "QHAdam", "QHAdamW"]


class QHM(_torch.QHM):
    """:class:`qhoptim.torch.QHM` with qhoptim 1.1.0's signature."""

    _WARN_LEGACY = False

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = required,  # type: ignore[assignment]
        momentum: float = 0.999,
        nu: float = 0.7,
        weight_decay: float = 0.0,
        weight_decay_type: str | None = None,
        **kwargs: Any,
    ) -> None:
        # None: 1.1.0's "grad", unless decoupled_weight_decay says otherwise.
        if weight_decay_type is not None:
            kwargs["weight_decay_type"] = weight_decay_type
        super().__init__(params, lr, momentum, nu, weight_decay, **kwargs)


class QHAdam(_torch.QHAdam):
    """:class:`qhoptim.torch.QHAdam` with qhoptim 1.1.0's signature."""

    _WARN_LEGACY = False

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        nus: tuple[float, float] = (1.0, 1.0),
        weight_decay: float = 0.0,
        decouple_weight_decay: bool | None = None,
        eps: float = 1e-8,
        **kwargs: Any,
    ) -> None:
        # None: 1.1.0's False, unless decoupled_weight_decay says otherwise.
        if decouple_weight_decay is not None:
            kwargs["decouple_weight_decay"] = decouple_weight_decay
        super().__init__(params, lr, betas, nus, weight_decay, eps=eps, **kwargs)


class QHAdamW(_torch.QHAdamW):
    """:class:`qhoptim.torch.QHAdamW` with qhoptim 1.1.0's default ``weight_decay=0``."""

    _WARN_LEGACY = False

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        nus: tuple[float, float] = (1.0, 1.0),
        weight_decay: float = 0.0,
        eps: float = 1e-8,
        **kwargs: Any,
    ) -> None:
        super().__init__(params, lr, betas, nus, weight_decay, eps, **kwargs)
