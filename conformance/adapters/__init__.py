"""Backend adapters: each drives one backend through a case, closed loop.

An adapter is an object with

- ``name``: the backend label printed in the table (``numpy``, ``torch``, ...);
- ``available() -> bool``: whether its framework can be imported here;
- ``supports(case, dtype) -> bool``;
- ``run(case, dtype) -> ndarray``: the parameter trajectory, shape
  ``(steps + 1, n)`` in float64, row 0 being the initial point as the backend
  stores it;
- ``reference_options(case) -> dict``: what the reference must be told to step
  as this backend does where frameworks differ by design -- QHMuon's form of its
  framework's Muon (``qhoptim.reference.QHMuon``'s ``norm_guard``, ``eps``,
  ``bias_corrected``, ...); empty where the backend follows the core's form.

:func:`closed_loop` is the shared driver: gradients are computed by the
problem's oracle at the backend's *current* parameters, cast to the backend's
dtype, and fed to its optimizer with the case's per-step learning rate.

Adapters are registered by dotted path so that listing them imports no
framework; backends add themselves to :data:`REGISTRY`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from ..cases import Case

__all__ = ["REGISTRY", "Adapter", "closed_loop", "load_adapter"]

REGISTRY: dict[str, str] = {
    "numpy": "conformance.adapters.numpy_rules:NumpyAdapter",
    "torch": "conformance.adapters.torch:TorchAdapter",
    "torch-foreach": "conformance.adapters.torch:TorchForeachAdapter",
    "torch-fused": "conformance.adapters.torch:TorchFusedAdapter",
    "torch-triton": "conformance.adapters.torch:TorchTritonAdapter",
    "optax": "conformance.adapters.optax:OptaxAdapter",
    "keras": "conformance.adapters.keras:KerasAdapter",
    "mlx": "conformance.adapters.mlx:MLXAdapter",
    "mlx-fused": "conformance.adapters.mlx:MLXFusedAdapter",
}


class Adapter(Protocol):
    name: str

    def available(self) -> bool: ...

    def supports(self, case: Case, dtype: str) -> bool: ...

    def run(self, case: Case, dtype: str) -> np.ndarray: ...

    def reference_options(self, case: Case) -> dict[str, Any]: ...


def load_adapter(name: str) -> Adapter:
    try:
        module_name, _, attr = REGISTRY[name].partition(":")
    except KeyError:
        raise KeyError(f"unknown backend {name!r}; known: {', '.join(REGISTRY)}") from None
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and e.name.startswith("conformance"):
            raise
        return _Unavailable(name, str(e))
    adapter: Adapter = getattr(module, attr)()
    return adapter


class _Unavailable:
    def __init__(self, name: str, reason: str) -> None:
        self.name, self.reason = name, reason

    def available(self) -> bool:
        return False

    def supports(self, case: Case, dtype: str) -> bool:
        return False

    def run(self, case: Case, dtype: str) -> np.ndarray:  # pragma: no cover
        raise RuntimeError(self.reason)

    def reference_options(self, case: Case) -> dict[str, Any]:  # pragma: no cover
        return {}


def closed_loop(
    case: Case,
    *,
    to_backend: Callable[[np.ndarray], Any],
    to_numpy: Callable[[Any], np.ndarray],
    make: Callable[[list[Any]], Any],
    step: Callable[[Any, list[Any], list[Any], float], Sequence[Any]],
) -> np.ndarray:
    """Drive a backend optimizer through ``case``; return its trajectory.

    Args:
      to_backend: float64 ndarray -> backend array in the run's dtype.
      to_numpy: backend array -> ndarray.
      make: initial backend params -> optimizer handle (any object).
      step: ``(handle, params, grads, lr) -> new params`` (may update in place
        and return ``params``).
    """
    problem = case.problem
    params = [to_backend(p) for p in problem.split(problem.x0)]
    handle = make(params)
    x = problem.join([to_numpy(p) for p in params])
    trajectory = [x]
    for t, lr in enumerate(case.lrs):
        grads = [to_backend(g) for g in problem.split(problem.grad(x, t))]
        params = list(step(handle, params, grads, lr))
        x = problem.join([to_numpy(p) for p in params])
        trajectory.append(x)
    return np.stack(trajectory)
