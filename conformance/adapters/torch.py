"""The torch adapters: :mod:`qhoptim.torch` driven through every case.

``TorchAdapter`` takes the per-tensor implementation (``foreach=False``),
``TorchForeachAdapter`` the multi-tensor one (``foreach=True``) and
``TorchFusedAdapter`` the fused one (``fused=True``) and ``TorchTritonAdapter``
the fused one through the CUDA (Triton) kernels, on CPU under Triton's
interpreter (``TRITON_INTERPRET=1``); all run in float32 and float64. Each
step writes the case's learning rate into the param group (as an lr scheduler
does), sets ``p.grad`` and calls ``optimizer.step()``.

QHMuon has one implementation (torch's Muon's, per matrix): ``TorchAdapter``
runs its cases, with Newton-Schulz in the run's dtype (``ns_dtype``; torch's
Muon's bfloat16 would round far past either tolerance); its form is the
reference's default.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..cases import Case
from . import closed_loop

__all__ = ["TorchAdapter", "TorchForeachAdapter", "TorchFusedAdapter", "TorchTritonAdapter"]


def _optimizer(case: Case, params: list[Any], implementation: dict[str, bool]) -> Any:
    from qhoptim.torch import QHM, QHAdam, QHAdamW, QHMuon

    hp = case.hparams
    if case.optimizer == "qhmuon":
        return QHMuon(params, **{"weight_decay": 0.0, **hp}, ns_dtype=params[0].dtype)
    wd = hp.get("weight_decay", 0.0)
    decoupled = case.weight_decay_mode == "decoupled"
    if case.optimizer == "qhm":
        return QHM(
            params,
            lr=hp["lr"],
            momentum=hp["momentum"],
            nu=hp["nu"],
            weight_decay=wd,
            decoupled_weight_decay=decoupled,
            **implementation,
        )
    common = {
        "lr": hp["lr"],
        "betas": tuple(hp["betas"]),
        "nus": tuple(hp["nus"]),
        "eps": hp["eps"],
        "weight_decay": wd,
        "amsgrad": case.amsgrad,
        **implementation,
    }
    if case.optimizer == "qhadamw":
        return QHAdamW(params, **common)
    return QHAdam(params, decoupled_weight_decay=decoupled, **common)


class TorchAdapter:
    name = "torch"
    implementation: dict[str, bool] = {"foreach": False}  # noqa: RUF012 (read only)
    # QHMuon's one implementation runs under this adapter alone.
    steps_qhmuon = True

    def available(self) -> bool:
        try:
            import torch  # noqa: F401

            import qhoptim.torch  # noqa: F401
        except ImportError:
            return False
        return True

    def supports(self, case: Case, dtype: str) -> bool:
        muon = case.optimizer == "qhmuon"
        return dtype in ("float32", "float64") and (self.steps_qhmuon or not muon)

    def reference_options(self, case: Case) -> dict[str, Any]:
        return {}

    def run(self, case: Case, dtype: str) -> np.ndarray:
        import torch

        torch_dtype = getattr(torch, dtype)

        def step(opt: Any, params: list[Any], grads: list[Any], lr: float) -> list[Any]:
            for group in opt.param_groups:
                group["lr"] = lr
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            opt.step()
            return params

        return closed_loop(
            case,
            to_backend=lambda a: torch.tensor(np.asarray(a), dtype=torch_dtype),
            to_numpy=lambda t: t.detach().numpy().astype(np.float64),
            make=lambda params: _optimizer(case, params, self.implementation),
            step=step,
        )


class TorchForeachAdapter(TorchAdapter):
    name = "torch-foreach"
    implementation = {"foreach": True}  # noqa: RUF012
    steps_qhmuon = False


class TorchFusedAdapter(TorchAdapter):
    name = "torch-fused"
    implementation = {"fused": True}  # noqa: RUF012
    steps_qhmuon = False


class TorchTritonAdapter(TorchAdapter):
    """``fused=True`` on CPU tensors under ``TRITON_INTERPRET=1``: the Triton kernels
    that CUDA tensors step in, run by Triton's interpreter (NumPy, on CPU)."""

    name = "torch-triton"
    implementation = {"fused": True}  # noqa: RUF012
    steps_qhmuon = False

    def available(self) -> bool:
        import importlib.util
        import os

        interpreting = os.environ.get("TRITON_INTERPRET") == "1"
        return (
            interpreting and importlib.util.find_spec("triton") is not None and super().available()
        )

    def run(self, case: Case, dtype: str) -> np.ndarray:
        from ..triton_interpreter import skip_repeated_patching

        skip_repeated_patching()  # the same kernels, interpreted in half the time
        return super().run(case, dtype)
