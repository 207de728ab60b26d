"""qhoptim.keras with ``state_dtype``: slots in bfloat16, stochastically rounded.

On every Keras backend the rounding is :mod:`qhoptim.rounding`'s, bit for bit
(the same as torch's, optax's and MLX's); trajectories follow float32 slots'
on the conformance problems; a saved and reloaded optimizer continues as the
uninterrupted one.
"""

from __future__ import annotations

from typing import Any

import keras
import ml_dtypes
import numpy as np
import pytest
from keras import ops
from qh_keras_testing import BACKEND, apply_steps, slot_values

import qhoptim.keras as qk
from conformance.cases import (
    narrow_state_cases,
    narrow_state_tolerance,
    relative_state_distance,
    stored_state_tolerance,
)
from conformance.problems import get_problem
from qhoptim import rounding

OPTIMIZERS = {
    "QHM": lambda **kw: qk.QHM(0.1, momentum=0.9, nu=0.7, **kw),
    "QHAdam": lambda **kw: qk.QHAdam(1e-2, nu_1=0.7, **kw),
    "QHAdamW-amsgrad": lambda **kw: qk.QHAdamW(1e-2, nu_1=0.7, nu_2=0.8, amsgrad=True, **kw),
}
SHAPES = [(64, 33), (33,), (7,)]


def _x0() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.standard_normal(s) for s in SHAPES]


def _grads(params: list[np.ndarray], t: int) -> list[np.ndarray]:
    rng = np.random.default_rng(1000 + t)
    return [rng.standard_normal(p.shape) for p in params]


def _bits(variable: Any) -> np.ndarray:
    """A bfloat16 variable's bits as uint16."""
    return np.asarray(ops.convert_to_numpy(variable)).view(np.uint16)


def _slots(opt: keras.optimizers.Optimizer) -> list[Any]:
    return [v for v in opt.variables if v.name not in ("iteration", "learning_rate")]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_slots_are_stored_in_bfloat16_at_half_the_bytes(name: str) -> None:
    narrow, wide = OPTIMIZERS[name](state_dtype="bfloat16"), OPTIMIZERS[name]()
    apply_steps(narrow, _x0(), _grads, 2, dtype="float32")
    apply_steps(wide, _x0(), _grads, 2, dtype="float32")
    assert {v.dtype for v in _slots(narrow)} == {"bfloat16"}
    assert {v.dtype for v in _slots(wide)} == {"float32"}
    narrow_values = sum(int(np.prod(v.shape)) for v in _slots(narrow))
    assert narrow_values == sum(int(np.prod(v.shape)) for v in _slots(wide))
    if name == "QHAdam":  # 2 slots of 2 bytes per parameter: 4 bytes instead of 8
        assert 2 * narrow_values == 4 * sum(int(np.prod(s)) for s in SHAPES)


# On torch, variables step in lists: through the fused CPU kernel, which rounds
# bfloat16 slots itself, or (TORCH_FUSED off) on float32 working copies.
PATHS = [True, False] if BACKEND == "torch" else [True]


