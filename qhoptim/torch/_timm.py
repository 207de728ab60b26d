"""QHM, QHAdam and QHAdamW in timm's optimizer factory, by name.

timm (``pytorch-image-models``) builds optimizers by name through a registry
of :class:`timm.optim.OptimInfo` entries; :func:`register_with_timm` adds
qhoptim's three. timm is imported only when it is called: importing
:mod:`qhoptim.torch` never imports timm.
"""

from __future__ import annotations

import importlib
from typing import Any

from qhoptim.torch._qhadam import QHAdam, QHAdamW
from qhoptim.torch._qhm import QHM

__all__ = ["register_with_timm"]

# name -> (class, description, has_momentum, has_betas)
_ENTRIES: dict[str, tuple[type, str, bool, bool]] = {
    "qhm": (
        QHM,
        "Quasi-hyperbolic momentum: a nu-weighted average of the plain SGD step and "
        "the momentum step (Ma & Yarats, ICLR 2019)",
        True,
        False,
    ),
    "qhadam": (
        QHAdam,
        "Quasi-hyperbolic Adam, L2 weight decay added to the gradient (Ma & Yarats, ICLR 2019)",
        False,
        True,
    ),
    "qhadamw": (
        QHAdamW,
        "Quasi-hyperbolic Adam with decoupled (AdamW-style) weight decay",
        False,
        True,
    ),
}


def register_with_timm(registry: Any = None) -> list[str]:
    """Make ``"qhm"``, ``"qhadam"`` and ``"qhadamw"`` names timm's factory knows.

    After one call, ``timm.optim.create_optimizer_v2(model, opt="qhadamw",
    lr=1e-3, weight_decay=0.05)`` builds :class:`~qhoptim.torch.QHAdamW` with
    timm's parameter groups (no weight decay on biases and normalization
    weights, nor on the model's ``no_weight_decay()`` names), and timm's
    ``train.py --opt qhadamw`` works too (``lookahead_qhadam`` as well).

    timm passes its own arguments: ``weight_decay`` (default 0), ``momentum``
    to QHM (timm's default 0.9, as for SGD; the paper's recommendation is
    ``momentum=0.999`` with ``nu=0.7``, QHM's own defaults, so pass
    ``momentum=0.999`` for it), ``eps`` and ``betas`` to QHAdam(W), and
    ``foreach`` when given. Other keyword arguments (``nu``, ``nus``,
    ``fused``, ...) go to the optimizer unchanged.

    Args:
      registry: a :class:`timm.optim.OptimizerRegistry` to register in; by
        default timm's own, the one ``create_optimizer_v2`` reads.

    Returns:
      The names registered.

    Raises:
      ImportError: timm is not installed, or is older than 1.0.12 (the first
        release with an optimizer registry).
    """
    try:
        # By name: timm is optional and untyped, and this module is checked without it.
        timm_optim = importlib.import_module("timm.optim")
    except ImportError as error:
        raise ImportError(
            "register_with_timm needs timm, which is not installed: `pip install timm`"
        ) from error
    if not hasattr(timm_optim, "OptimInfo"):
        version = getattr(importlib.import_module("timm"), "__version__", "?")
        raise ImportError(
            f"register_with_timm needs timm >= 1.0.12 (its optimizer registry); "
            f"timm {version} is installed: `pip install -U timm`"
        )
    if registry is None:
        # timm's module-level registry: create_optimizer_v2 and list_optimizers
        # read it, and timm has no public function to add to it.
        registry = importlib.import_module("timm.optim._optim_factory").default_registry
    for name, (cls, description, has_momentum, has_betas) in _ENTRIES.items():
        registry.register(
            timm_optim.OptimInfo(
                name=name,
                opt_class=cls,
                description=description,
                has_eps=has_betas,  # QHM has no eps; timm drops one passed to it
                has_momentum=has_momentum,
                has_betas=has_betas,
            )
        )
    return list(_ENTRIES)
