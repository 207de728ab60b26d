"""qhoptim.keras under Keras's distribution: tf.distribute.MirroredStrategy and
keras.distribution's DataParallel and ModelParallel on the JAX backend.

``qh_keras_distributed.py`` runs in a subprocess per backend (the devices must
be configured before TensorFlow or JAX starts): MirroredStrategy over the host
CPU split into 2 logical devices; DataParallel over 4 host devices and
ModelParallel on a 2 x 2 mesh (hidden layer split over "model"). Each trains
the same float64 model with ``model.fit`` under the distribution and, as the
reference, on one device without it; this module judges what it saved.

Tolerances. Distribution changes only where sums are taken (the batch mean per
replica then across replicas, and the hidden-unit sum across "model" shards).
In float64 that moves the last bits (measured differences are printed at the
end of the run, about 1e-16); RTOL and ATOL leave three orders of magnitude of
margin. A replica's half of the batch lost moves the weights by 0.09 or more; a
gradient summed over the replicas instead of averaged by 0.3 with QHM, and by
4e-8 with QHAdam (nearly invariant to the gradient's scale).
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from qh_subprocess import require_module, run_program

RTOL = 1e-10
ATOL = 1e-12
OPTIMIZERS = ("QHM", "QHAdam")
STEPS = 8  # 2 epochs of 64 rows in batches of 16
JAX_DEVICES = 4


def _run(
    tmp_path_factory: pytest.TempPathFactory, mode: str, env: dict[str, str]
) -> dict[str, Any]:
    out = tmp_path_factory.mktemp(f"keras-{mode}") / "runs.pkl"
    run_program("qh_keras_distributed.py", mode, str(out), env=env)
    with open(out, "rb") as f:
        results: dict[str, Any] = pickle.load(f)
    return results


@pytest.fixture(scope="module")
def mirrored(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    require_module("tensorflow")
    require_module("keras")
    return _run(tmp_path_factory, "mirrored", {"KERAS_BACKEND": "tensorflow"})


@pytest.fixture(scope="module")
def jax_distributed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    require_module("jax")
    require_module("keras")
    flags = os.environ.get("XLA_FLAGS", "")
    env = {
        "KERAS_BACKEND": "jax",
        "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={JAX_DEVICES}".strip(),
        "JAX_PLATFORMS": "cpu",
    }
    return _run(tmp_path_factory, "jax", env)


def _compare(
    results: dict[str, Any], distribution: str, name: str, report: Callable[..., None]
) -> None:
    got = results["runs"][f"{distribution}/{name}"]["trajectory"]
    want = results["runs"][f"single/{name}"]["trajectory"]
    assert len(got) == len(want) == STEPS
    max_abs = max_rel = 0.0
    for t, (g_step, w_step) in enumerate(zip(got, want, strict=True)):
        for i, (g, w) in enumerate(zip(g_step, w_step, strict=True)):
            diff = float(np.max(np.abs(g - w)))
            max_abs = max(max_abs, diff)
            max_rel = max(max_rel, diff / float(np.max(np.abs(w))))
            np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL, err_msg=f"batch {t}, weight {i}")
    report(
        f"keras {results['backend']} {distribution} {name}",
        max_abs,
        max_rel,
        f"(rtol {RTOL:.0e}, atol {ATOL:.0e})",
    )


def _states(results: dict[str, Any], distribution: str, name: str) -> list[dict[str, Any]]:
    layouts = results["runs"][f"{distribution}/{name}"]["layouts"]
    assert len(layouts) == 4
    for entry in layouts:
        assert len(entry["state"]) == (1 if name == "QHM" else 2)
        for path, placement, equivalent in entry["state"]:
            assert equivalent, f"{path}: {placement}, variable {entry['variable']}"
    return layouts


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_mirrored_strategy_equals_single_device(
    mirrored: dict[str, Any], name: str, report_difference: Callable[..., None]
) -> None:
    assert mirrored["backend"] == "tensorflow"
    assert len(mirrored["devices"]) == 2, mirrored["devices"]
    _compare(mirrored, "mirrored", name, report_difference)
    # The optimizer's variables are mirrored like the model's.
    for entry in _states(mirrored, "mirrored", name):
        assert entry["variable"][1] == "MirroredVariable", entry


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("distribution", ["data-parallel", "model-parallel"])
def test_keras_jax_distribution_equals_single_device(
    jax_distributed: dict[str, Any],
    distribution: str,
    name: str,
    report_difference: Callable[..., None],
) -> None:
    assert jax_distributed["backend"] == "jax"
    assert len(jax_distributed["devices"]) == JAX_DEVICES, jax_distributed["devices"]
    _compare(jax_distributed, distribution, name, report_difference)
    # Each optimizer variable is sharded like its model variable.
    specs = {
        e["variable"][0].split("/", 1)[1]: e["variable"][1]
        for e in _states(jax_distributed, distribution, name)
    }
    if distribution == "model-parallel":
        assert "spec=P(None, 'model')" in specs["hidden/kernel"], specs
        assert "spec=P('model', None)" in specs["out/kernel"], specs
    else:
        assert all("'model'" not in s for s in specs.values()), specs
