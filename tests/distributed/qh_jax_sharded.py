"""qhoptim.optax on 8 host devices: the program ``test_jax_sharding.py`` runs.

Run as ``python qh_jax_sharded.py OUT`` in a fresh process with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``: JAX reads the flag
once, when it is imported, so the pytest process cannot set it for itself.

For every layout of :data:`LAYOUTS` and optimizer of :data:`OPTIMIZERS` it
trains a small MLP with a jitted step, the parameters and the batch placed by
``NamedSharding`` over a ``Mesh`` of the 8 devices; and, as the reference, each
optimizer once with everything on one device (``single``). It pickles to
``OUT`` the parameters after each step of every run and, for each
optimizer-state leaf that mirrors a parameter, its sharding and the
parameter's, after ``init`` and after the last step. The test judges them;
this program asserts nothing.
"""

from __future__ import annotations

import pickle
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import qhoptim.optax as qho

jax.config.update("jax_enable_x64", True)  # float64: see the tolerances in the test

DEVICES = 8
STEPS = 6
BATCH = 32  # 4 rows per device along the data axis of every layout
F64 = jnp.float64

OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "qhm": lambda: qho.qhm(0.5, momentum=0.9, nu=0.7),
    # nu2 < 1: the denominator mixes |g|^2 and the second moment.
    "qhadam": lambda: qho.qhadam(1e-2, b1=0.9, b2=0.999, nu1=0.7, nu2=0.9),
    # Decoupled weight decay reads the (sharded) parameters in the update.
    "qhadamw": lambda: qho.qhadamw(1e-2, nu1=0.7, weight_decay=1e-2),
}

# name: (mesh shape, mesh axes, PartitionSpec per parameter, PartitionSpec of the batch)
LAYOUTS: dict[str, tuple[tuple[int, ...], tuple[str, ...], dict[str, P], P]] = {
    # Data parallel: parameters (and so the state) replicated, batch split 8 ways.
    "data-parallel": (
        (8,),
        ("data",),
        {"w1": P(), "b1": P(), "w2": P(), "b2": P()},
        P("data"),
    ),
    # Model parallel (Megatron-style MLP) on a 2 x 4 mesh: the hidden units
    # split over "model", the batch over "data".
    "model-parallel": (
        (2, 4),
        ("data", "model"),
        {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()},
        P("data"),
    ),
    # Fully sharded: every parameter split along its first axis over all 8 devices.
    "fully-sharded": (
        (8,),
        ("data",),
        {"w1": P("data", None), "b1": P("data"), "w2": P("data", None), "b2": P("data")},
        P("data"),
    ),
}


def init_params() -> dict[str, jax.Array]:
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    return {
        "w1": 0.5 * jax.random.normal(k1, (8, 16), F64),
        "b1": 0.1 * jax.random.normal(k2, (16,), F64),
        "w2": 0.5 * jax.random.normal(k3, (16, 8), F64),
        "b2": 0.1 * jax.random.normal(k4, (8,), F64),
    }


def batches() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1234)
    return rng.standard_normal((STEPS, BATCH, 8)), rng.standard_normal((STEPS, BATCH, 8))


def loss_fn(params: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
    hidden = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] + params["b2"] - y) ** 2)


def moments(state: Any, params: dict[str, jax.Array]) -> dict[str, dict[str, jax.Array]]:
    """The state's per-parameter trees (momentum buffer, mu, nu) by field name."""
    inner = state[0]  # qhm/qhadam/qhadamw chain the QH scaling first
    structure = jax.tree.structure(params)
    return {
        field: value
        for field, value in inner._asdict().items()
        if jax.tree.structure(value) == structure
    }


def layout_report(state: Any, params: dict[str, jax.Array]) -> list[tuple[str, str, str, bool]]:
    """``(leaf, param sharding, state sharding, equivalent)`` per state leaf."""
    out = []
    for field, tree in moments(state, params).items():
        for name, leaf in tree.items():
            p = params[name]
            out.append(
                (
                    f"{field}[{name}]",
                    repr(p.sharding),
                    repr(leaf.sharding),
                    leaf.sharding.is_equivalent_to(p.sharding, leaf.ndim),
                )
            )
    return out


def run(
    tx: optax.GradientTransformation,
    params: dict[str, jax.Array],
    place_batch: Callable[[np.ndarray], jax.Array],
) -> dict[str, Any]:
    @jax.jit
    def step(params: Any, state: Any, x: jax.Array, y: jax.Array) -> tuple[Any, Any]:
        grads = jax.grad(loss_fn)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = tx.init(params)
    at_init = layout_report(state, params)
    xs, ys = batches()
    trajectory = []
    for t in range(STEPS):
        params, state = step(params, state, place_batch(xs[t]), place_batch(ys[t]))
        trajectory.append({k: np.asarray(v) for k, v in params.items()})
    return {
        "trajectory": trajectory,
        "layout_init": at_init,
        "layout_final": layout_report(state, params),
    }


def main(out: str) -> None:
    devices = jax.devices()
    results: dict[str, Any] = {"devices": [repr(d) for d in devices], "runs": {}}
    one = devices[0]
    for name, make in OPTIMIZERS.items():
        single = {k: jax.device_put(v, one) for k, v in init_params().items()}
        results["runs"][f"single/{name}"] = run(make(), single, lambda a: jax.device_put(a, one))
    for layout, (shape, axes, specs, batch_spec) in LAYOUTS.items():
        mesh = Mesh(np.array(devices[: int(np.prod(shape))]).reshape(shape), axes)
        batch_sharding = NamedSharding(mesh, batch_spec)
        for name, make in OPTIMIZERS.items():
            sharded = {
                k: jax.device_put(v, NamedSharding(mesh, specs[k]))
                for k, v in init_params().items()
            }
            results["runs"][f"{layout}/{name}"] = run(
                make(), sharded, lambda a, s=batch_sharding: jax.device_put(a, s)
            )
    with open(out, "wb") as f:
        pickle.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
