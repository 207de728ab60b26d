"""qhoptim.optax with JAX's sharding: parameters placed by NamedSharding over a Mesh.

``qh_jax_sharded.py`` runs in a subprocess with 8 host devices (XLA_FLAGS is
read when JAX is imported, so it cannot be set in this process) and trains the
same MLP under three layouts — data parallel (parameters replicated, batch
split), model parallel (a 2 x 4 mesh, hidden units split over "model") and
fully sharded (every parameter split over 8 devices) — and, as the reference,
on one device. This module only judges what it saved.

Tolerances. Sharding changes only where sums are taken: the batch mean over 8
shards, and in the model-parallel layout the hidden-unit sum of the second
matmul over 4. In float64 that moves the last bits (measured differences are
printed at the end of the run, about 1e-16); RTOL and ATOL leave three orders of
magnitude of margin. Losing a shard of the batch, or updating a sharded
parameter with another shard's state, moves the parameters by far more.
"""

from __future__ import annotations

import os
import pickle
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

pytest.importorskip("jax")
pytest.importorskip("optax")

from qh_subprocess import run_program

DEVICES = 8
LAYOUTS = ("data-parallel", "model-parallel", "fully-sharded")
OPTIMIZERS = ("qhm", "qhadam", "qhadamw")
RTOL = 1e-10
ATOL = 1e-12


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("jax-sharded") / "runs.pkl"
    flags = os.environ.get("XLA_FLAGS", "")
    env = {
        "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={DEVICES}".strip(),
        "JAX_PLATFORMS": "cpu",
    }
    start = time.perf_counter()
    run_program("qh_jax_sharded.py", str(out), env=env)
    with open(out, "rb") as f:
        results: dict[str, Any] = pickle.load(f)
    results["seconds"] = time.perf_counter() - start
    return results


def test_eight_host_devices(runs: dict[str, Any]) -> None:
    assert len(runs["devices"]) == DEVICES, runs["devices"]


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_sharded_equals_single_device(
    runs: dict[str, Any], layout: str, name: str, report_difference: Callable[..., None]
) -> None:
    got = runs["runs"][f"{layout}/{name}"]["trajectory"]
    want = runs["runs"][f"single/{name}"]["trajectory"]
    assert len(got) == len(want) > 0
    max_abs = max_rel = 0.0
    for t, (g_step, w_step) in enumerate(zip(got, want, strict=True)):
        assert g_step.keys() == w_step.keys()
        for leaf in w_step:
            g, w = g_step[leaf], w_step[leaf]
            diff = float(np.max(np.abs(g - w)))
            max_abs = max(max_abs, diff)
            max_rel = max(max_rel, diff / float(np.max(np.abs(w))))
            np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL, err_msg=f"step {t}, {leaf}")
    report_difference(
        f"optax {name} {layout}", max_abs, max_rel, f"(rtol {RTOL:.0e}, atol {ATOL:.0e})"
    )


@pytest.mark.parametrize("when", ["init", "final"])
@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_state_sharded_like_params(runs: dict[str, Any], layout: str, name: str, when: str) -> None:
    """Every state leaf that mirrors a parameter has the parameter's sharding.

    After ``tx.init`` (outside jit, as optax's own optimizers keep it) and after
    the jitted steps: a moment left on one device would cost that device the
    memory of the whole model.
    """
    report = runs["runs"][f"{layout}/{name}"][f"layout_{when}"]
    fields = {"qhm": {"momentum_buffer"}, "qhadam": {"mu", "nu"}, "qhadamw": {"mu", "nu"}}[name]
    assert {leaf.split("[")[0] for leaf, *_ in report} == fields
    assert len(report) == 4 * len(fields)
    mismatched = [entry for entry in report if not entry[3]]
    assert not mismatched, "\n".join(
        f"{leaf}: param {p}, state {s}" for leaf, p, s, _ in mismatched
    )
