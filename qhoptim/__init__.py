"""qhoptim: quasi-hyperbolic optimizers (QHM, QHAdam, QHAdamW).

The package root imports no ML framework. The framework-neutral core is:

- :mod:`qhoptim.rules` -- the update rules and their scalar coefficients;
- :mod:`qhoptim.validation` -- hyperparameter checks shared by every backend;
- :mod:`qhoptim.convert` -- conversions from other optimizers to QHM/QHAdam;
- :mod:`qhoptim.analysis` -- QHAdam's update bound, QHWMA variance factor;
- :mod:`qhoptim.reference` -- float64 NumPy reference optimizers;
- :mod:`qhoptim.common` -- qhoptim 1.1.0's ``param_conv``, on top of ``convert``.

Backends live in ``qhoptim.torch``, ``qhoptim.keras``, ``qhoptim.optax`` and
``qhoptim.mlx`` and import only their own framework.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "2.0.0.dev0"

__all__ = ["__version__", "analysis", "common", "convert", "reference", "rules", "validation"]

_CORE = frozenset({"analysis", "common", "convert", "reference", "rules", "validation"})


def __getattr__(name: str) -> Any:
    # Core submodules load on first use so that ``import qhoptim`` stays cheap
    # (``reference`` and ``analysis`` pull in NumPy). Backends are never loaded
    # implicitly: ``import qhoptim.torch`` is an explicit choice of framework.
    if name in _CORE:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _CORE)
