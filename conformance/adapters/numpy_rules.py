"""The plain-NumPy adapter: the core rules applied per tensor in the run's dtype.

It is the smallest possible backend -- what a new framework's adapter looks
like before any fast path -- and exercises the harness in float32 as well as
float64.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from qhoptim import reference, rules

from ..cases import Case
from . import closed_loop


class _NumpyOptimizer:
    def __init__(self, case: Case, params: list[np.ndarray]) -> None:
        self.case = case
        self.hp = case.hparams
        self.step_count = 0
        if case.optimizer in ("qhm", "qhmuon"):
            self.buffers = [np.zeros_like(p) for p in params]
        else:
            self.exp_avg = [np.zeros_like(p) for p in params]
            self.exp_avg_sq = [np.zeros_like(p) for p in params]
            self.max_exp_avg_sq = [np.zeros_like(p) for p in params]

    def step(self, params: list[np.ndarray], grads: list[np.ndarray], lr: float) -> list[Any]:
        if self.case.optimizer == "qhmuon":
            return self._qhmuon_step(params, grads, lr)
        hp, mode = self.hp, self.case.weight_decay_mode
        self.step_count += 1
        if self.case.optimizer != "qhm":
            b1, b2 = hp["betas"]
            bc1 = rules.bias_correction(b1, self.step_count)
            bc2 = rules.bias_correction(b2, self.step_count)
        out = []
        for i, (p, g) in enumerate(zip(params, grads, strict=True)):
            decay: Any = 1
            if mode != "none":
                g, decay = rules.weight_decay_terms(
                    g, p, lr=lr, weight_decay=hp["weight_decay"], decoupled=mode == "decoupled"
                )
            if self.case.optimizer == "qhm":
                self.buffers[i], update = rules.qhm_update(
                    g, self.buffers[i], momentum=hp["momentum"], nu=hp["nu"]
                )
            else:
                hparams = dict(
                    beta1=b1,
                    beta2=b2,
                    nu1=hp["nus"][0],
                    nu2=hp["nus"][1],
                    eps=hp["eps"],
                    bias_correction1=bc1,
                    bias_correction2=bc2,
                    sqrt=np.sqrt,
                )
                m, s = self.exp_avg[i], self.exp_avg_sq[i]
                if self.case.amsgrad:
                    m, s, self.max_exp_avg_sq[i], update = rules.qhadam_amsgrad_update(
                        g, m, s, self.max_exp_avg_sq[i], maximum=np.maximum, **hparams
                    )
                else:
                    m, s, update = rules.qhadam_update(g, m, s, **hparams)
                self.exp_avg[i], self.exp_avg_sq[i] = m, s
            out.append(rules.apply_update(p, update, lr, decay).astype(p.dtype, copy=False))
        return out

    def _qhmuon_step(
        self, params: list[np.ndarray], grads: list[np.ndarray], lr: float
    ) -> list[Any]:
        # torch's Muon's form (the reference's defaults): decoupled decay, the
        # norm floored at eps, the (fan_out, fan_in) layout.
        hp = self.hp
        decay = rules.decoupled_decay_factor(lr, hp.get("weight_decay", 0.0))
        out = []
        for i, (p, g) in enumerate(zip(params, grads, strict=True)):
            self.buffers[i], direction = rules.qhm_update(
                g, self.buffers[i], momentum=hp["momentum"], nu=hp["nu"]
            )
            rows, columns = p.shape
            update = rules.newton_schulz(
                direction,
                rows=rows,
                columns=columns,
                ops=reference.NUMPY_MATRIX_OPS,
                steps=hp.get("ns_steps", rules.MUON_NS_STEPS),
            )
            ratio = rules.muon_lr_ratio(hp.get("adjust_lr_fn"), rows, columns)
            out.append(rules.apply_update(p, update, lr * ratio, decay).astype(p.dtype, copy=False))
        return out


class NumpyAdapter:
    name = "numpy"

    def available(self) -> bool:
        return True

    def supports(self, case: Case, dtype: str) -> bool:
        return dtype in ("float32", "float64")

    def reference_options(self, case: Case) -> dict[str, Any]:
        return {}

    def run(self, case: Case, dtype: str) -> np.ndarray:
        return closed_loop(
            case,
            to_backend=lambda a: np.asarray(a, dtype=dtype),
            to_numpy=np.asarray,
            make=lambda params: _NumpyOptimizer(case, params),
            step=lambda opt, params, grads, lr: opt.step(params, grads, lr),
        )
