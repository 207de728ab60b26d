"""Adapter for ``qhoptim.mlx``: the MLX optimizers, eager ``apply_gradients``, closed loop.

Every run is on MLX's CPU stream (float64 exists only there). ``mlx`` steps
with MLX's operations (``fused=False``), ``mlx-fused`` in the C++ step
(``fused=True``, float32). The per-step
learning rate is a schedule indexing the case's ``lrs`` with the optimizer's
step, as an ``mx.array`` in the run's dtype: a Python float would become a
float32 ``mx.array`` (MLX's convention) and round a float64 run's learning rate.

Weight decay: coupled cases use ``weight_decay``, decoupled ones
``decoupled_weight_decay=True`` (QHM, QHAdam) or :class:`qhoptim.mlx.QHAdamW`.

QHMuon is MLX's Muon's form: coupled weight decay, ``||U|| + eps``, the shape's
ratio ``sqrt(max(1, rows / columns))`` (no other scale: cases that ask for one
are not MLX's), Newton-Schulz in the run's dtype (``ns_dtype``).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np

import qhoptim.mlx as qhmlx
from qhoptim import rules

from ..cases import Case
from . import closed_loop

DTYPES = {"float32": mx.float32, "float64": mx.float64}


def make_optimizer(case: Case, learning_rate: Any, **options: Any) -> optim.Optimizer:
    """The MLX optimizer a user would write for ``case`` (weight decay included);
    ``options`` (``state_dtype``, ``ns_dtype``, ...) are passed on."""
    hp, mode = case.hparams, case.weight_decay_mode
    if case.optimizer == "qhmuon":
        return qhmlx.QHMuon(
            learning_rate,
            hp["momentum"],
            hp["nu"],
            weight_decay=hp.get("weight_decay", 0.0),
            ns_steps=hp.get("ns_steps", rules.MUON_NS_STEPS),
            **options,
        )
    decay = {"weight_decay": hp.get("weight_decay", 0.0)} if mode != "none" else {}
    if mode == "decoupled" and case.optimizer != "qhadamw":
        decay["decoupled_weight_decay"] = True
    if case.optimizer == "qhm":
        return qhmlx.QHM(learning_rate, hp["momentum"], hp["nu"], **decay, **options)
    cls = qhmlx.QHAdamW if case.optimizer == "qhadamw" else qhmlx.QHAdam
    betas, nus = tuple(hp["betas"]), tuple(hp["nus"])
    return cls(learning_rate, betas, nus, hp["eps"], **decay, amsgrad=case.amsgrad, **options)


class MLXAdapter:
    name = "mlx"
    fused = False  # MLX's operations

    def available(self) -> bool:
        return True

    def supports(self, case: Case, dtype: str) -> bool:
        muon_scale = case.hparams.get("adjust_lr_fn")
        if case.optimizer == "qhmuon" and muon_scale not in (None, "original"):
            return False
        return dtype in DTYPES

    def reference_options(self, case: Case) -> dict[str, Any]:
        if case.optimizer != "qhmuon":
            return {}
        return {"norm_guard": "add", "decoupled_weight_decay": False}

    def run(self, case: Case, dtype: str) -> np.ndarray:
        with mx.stream(mx.cpu):
            return self._run(case, DTYPES[dtype])

    def _run(self, case: Case, dtype: mx.Dtype) -> np.ndarray:
        lrs = mx.array(np.asarray(case.lrs, dtype=np.float64), dtype=dtype)
        if case.optimizer == "qhmuon":
            options: dict[str, Any] = {"ns_dtype": dtype}
        else:
            options = {"fused": self.fused}
        opt = make_optimizer(case, lambda step: lrs[step], **options)

        def step(o: Any, params: list[mx.array], grads: list[mx.array], lr: float) -> Any:
            del lr  # the schedule supplies it
            # MLX's optimizer state is a dict at the top: name the parameters.
            named = {f"p{i}": (g, p) for i, (g, p) in enumerate(zip(grads, params, strict=True))}
            tree = o.apply_gradients(
                {k: g for k, (g, _) in named.items()}, {k: p for k, (_, p) in named.items()}
            )
            mx.eval(tree, o.state)
            return [tree[k] for k in named]

        return closed_loop(
            case,
            to_backend=lambda a: mx.array(np.asarray(a, dtype=np.float64), dtype=dtype),
            to_numpy=lambda a: np.array(a, dtype=np.float64),
            make=lambda params: opt,
            step=step,
        )


class MLXFusedAdapter(MLXAdapter):
    """``fused=True``: the C++ step (float32 parameters; QHM, QHAdam, QHAdamW)."""

    name = "mlx-fused"
    fused = True

    def available(self) -> bool:
        from qhoptim.mlx import _extension

        return _extension.fused_extension_available()

    def supports(self, case: Case, dtype: str) -> bool:
        return dtype == "float32" and case.optimizer != "qhmuon"
