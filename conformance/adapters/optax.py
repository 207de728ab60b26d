"""Adapter for ``qhoptim.optax``: the public aliases, jitted, closed loop.

float64 runs need ``jax_enable_x64``; it is switched on when this adapter is
loaded (the conformance process owns its JAX configuration). float32 runs are
traced with x64 *off*, as a float32 user runs JAX: the step count and the bias
corrections are then float32 too (with x64 on they would silently be float64,
and the float32 rows would not test the float32 path).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import qhoptim.optax as qho  # noqa: E402
from qhoptim import rules  # noqa: E402

from ..cases import Case  # noqa: E402
from . import closed_loop  # noqa: E402

# optax's Muon adds its epsilon to the norm Newton-Schulz divides by.
QHMUON_EPS = inspect.signature(qho.qhmuon).parameters["eps"].default


def make_transformation(
    case: Case, learning_rate: Any, **options: Any
) -> optax.GradientTransformation:
    """The optax optimizer a user would write for ``case`` (weight decay included);
    ``options`` (``state_dtype``, ...) go to qhoptim's transformation."""
    hp, mode = case.hparams, case.weight_decay_mode
    wd = hp.get("weight_decay", 0.0)
    if case.optimizer == "qhmuon":
        return qho.qhmuon(
            learning_rate,
            ns_steps=hp.get("ns_steps", rules.MUON_NS_STEPS),
            beta=hp["momentum"],
            weight_decay=wd,
            nu=hp["nu"],
            # optax's own scale (fan_in, fan_out layout) unless the case asks for RMS matching
            consistent_rms=0.2 if hp.get("adjust_lr_fn") == "match_rms_adamw" else None,
            **options,
        )
    if case.optimizer == "qhm":
        if mode == "decoupled":
            return optax.chain(
                qho.scale_by_qhm(hp["momentum"], hp["nu"], **options),
                optax.add_decayed_weights(wd),
                optax.scale_by_learning_rate(learning_rate),
            )
        tx = qho.qhm(learning_rate, hp["momentum"], hp["nu"], **options)
    else:
        (b1, b2), (nu1, nu2) = hp["betas"], hp["nus"]
        ams = {"amsgrad": case.amsgrad, **options}
        if mode == "decoupled":
            return qho.qhadamw(learning_rate, b1, b2, nu1, nu2, hp["eps"], weight_decay=wd, **ams)
        tx = qho.qhadam(learning_rate, b1, b2, nu1, nu2, hp["eps"], **ams)
    return optax.chain(optax.add_decayed_weights(wd), tx) if mode == "coupled" else tx


def x64(enabled: bool) -> contextlib.AbstractContextManager[Any]:
    """A context in which ``jax_enable_x64`` is ``enabled``."""
    if hasattr(jax, "enable_x64"):
        context: contextlib.AbstractContextManager[Any] = jax.enable_x64(enabled)
    else:  # older jax
        from jax import experimental

        context = experimental.enable_x64() if enabled else experimental.disable_x64()
    return context


class OptaxAdapter:
    name = "optax"

    def available(self) -> bool:
        return True

    def supports(self, case: Case, dtype: str) -> bool:
        return dtype in ("float32", "float64")

    def reference_options(self, case: Case) -> dict[str, Any]:
        if case.optimizer != "qhmuon":
            return {}
        # optax.contrib.muon's form: bias-corrected momentum, ||U|| + eps, (fan_in, fan_out).
        return {
            "norm_guard": "add",
            "eps": QHMUON_EPS,
            "bias_corrected": True,
            "fan_in_first": True,
        }

    def run(self, case: Case, dtype: str) -> np.ndarray:
        with x64(dtype == "float64"):
            return self._run(case, dtype)

    def _run(self, case: Case, dtype: str) -> np.ndarray:
        lrs = jnp.asarray(case.lrs, dtype=dtype)
        tx = make_transformation(case, lambda count: lrs[count])
        update = jax.jit(tx.update)

        def make(params: list[jax.Array]) -> dict[str, Any]:
            return {"state": tx.init(params)}

        def step(h: dict[str, Any], params: list[Any], grads: list[Any], lr: float) -> Any:
            updates, h["state"] = update(grads, h["state"], params)
            return optax.apply_updates(params, updates)

        return closed_loop(
            case,
            to_backend=lambda a: jnp.asarray(a, dtype=dtype),
            to_numpy=np.asarray,
            make=make,
            step=step,
        )
