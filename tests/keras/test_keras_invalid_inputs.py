"""The shared invalid-input table (conformance/invalid_inputs.py) against qhoptim.keras."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import qhoptim.keras as qk
from conformance.invalid_inputs import INVALID, NAMES, Invalid, backend_kwargs, pattern

FAMILIES = [(qk.QHM, "qhm"), (qk.QHAdam, "qhadam"), (qk.QHAdamW, "qhadam")]
CASES = [
    (cls, family, entry)
    for cls, family in FAMILIES
    for entry in INVALID
    if entry.applies_to(family) and NAMES["keras"][entry.param] is not None
]
IDS = [f"{cls.__name__}-{entry.id}" for cls, _, entry in CASES]


@pytest.mark.parametrize(("cls", "family", "entry"), CASES, ids=IDS)
def test_constructor_rejects(cls: type, family: str, entry: Invalid) -> None:
    with pytest.raises(entry.error, match=pattern(entry, NAMES["keras"][entry.param])):
        cls(**backend_kwargs("keras", family, entry))


def test_every_keras_argument_of_the_table_is_tried() -> None:
    tried = {NAMES["keras"][e.param] for _, _, e in CASES}
    assert tried == {
        "learning_rate",
        "momentum",
        "nu",
        "beta_1",
        "beta_2",
        "nu_1",
        "nu_2",
        "epsilon",
        "weight_decay",
    }


@pytest.mark.parametrize("cls", [qk.QHM, qk.QHAdam])
def test_weight_decay_none_means_none(cls: type) -> None:
    opt = cls(learning_rate=0.1, weight_decay=None)
    assert opt.weight_decay is None


def test_callables_schedules_and_numpy_scalars_pass() -> None:
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)
    for opt in (
        qk.QHM(lambda: 0.05, momentum=np.float32(0.9), nu=np.float64(1.2)),
        qk.QHAdam(schedule, beta_1=np.float32(0.9), nu_1=-0.5, epsilon=0),
    ):
        v = keras.Variable(np.ones(3, "float32"))
        opt.apply([keras.ops.ones((3,))], [v])
        assert np.all(np.isfinite(keras.ops.convert_to_numpy(v)))
