"""Adapter for ``qhoptim.keras``: the Keras 3 optimizers, closed loop, on the active backend.

The backend is Keras's (``KERAS_BACKEND``); the row label says which, e.g.
``keras-tensorflow``. Each step runs the way training runs on that backend:

* TensorFlow: ``optimizer.apply`` inside a ``tf.function`` (graph mode, as
  ``model.fit`` runs it on CPU);
* JAX: ``optimizer.stateless_apply`` under ``jax.jit`` (as ``model.fit`` does);
* torch: ``optimizer.apply`` eagerly under ``torch.no_grad()`` (as ``model.fit`` does).

The per-step learning rate is a ``LearningRateSchedule`` indexing the case's
``lrs`` with the optimizer's iteration count, in the run's dtype (Keras's own
learning-rate *variable* is ``floatx``, float32, which would round a float64
run's learning rate).

Weight decay: decoupled cases use the optimizers' ``weight_decay`` (Keras's
decoupled decay). Keras optimizers have no coupled (L2) weight decay -- Keras
expresses it with layer regularizers, which add ``weight_decay * param`` to the
gradient -- so coupled cases add ``weight_decay * param`` to the gradient here,
before ``apply``, exactly what a regularizer's gradient contributes.

QHMuon runs in float32 only, as Keras's Muon does (its shape scaling is a
float32 tensor, which TensorFlow refuses beside a float64 variable, and Keras on
torch multiplies float64 matrices in float32), with Keras's Muon's own scale
(``rms_rate=0.2``, :func:`qhoptim.rules.muon_lr_ratio`'s ``"match_rms_adamw"``):
cases that ask for another scale are not Keras's; nor are any with a Keras older
than 3.13, whose Muon QHMuon cannot build on.

float64 runs on JAX need ``jax_enable_x64``; it is switched on when this adapter
is loaded with the JAX backend (the conformance process owns its JAX configuration).
"""

from __future__ import annotations

from typing import Any

import keras

BACKEND = keras.backend.backend()
if BACKEND == "jax":
    import jax

    jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402
from keras import ops  # noqa: E402

import qhoptim.keras as qk  # noqa: E402
from qhoptim import rules  # noqa: E402

from ..cases import Case  # noqa: E402
from . import closed_loop  # noqa: E402

# Keras's Muon: the trace m = beta m + g, ||U|| + 1e-7, (fan_in, fan_out), rms_rate 0.2.
QHMUON_REFERENCE_OPTIONS = {
    "norm_guard": "add",
    "eps": qk._qhmuon.KERAS_MUON_NORM_EPS,
    "unnormalized_buffer": True,
    "fan_in_first": True,
    "adjust_lr_fn": "match_rms_adamw",
    "rms": 0.2,
}


class PerStepLearningRate(keras.optimizers.schedules.LearningRateSchedule):
    """``lrs[step]`` in a fixed dtype: a case's learning-rate sequence as a Keras schedule."""

    def __init__(self, lrs: list[float], dtype: str) -> None:
        self.lrs = ops.convert_to_tensor(np.asarray(lrs, dtype=np.float64), dtype=dtype)

    def __call__(self, step: Any) -> Any:
        return ops.take(self.lrs, step)


def make_optimizer(case: Case, learning_rate: Any) -> keras.optimizers.Optimizer:
    """The Keras optimizer for ``case`` (decoupled decay included; coupled decay is not)."""
    hp, mode = case.hparams, case.weight_decay_mode
    if case.optimizer == "qhmuon":
        return qk.QHMuon(
            learning_rate,
            momentum=hp["momentum"],
            nu=hp["nu"],
            weight_decay=hp.get("weight_decay", 0.0),
            ns_steps=hp.get("ns_steps", rules.MUON_NS_STEPS),
            rms_rate=QHMUON_REFERENCE_OPTIONS["rms"],
        )
    wd = hp["weight_decay"] if mode == "decoupled" else None
    if case.optimizer == "qhm":
        return qk.QHM(learning_rate, momentum=hp["momentum"], nu=hp["nu"], weight_decay=wd)
    (b1, b2), (nu1, nu2) = hp["betas"], hp["nus"]
    kwargs = dict(beta_1=b1, beta_2=b2, nu_1=nu1, nu_2=nu2, epsilon=hp["eps"], amsgrad=case.amsgrad)
    if case.optimizer == "qhadamw":
        return qk.QHAdamW(learning_rate, weight_decay=wd, **kwargs)
    return qk.QHAdam(learning_rate, weight_decay=wd, **kwargs)


def _stepper(opt: keras.optimizers.Optimizer, variables: list[keras.Variable]) -> Any:
    """``grads -> new params`` the way ``model.fit`` applies gradients on this backend."""
    opt.build(variables)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        apply = tf.function(opt.apply, jit_compile=False)

        def step(grads: list[Any]) -> list[Any]:
            apply(grads)
            return [ops.convert_to_tensor(v) for v in variables]

        return step
    if BACKEND == "jax":
        stateless_apply = jax.jit(opt.stateless_apply)
        state = {
            "params": [v.value for v in variables],
            "opt": [v.value for v in opt.variables],
        }

        def step(grads: list[Any]) -> list[Any]:
            state["params"], state["opt"] = stateless_apply(state["opt"], grads, state["params"])
            return state["params"]

        return step
    import torch

    def step(grads: list[Any]) -> list[Any]:
        with torch.no_grad():
            opt.apply(grads)
        return [ops.convert_to_tensor(v) for v in variables]

    return step


class KerasAdapter:
    name = f"keras-{BACKEND}"

    def available(self) -> bool:
        return True

    def supports(self, case: Case, dtype: str) -> bool:
        if case.optimizer == "qhmuon":
            adjust = case.hparams.get("adjust_lr_fn")
            return (
                dtype == "float32"
                and adjust in (None, QHMUON_REFERENCE_OPTIONS["adjust_lr_fn"])
                and qk._qhmuon._muon_keeps_a_slot_per_index()
            )
        return dtype in ("float32", "float64")

    def reference_options(self, case: Case) -> dict[str, Any]:
        return dict(QHMUON_REFERENCE_OPTIONS) if case.optimizer == "qhmuon" else {}

    def run(self, case: Case, dtype: str) -> np.ndarray:
        opt = make_optimizer(case, PerStepLearningRate(case.lrs, dtype))
        coupled = case.hparams["weight_decay"] if case.weight_decay_mode == "coupled" else None

        def make(params: list[Any]) -> Any:
            return _stepper(opt, [keras.Variable(p, dtype=dtype) for p in params])

        def step(apply: Any, params: list[Any], grads: list[Any], lr: float) -> list[Any]:
            del lr  # the schedule supplies it
            if coupled is not None:  # L2: what a regularizer adds to the gradient
                params = [ops.convert_to_tensor(p) for p in params]
                grads = [g + coupled * p for g, p in zip(grads, params, strict=True)]
            return apply(grads)

        return closed_loop(
            case,
            to_backend=lambda a: ops.convert_to_tensor(np.asarray(a), dtype=dtype),
            to_numpy=lambda t: np.asarray(ops.convert_to_numpy(t)),
            make=make,
            step=step,
        )
