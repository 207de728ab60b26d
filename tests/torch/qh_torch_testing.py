"""Helpers shared by the torch backend's tests: reference runs and qhoptim 1.1.0."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.torch_step import load_qhoptim_110
from qhoptim import reference
from qhoptim.torch import QHM, QHAdam, QHAdamW


def reference_optimizer(cls: type, kwargs: dict[str, Any]) -> Any:
    """The float64 reference optimizer with the same hyperparameters as ``cls(**kwargs)``."""
    kw = dict(kwargs)
    for flag in ("foreach", "maximize", "capturable", "differentiable"):
        kw.pop(flag, None)
    if isinstance(kw.get("lr"), torch.Tensor):
        kw["lr"] = float(kw["lr"])
    # qhoptim 1.1.0's spellings (qhoptim.pyt's signatures)
    if "weight_decay_type" in kw:
        kw["decoupled_weight_decay"] = kw.pop("weight_decay_type") == "direct"
    if "decouple_weight_decay" in kw:
        kw["decoupled_weight_decay"] = kw.pop("decouple_weight_decay")
    if issubclass(cls, QHM):
        return reference.QHM(**kw)
    if issubclass(cls, QHAdamW):
        default = inspect.signature(cls).parameters["weight_decay"].default
        return reference.QHAdamW(**{"weight_decay": default, **kw})
    assert issubclass(cls, QHAdam)
    return reference.QHAdam(**kw)


def reference_trajectory(
    cls: type,
    kwargs: dict[str, Any],
    params0: Sequence[torch.Tensor],
    grads: Sequence[Sequence[torch.Tensor | None]],
    lrs: Sequence[float] | None = None,
    *,
    maximize: bool = False,
) -> list[list[np.ndarray]]:
    """Run the reference on fixed gradient sequences; ``grads[t][i]`` None skips param i."""
    opt = reference_optimizer(cls, kwargs)
    xs = [p.detach().numpy().copy() for p in params0]
    states = [opt.init(x) for x in xs]
    out = []
    for t, step_grads in enumerate(grads):
        for i, g in enumerate(step_grads):
            if g is None:
                continue
            g = -g.numpy() if maximize else g.numpy()
            lr = None if lrs is None else lrs[t]
            xs[i], states[i] = opt.step(xs[i], g, states[i], lr)
        out.append([x.copy() for x in xs])
    return out


def run_torch(
    opt: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    grads: Sequence[Sequence[torch.Tensor | None]],
    after_step: Callable[[int], None] | None = None,
) -> list[list[np.ndarray]]:
    """Step ``opt`` with the given gradients; return the params after each step."""
    out = []
    for t, step_grads in enumerate(grads):
        for p, g in zip(params, step_grads, strict=True):
            p.grad = None if g is None else g.clone()
        opt.step()
        if after_step is not None:
            after_step(t)
        out.append([p.detach().numpy().copy() for p in params])
    return out


def assert_trajectories_close(
    got: list[list[np.ndarray]], want: list[list[np.ndarray]], rtol: float = 1e-12
) -> None:
    assert len(got) == len(want)
    for t, (g_step, w_step) in enumerate(zip(got, want, strict=True)):
        for i, (g, w) in enumerate(zip(g_step, w_step, strict=True)):
            scale = max(1.0, float(np.max(np.abs(w), initial=0.0)))
            err = float(np.max(np.abs(g - w), initial=0.0)) / scale
            assert err <= rtol, f"step {t}, param {i}: relative deviation {err:.3e} > {rtol:.0e}"


def random_grads(
    shapes: Sequence[tuple[int, ...]], steps: int, dtype: torch.dtype = torch.float64, seed: int = 0
) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen, dtype=dtype) for s in shapes] for _ in range(steps)]


# ------------------------------------------------------------------- qhoptim 1.1.0
_QH110_CACHE: dict[Path, Any] = {}


def install_qhoptim_110(target: Path) -> Any:
    """pip-install qhoptim 1.1.0 into ``target`` and return its ``pyt`` module.

    Loaded under the name ``qhoptim_1_1_0`` (its imports are relative), so it
    lives beside this repository's ``qhoptim``. Raises ``RuntimeError`` when pip
    fails. Offline, point ``QHOPTIM_110_TARGET`` at a directory it was
    installed into (``pip install --no-deps --target DIR qhoptim==1.1.0``).
    """
    if os.environ.get("QHOPTIM_110_TARGET"):
        target = Path(os.environ["QHOPTIM_110_TARGET"])
    if target in _QH110_CACHE:
        return _QH110_CACHE[target]
    root = target / "qhoptim"
    if not (root / "pyt" / "qhm.py").exists():
        pip = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        proc = subprocess.run(
            [*pip, "--no-deps", "--target", str(target), "qhoptim==1.1.0"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if proc.returncode != 0 or not (root / "pyt" / "qhm.py").exists():
            raise RuntimeError(
                f"pip could not install qhoptim==1.1.0: {proc.stderr.strip()[-500:]}"
            )
    pyt = load_qhoptim_110(target)
    _QH110_CACHE[target] = pyt
    return pyt
