"""qhoptim.keras under Keras's distribution: the program ``test_keras_distributed.py`` runs.

Run as ``python qh_keras_distributed.py MODE OUT`` in a fresh process (the
devices must be configured before TensorFlow or JAX starts):

``mirrored``
    ``KERAS_BACKEND=tensorflow``: the host CPU split into two logical devices,
    ``tf.distribute.MirroredStrategy`` over both.
``jax``
    ``KERAS_BACKEND=jax`` with ``XLA_FLAGS`` forcing 4 host devices:
    ``keras.distribution.DataParallel`` over all four, and ``ModelParallel`` on
    a 2 x 2 mesh with the hidden layer split over "model".

For each optimizer of :data:`OPTIMIZERS` the program runs ``model.fit`` on the
same data and initial weights under each distribution and, as the reference,
on one device without any (``single``). It pickles to ``OUT`` the weights after
every batch of both runs, and for each model variable the placement of the
variable and of the optimizer's state for it. The test judges them; this
program asserts nothing.
"""

from __future__ import annotations

import pickle
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np

MODE, OUT = sys.argv[1], sys.argv[2]

if MODE == "mirrored":
    import tensorflow as tf

    (cpu,) = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
else:
    import jax

    jax.config.update("jax_enable_x64", True)

import keras  # noqa: E402

from qhoptim.keras import QHM, QHAdam  # noqa: E402

keras.config.set_floatx("float64")  # float64: see the tolerances in the test

BATCH = 16  # global batch: 8 rows per replica (mirrored), 4 per device (JAX)
ROWS = 64
EPOCHS = 2

OPTIMIZERS: dict[str, Callable[[], keras.optimizers.Optimizer]] = {
    "QHM": lambda: QHM(learning_rate=0.5, momentum=0.9, nu=0.7),
    "QHAdam": lambda: QHAdam(learning_rate=1e-2, beta_1=0.9, beta_2=0.999, nu_1=0.7, nu_2=0.9),
}


def make_model() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="tanh", name="hidden"),
            keras.layers.Dense(3, name="out"),
        ]
    )


def data() -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(1234)
    x, y = rng.standard_normal((ROWS, 8)), rng.standard_normal((ROWS, 3))
    shapes = [(8, 16), (16,), (16, 3), (3,)]
    return x, y, [0.5 * rng.standard_normal(s) for s in shapes]


class RecordWeights(keras.callbacks.Callback):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.trajectory: list[list[np.ndarray]] = []

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.trajectory.append([np.array(w) for w in self.model.get_weights()])


def placement(variable: Any) -> str:
    """How a variable is laid out: its TF distributed type, or its JAX sharding."""
    value = variable.value
    if MODE == "mirrored":
        return type(value).__name__
    return repr(value.sharding)


def equivalent(state: Any, variable: Any) -> bool:
    if MODE == "mirrored":
        return type(state.value) is type(variable.value)
    return bool(state.value.sharding.is_equivalent_to(variable.value.sharding, len(variable.shape)))


def layouts(model: keras.Model, opt: keras.optimizers.Optimizer) -> list[dict[str, Any]]:
    """Per model variable: its placement, and that of each optimizer state for it."""
    out = []
    for v in model.trainable_variables:
        i = opt._get_variable_index(v)
        states = [opt._momentums[i]] + ([opt._velocities[i]] if hasattr(opt, "_velocities") else [])
        out.append(
            {
                "variable": (v.path, placement(v)),
                "state": [(s.path, placement(s), equivalent(s, v)) for s in states],
            }
        )
    return out


def fit(
    make_opt: Callable[[], keras.optimizers.Optimizer], scope: AbstractContextManager[Any]
) -> dict[str, Any]:
    x, y, weights = data()
    with scope:
        model = make_model()
        model.set_weights(weights)
        opt = make_opt()
        model.compile(optimizer=opt, loss="mse")
        record = RecordWeights()
        model.fit(
            x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[record]
        )
    return {"trajectory": record.trajectory, "layouts": layouts(model, opt)}


def distributions() -> dict[str, Callable[[], AbstractContextManager[Any]]]:
    """The distributions of this mode, by name: each makes a scope to build and fit in."""
    if MODE == "mirrored":
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        return {"mirrored": strategy.scope}
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*/hidden/kernel"] = (None, "model")
    layout_map[".*/hidden/bias"] = ("model",)
    layout_map[".*/out/kernel"] = ("model", None)
    return {
        "data-parallel": keras.distribution.DataParallel(devices=devices).scope,
        "model-parallel": keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"
        ).scope,
    }


def main() -> None:
    results: dict[str, Any] = {"backend": keras.backend.backend(), "runs": {}}
    if MODE == "mirrored":
        results["devices"] = [d.name for d in tf.config.list_logical_devices("CPU")]
    else:
        results["devices"] = [str(d) for d in keras.distribution.list_devices()]
    for name, make_opt in OPTIMIZERS.items():
        results["runs"][f"single/{name}"] = fit(make_opt, nullcontext())
        for dist_name, scope in distributions().items():
            results["runs"][f"{dist_name}/{name}"] = fit(make_opt, scope())
    with open(OUT, "wb") as f:
        pickle.dump(results, f)


if __name__ == "__main__":
    main()