@pytest.mark.parametrize("torch_fused", PATHS, ids=lambda f: "fused" if f else "multi-tensor")
def test_the_rounding_is_the_rule_every_backend_follows(
    torch_fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # QHM with momentum 0 stores the gradient itself, rounded; the second
    # variable is state index 4 * 1.
    monkeypatch.setattr(qk, "TORCH_FUSED", torch_fused)
    g = (np.random.default_rng(3).standard_normal((50, 7)) * 1e-3).astype(np.float32)
    # NaNs made from bits, whose payloads fill the half bfloat16 drops: the rule
    # adds them no noise (it carried 0x7FFFFFFF into the sign) and keeps them
    # NaNs. (torch's arithmetic may hand the rounding its own NaN, 0x7FC00000:
    # their bits are the arithmetic's, and only their being NaN is compared.)
    g.reshape(-1).view(np.uint32)[[5, 50, 300]] = [0x7FFFFFFF, 0xFFFFFFFF, 0x7F80FFFF]
    finite = np.isfinite(g)
    variables = [keras.Variable(np.zeros(s, np.float32)) for s in [(3,), (50, 7), (2,)]]
    opt = qk.QHM(0.1, momentum=0.0, nu=0.7, state_dtype="bfloat16")
    grads = [ops.ones((3,)), ops.convert_to_tensor(g), ops.ones((2,))]
    for step in (1, 2):
        opt.apply(grads, variables)
        want = rounding.stochastic_round_reference(g, step, 4 * 1)
        stored = _bits(opt._momentums[1])
        assert np.array_equal(stored[finite], want[finite])
        assert np.isnan((stored[~finite].astype(np.uint32) << 16).view(np.float32)).all()
        if BACKEND != "torch":
            assert np.array_equal(stored, want)
        nearest = g[finite].astype(ml_dtypes.bfloat16).view(np.uint16)
        assert not np.array_equal(want[finite], nearest)


@pytest.mark.skipif(BACKEND != "jax", reason="XLA's buffer assignment of a jitted JAX step")
@pytest.mark.parametrize("name", ["QHM", "QHAdam"])
def test_donated_bfloat16_slots_are_written_in_place_without_copies(name: str) -> None:
    # Keras's trainer donates the slots. A slot's rounded store reads the
    # variable's new value (qhoptim.keras._narrow._after), so that XLA orders
    # the variable's update, which reads the old slot, before it and writes
    # the slot in place; unordered, XLA copied every slot first. (AMSGrad's
    # second moment is still copied: see _narrow._store.)
    import jax

    opt = OPTIMIZERS[name](state_dtype="bfloat16")
    variables = [keras.Variable(np.zeros(s, np.float32)) for s in [(16, 3, 3, 3), *SHAPES]]
    opt.build(variables)
    params = [v.value for v in variables]
    slots = [v.value for v in opt.variables]
    grads = [ops.ones(v.shape) for v in variables]

    def step(params: Any, slots: Any, grads: Any) -> Any:
        return opt.stateless_apply(slots, grads, params)

    hlo = jax.jit(step, donate_argnums=(0, 1)).lower(params, slots, grads).compile().as_text()
    assert "input_output_alias" in hlo  # the donation took effect
    copies = [line for line in hlo.splitlines() if " copy(" in line and "bf16[" in line]
    assert sum(v.dtype == "bfloat16" for v in opt.variables) >= len(variables)
    assert copies == []


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_restored_optimizer_continues_as_the_uninterrupted_one(name: str) -> None:
    straight = OPTIMIZERS[name](state_dtype="bfloat16")
    final = apply_steps(straight, _x0(), _grads, 6, dtype="float32")
    first = OPTIMIZERS[name](state_dtype="bfloat16")
    variables = [keras.Variable(x, dtype="float32") for x in _x0()]
    for t in range(3):
        params = [np.asarray(ops.convert_to_numpy(v), np.float64) for v in variables]
        first.apply([ops.convert_to_tensor(g, "float32") for g in _grads(params, t)], variables)
    store: dict[str, Any] = {}
    first.save_own_variables(store)
    # A new optimizer from the saved config, its variables loaded from the store
    # (what keras.models.load_model does with a .keras file).
    resumed = type(first).from_config(first.get_config())
    assert resumed.state_dtype == "bfloat16"
    resumed.build(variables)
    resumed.load_own_variables(store)
    for t in range(3, 6):
        params = [np.asarray(ops.convert_to_numpy(v), np.float64) for v in variables]
        resumed.apply([ops.convert_to_tensor(g, "float32") for g in _grads(params, t)], variables)
    for want, v in zip(final, variables, strict=True):
        assert np.array_equal(want, np.asarray(ops.convert_to_numpy(v), np.float64))


def test_a_model_with_bfloat16_slots_saves_and_loads(tmp_path: Any) -> None:
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer=qk.QHAdam(1e-2, nu_1=0.7, state_dtype="bfloat16"), loss="mse")
    x, y = np.ones((8, 4), np.float32), np.zeros((8, 3), np.float32)
    model.fit(x, y, epochs=2, batch_size=4, verbose=0, shuffle=False)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.optimizer.state_dtype == "bfloat16"
    for a, b in zip(_slots(model.optimizer), _slots(loaded.optimizer), strict=True):
        assert b.dtype == "bfloat16"
        assert np.array_equal(_bits(a), _bits(b))


def test_float16_slots_and_rounding_off_round_to_nearest() -> None:
    # float16 for QHM's buffer; QHAdam's second moment refuses it (below).
    for make, kwargs in (
        (qk.QHM, {"state_dtype": "float16"}),
        (qk.QHAdam, {"state_dtype": "bfloat16", "stochastic_rounding": False}),
    ):
        opt, wide = make(1e-2, **kwargs), make(1e-2)
        apply_steps(opt, _x0(), _grads, 1, dtype="float32")
        apply_steps(wide, _x0(), _grads, 1, dtype="float32")
        for a, b in zip(_slots(opt), _slots(wide), strict=True):
            want = ops.convert_to_numpy(ops.cast(b, kwargs["state_dtype"]))
            assert np.array_equal(np.asarray(ops.convert_to_numpy(a)), np.asarray(want))


@pytest.mark.parametrize("cls", [qk.QHAdam, qk.QHAdamW])
def test_float16_slots_are_refused_for_qhadams_second_moment(cls: type) -> None:
    with pytest.raises(ValueError, match=r"state_dtype=float16 cannot hold QHAdam's second"):
        cls(1e-3, state_dtype="float16")


