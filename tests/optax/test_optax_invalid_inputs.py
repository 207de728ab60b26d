"""The shared invalid-input table (conformance/invalid_inputs.py) against qhoptim.optax."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qhoptim.optax as qho
from conformance.invalid_inputs import INVALID, NAMES, Invalid, backend_kwargs, pattern

# (factory, family, the arguments it takes besides the table's)
FACTORIES: list[tuple[Callable[..., Any], str, frozenset[str]]] = [
    (qho.qhm, "qhm", frozenset({"learning_rate", "momentum", "nu"})),
    (qho.scale_by_qhm, "qhm", frozenset({"momentum", "nu"})),
    (qho.qhadam, "qhadam", frozenset({"learning_rate", "b1", "b2", "nu1", "nu2", "eps"})),
    (
        qho.qhadamw,
        "qhadam",
        frozenset({"learning_rate", "b1", "b2", "nu1", "nu2", "eps", "weight_decay"}),
    ),
    (qho.scale_by_qhadam, "qhadam", frozenset({"b1", "b2", "nu1", "nu2", "eps"})),
]
CASES = [
    (factory, family, accepted, entry)
    for factory, family, accepted in FACTORIES
    for entry in INVALID
    if entry.applies_to(family) and NAMES["optax"][entry.param] in accepted
]
IDS = [f"{factory.__name__}-{entry.id}" for factory, _, _, entry in CASES]


def _kwargs(family: str, accepted: frozenset[str], entry: Invalid) -> dict[str, Any]:
    kwargs = backend_kwargs("optax", family, entry)
    return {k: v for k, v in kwargs.items() if k in accepted}


#: Each path a transformation may step on: XLA's operations, and a bfloat16
#: or 8-bit state in the C++ state step (``fused=True``); the table's errors
#: are the same.
PATHS = {
    "xla": {},
    "fused": {"state_dtype": jnp.bfloat16, "fused": True},
    "fused-8-bit": {"state_dtype": jnp.uint8, "fused": True},
}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(("factory", "family", "accepted", "entry"), CASES, ids=IDS)
def test_factories_reject(factory, family, accepted, entry: Invalid, path: str) -> None:
    with pytest.raises(entry.error, match=pattern(entry, NAMES["optax"][entry.param])):
        factory(**_kwargs(family, accepted, entry), **PATHS[path])


def test_every_optax_argument_of_the_table_is_tried() -> None:
    tried = {NAMES["optax"][e.param] for _, _, _, e in CASES}
    assert tried == {"learning_rate", "momentum", "nu", "b1", "b2", "nu1", "nu2", "eps"} | {
        "weight_decay"
    }


# ------------------------------------------------------ values known only later
@pytest.mark.parametrize(
    ("factory", "kwargs"),
    [
        (qho.qhm, {"learning_rate": 0.1, "momentum": 0.9, "nu": 0.7}),
        (qho.qhadam, {"learning_rate": 0.05, "b1": 0.9, "b2": 0.99, "nu1": 0.7, "nu2": 0.8}),
        (qho.qhadamw, {"learning_rate": 0.05, "nu1": 0.7, "eps": 1e-6, "weight_decay": 0.1}),
    ],
)
@pytest.mark.parametrize("path", list(PATHS))
def test_traced_hyperparameters_pass_under_jit(factory, kwargs, path: str) -> None:
    x = jnp.linspace(-1.0, 1.0, 4, dtype=jnp.float32)
    g = 2.0 * x

    @jax.jit
    def traced_step(hparams):  # every hyperparameter is a tracer in here
        tx = factory(**hparams, **PATHS[path])
        return tx.update(g, tx.init(x), x)[0]

    traced = traced_step({k: jnp.asarray(v) for k, v in kwargs.items()})
    tx = factory(**kwargs, **PATHS[path])
    plain = tx.update(g, tx.init(x), x)[0]
    np.testing.assert_allclose(traced, plain, rtol=1e-6)


def test_concrete_array_hyperparameters_and_schedules_pass() -> None:
    tx = qho.qhadam(optax.constant_schedule(0.1), b1=jnp.asarray(0.9), nu1=np.float32(0.7))
    updates, _ = tx.update(jnp.ones(2), tx.init(jnp.ones(2)))
    assert bool(jnp.all(jnp.isfinite(updates)))
    injected = optax.inject_hyperparams(qho.qhm)(learning_rate=0.1, momentum=0.9, nu=1.5)
    updates, _ = jax.jit(injected.update)(jnp.ones(2), injected.init(jnp.ones(2)))
    np.testing.assert_allclose(updates, -0.1 * ((1 - 1.5) + 1.5 * (1 - 0.9)) * jnp.ones(2))


def _schedule(count: Any) -> float:
    return 0.5


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda f: qho.qhm(0.1, nu=f), "nu"),
        (lambda f: qho.qhm(0.1, momentum=f), "momentum"),
        (lambda f: qho.qhadam(0.1, nu1=f), "nu1"),
        (lambda f: qho.qhadamw(0.1, b2=f), "b2"),
        (lambda f: qho.qhmuon(0.1, beta=f), "beta"),
    ],
)
def test_a_schedule_is_refused_but_for_the_learning_rate_and_weight_decay(make, name) -> None:
    # It passed, and the first update failed inside. Scheduled as in optax:
    # learning_rate, and qhadamw's and qhmuon's weight_decay (optax.adamw's too).
    with pytest.raises(
        TypeError, match=rf"^{name} must be a real number; received {name}=<function"
    ):
        make(_schedule)
    x = jnp.ones((3, 3))
    for tx in (
        qho.qhadamw(_schedule, weight_decay=_schedule),
        qho.qhmuon(0.1, weight_decay=_schedule),
    ):
        updates, _ = tx.update(x, tx.init(x), x)
        assert np.isfinite(np.asarray(updates)).all()


# ------------------------------------------- concrete scalars are checked as floats
@pytest.mark.parametrize("array", [np.array, jnp.array], ids=["numpy", "jax"])
@pytest.mark.parametrize(
    ("factory", "kwargs", "message"),
    [
        (qho.qhadam, {"eps": [-1.0]}, "eps must be in [0, inf); received eps=-1.0"),
        (qho.qhm, {"momentum": [1.5]}, "momentum must be in [0, 1); received momentum=1.5"),
        (qho.qhadam, {"b1": -1.0}, "b1 must be in [0, 1); received b1=-1.0"),
        (qho.qhadam, {"nu2": [2.0]}, "nu2 must be in [0, 1]; received nu2=2.0"),
        (
            qho.qhadamw,
            {"weight_decay": [-0.5]},
            "weight_decay must be in [0, inf); received weight_decay=-0.5",
        ),
        (
            qho.qhm,
            {"learning_rate": [-0.5]},
            "learning_rate must be in [0, inf); received learning_rate=-0.5",
        ),
        # Empty: no number to step with (it failed inside the first update).
        (qho.qhm, {"momentum": []}, "momentum must not be empty; received an array of shape (0,)"),
        (qho.qhadam, {"eps": []}, "eps must not be empty; received an array of shape (0,)"),
    ],
)
def test_concrete_arrays_are_range_checked(array, factory, kwargs, message) -> None:
    # A one-element (or 0-d) array whose value is known is a number: it used to
    # pass unchecked, and momentum=1.5 trained as gradient ascent.
    kwargs = {"learning_rate": 0.1, **{k: array(v, np.float32) for k, v in kwargs.items()}}
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        factory(**kwargs)


@pytest.mark.parametrize("array", [np.array, jnp.array], ids=["numpy", "jax"])
def test_concrete_arrays_step_as_the_floats_they_hold(array) -> None:
    x = jnp.linspace(-1.0, 1.0, 4)
    g = 2.0 * x + 0.3
    kwargs = {"b1": 0.5, "b2": 0.75, "nu1": 0.625, "nu2": 0.5, "eps": 0.25}
    plain = qho.qhadam(0.125, **kwargs)
    arrays = qho.qhadam(array([0.125]), **{k: array([v]) for k, v in kwargs.items()})
    np.testing.assert_array_equal(
        arrays.update(g, arrays.init(x))[0], plain.update(g, plain.init(x))[0]
    )


# ------------------------------------------------------------------- QHMuon
# qhmuon takes optax.contrib.muon's names: beta for the table's momentum.
QHMUON_NAMES = {
    "lr": "learning_rate",
    "momentum": "beta",
    "nu": "nu",
    "weight_decay": "weight_decay",
}
QHMUON_CASES = [e for e in INVALID if e.applies_to("qhm")]


@pytest.mark.parametrize("entry", QHMUON_CASES, ids=[e.id for e in QHMUON_CASES])
def test_qhmuon_rejects_the_table(entry: Invalid) -> None:
    good = {"lr": 0.02, "momentum": 0.95, "nu": 0.7, "weight_decay": 0.0}
    kwargs = {QHMUON_NAMES[k]: v for k, v in {**good, entry.param: entry.value}.items()}
    with pytest.raises(entry.error, match=pattern(entry, QHMUON_NAMES[entry.param])):
        qho.qhmuon(**kwargs)