def test_the_config_without_a_state_dtype_is_unchanged() -> None:
    assert "state_dtype" not in qk.QHAdam(1e-3).get_config()
    config = qk.QHM(0.1, state_dtype="bfloat16", stochastic_rounding=True).get_config()
    assert (config["state_dtype"], config["stochastic_rounding"]) == ("bfloat16", True)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"state_dtype": "int8"}, ValueError, r"state_dtype must be None or one of bfloat16"),
        ({"state_dtype": "no-such"}, ValueError, r"received state_dtype='no-such'"),
        ({"stochastic_rounding": 1}, TypeError, r"stochastic_rounding must be None or a bool"),
        # True would change nothing where nothing is rounded stochastically.
        (
            {"stochastic_rounding": True},
            ValueError,
            r"received stochastic_rounding=True with state_dtype=None",
        ),
        (
            {"state_dtype": "float32", "stochastic_rounding": True},
            ValueError,
            r"applies to a bfloat16 state_dtype; .*state_dtype=float32$",
        ),
    ],
)
@pytest.mark.parametrize("cls", [qk.QHM, qk.QHAdam, qk.QHAdamW])
def test_invalid_settings_are_refused(
    cls: type, kwargs: dict[str, Any], error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        cls(0.1, **kwargs)


def test_slots_wider_than_their_variable_are_refused() -> None:
    opt = qk.QHAdam(1e-2, state_dtype="float32")
    with pytest.raises(ValueError, match=r"wider than a parameter's dtype float16"):
        opt.build([keras.Variable(np.zeros(3), dtype="float16")])
    # As wide and another: it would step in the variable's 16 bits, where
    # 0.999 * v rounds back to v (the average never decayed).
    opt = qk.QHM(1e-2, state_dtype="float16")
    with pytest.raises(ValueError, match=r"float16 is as wide as a parameter's dtype bfloat16"):
        opt.build([keras.Variable(np.zeros(3), dtype="bfloat16")])


@pytest.mark.parametrize("cls", [qk.QHM, qk.QHAdam])
def test_a_refused_first_step_leaves_nothing_built_and_is_refused_again(cls: type) -> None:
    # A variable whose slots can follow, then one whose slots cannot: the
    # refusal comes before Keras marks the optimizer built or makes any slot,
    # so the next step is refused alike (it found no slot lists) and nothing moves.
    a = keras.Variable(np.ones(3), dtype="float32", name="a")
    w = keras.Variable(np.ones(3), dtype="float16", name="w")
    opt = cls(1e-2, state_dtype="float32")
    grads = [ops.ones((3,)), ops.ones((3,), dtype="float16")]
    for _ in range(2):
        with pytest.raises(ValueError, match=r"wider than a parameter's dtype float16"):
            opt.apply(grads, [a, w])
        assert not opt.built and int(opt.iterations) == 0
        assert np.array_equal(np.asarray(a), np.ones(3))


def _optimizer(case: Any, **options: Any) -> keras.optimizers.Optimizer:
    hp = case.hparams
    wd = hp["weight_decay"] if case.weight_decay_mode == "decoupled" else None
    if case.optimizer == "qhm":
        return qk.QHM(hp["lr"], hp["momentum"], hp["nu"], weight_decay=wd, **options)
    (b1, b2), (nu1, nu2) = hp["betas"], hp["nus"]
    cls = qk.QHAdamW if case.optimizer == "qhadamw" else qk.QHAdam
    return cls(
        hp["lr"],
        beta_1=b1,
        beta_2=b2,
        nu_1=nu1,
        nu_2=nu2,
        epsilon=hp["eps"],
        weight_decay=wd,
        amsgrad=case.amsgrad,
        **options,
    )


@pytest.mark.parametrize("case", narrow_state_cases(), ids=lambda c: c.name)
def test_bfloat16_slots_follow_float32_slots_on_the_conformance_problems(case: Any) -> None:
    problem = get_problem(case.problem_name)
    coupled = case.hparams["weight_decay"] if case.weight_decay_mode == "coupled" else 0.0
    trajectories: dict[str, list[np.ndarray]] = {"wide": [], "narrow": []}
    slots: dict[str, list[np.ndarray]] = {"wide": [], "narrow": []}

    def grads_of(run: str, opt: Any) -> Any:
        def grad_fn(params: list[np.ndarray], t: int) -> list[np.ndarray]:
            x = problem.join(params)
            trajectories[run].append(x)
            slots[run].append(slot_values(opt))  # as the step before left them
            grads = problem.split(problem.grad(x, t))
            return [g + coupled * p for g, p in zip(grads, params, strict=True)]

        return grad_fn

    x0 = problem.split(problem.x0)
    wide = _optimizer(case)
    apply_steps(wide, x0, grads_of("wide", wide), 100, dtype="float32")
    narrow = _optimizer(case, state_dtype="bfloat16")
    apply_steps(narrow, x0, grads_of("narrow", narrow), 100, dtype="float32")
    wide_x, narrow_x = np.array(trajectories["wide"]), np.array(trajectories["narrow"])
    relative = np.linalg.norm(narrow_x - wide_x, axis=1) / np.linalg.norm(wide_x, axis=1)
    assert relative.max() <= narrow_state_tolerance(case)
    # The trajectories alone barely see a lost slot where they barely depend on it.
    assert relative_state_distance(slots["narrow"], slots["wide"]) <= stored_state_tolerance(
        case, eight_bit=False
    )
