"""qhoptim.optax with ``state_dtype``: state in bfloat16 or 8 bits, stochastically rounded.

The rounding is :mod:`qhoptim.rounding`'s, bit for bit (so the same as torch's,
Keras's and MLX's; torch's too for 8 bits); the trajectories follow float32
state's on the conformance problems; a resumed run rounds as the uninterrupted one.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qhoptim.optax as qho
from conformance.adapters.optax import make_transformation
from conformance.cases import (
    eight_bit_tolerance,
    narrow_state_cases,
    narrow_state_tolerance,
    relative_state_distance,
    stored_state_tolerance,
)
from conformance.problems import get_problem
from qhoptim import rounding
from qhoptim.optax import _extension

BF16, U8 = jnp.bfloat16, jnp.uint8
OPTIMIZERS = {
    "qhm": lambda **kw: qho.qhm(0.1, momentum=0.9, nu=0.7, **kw),
    "qhadam": lambda **kw: qho.qhadam(1e-2, nu1=0.7, **kw),
    "qhadamw-amsgrad": lambda **kw: qho.qhadamw(1e-2, nu1=0.7, nu2=0.8, amsgrad=True, **kw),
}


def _params() -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    shapes = {"w": (64, 33), "b": (33,), "c": (7,), "r": (2, 512)}  # r: scales of shape (2, 2)
    return {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in shapes.items()}


def _grads(params: dict[str, jax.Array], t: int) -> dict[str, jax.Array]:
    rng = np.random.default_rng(1000 + t)
    return {k: jnp.asarray(rng.standard_normal(p.shape), jnp.float32) for k, p in params.items()}


def _run(tx: Any, params: Any, state: Any, steps: range) -> tuple[Any, Any]:
    update = jax.jit(tx.update)
    for t in steps:
        updates, state = update(_grads(params, t), state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def _state_leaves(state: Any) -> list[jax.Array]:
    return [x for x in jax.tree.leaves(state) if x.ndim > 0]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_state_is_stored_in_bfloat16_at_half_the_bytes(name: str) -> None:
    params = _params()
    narrow, wide = OPTIMIZERS[name](state_dtype=BF16), OPTIMIZERS[name]()
    narrow_state = _run(narrow, params, narrow.init(params), range(2))[1]
    wide_state = _run(wide, params, wide.init(params), range(2))[1]
    assert {x.dtype for x in _state_leaves(narrow_state)} == {jnp.dtype(BF16)}
    narrow_bytes = sum(x.nbytes for x in _state_leaves(narrow_state))
    assert 2 * narrow_bytes == sum(x.nbytes for x in _state_leaves(wide_state))
    if name == "qhadam":  # 4 bytes per parameter instead of 8
        assert narrow_bytes == 4 * sum(p.size for p in params.values())


#: Where a bfloat16 or 8-bit state is stepped: XLA's operations, or the C++
#: custom call where it builds (test_optax_fused.py).
FUSED = [
    False,
    pytest.param(
        True,
        marks=pytest.mark.skipif(
            os.environ.get("QHOPTIM_REQUIRE_FUSED", "") in ("", "0")
            and not _extension.state_extension_available(),
            reason="the C++ state step does not build here",
        ),
    ),
]


@pytest.mark.parametrize("fused", FUSED, ids=["xla", "fused"])
def test_the_rounding_is_the_rule_every_backend_follows(fused: bool) -> None:
    # QHM with momentum 0 stores the gradient itself, rounded; the leaf at
    # position 1 of the pytree ("b": keys are sorted) is state index 4 * 1.
    # Three dimensions: each element's row-major position counts its strides.
    params = {"a": jnp.zeros(3), "b": jnp.zeros((5, 10, 7)), "c": jnp.zeros(2)}
    g = np.random.default_rng(3).standard_normal((5, 10, 7)).astype(np.float32) * 1e-3
    # NaNs made from bits, whose payloads fill the half bfloat16 drops: the rule
    # adds them no noise (it carried 0x7FFFFFFF into the sign) and keeps them quiet.
    g.reshape(-1).view(np.uint32)[[5, 50, 300]] = [0x7FFFFFFF, 0xFFFFFFFF, 0x7F80FFFF]
    g = jnp.asarray(g)
    grads = {"a": jnp.ones(3), "b": g, "c": jnp.ones(2)}
    tx = qho.scale_by_qhm(momentum=0.0, nu=0.7, state_dtype=BF16, fused=fused)
    state = tx.init(params)
    for step in (1, 2):
        _, state = jax.jit(tx.update)(grads, state)
        stored = np.asarray(state.momentum_buffer["b"]).view(np.uint16)
        want = rounding.stochastic_round_reference(np.asarray(g), step, 4 * 1)
        assert np.array_equal(stored, want)
        assert not np.array_equal(stored, np.asarray(g.astype(BF16)).view(np.uint16))


@pytest.mark.parametrize("state_dtype", [BF16, U8], ids=["bfloat16", "8-bit"])
@pytest.mark.parametrize("fused", [None, *FUSED], ids=["default", "xla", "fused"])
def test_hyperparameters_of_several_elements_step_with_a_narrow_state(
    state_dtype: Any, fused: bool | None
) -> None:
    # optax lets a hyperparameter broadcast against its leaf; the C++ state
    # step takes one number per weight, so such a step takes XLA's operations,
    # with the same bits (it crashed in the call).
    params = {"w": jnp.zeros(300)}
    betas = jnp.linspace(0.5, 0.99, 300, dtype=jnp.float32)
    grads = _grads(params, 0)
    for make in (
        lambda **kw: qho.qhadam(1e-2, b1=betas, b2=betas, nu1=0.7, **kw),
        lambda **kw: qho.qhm(0.1, momentum=betas, nu=0.7, **kw),
    ):
        runs = []
        for options in ({"fused": fused}, {"fused": False}):
            tx = make(state_dtype=state_dtype, **options)
            state = tx.init(params)
            for _ in range(2):
                updates, state = jax.jit(tx.update)(grads, state, params)
            runs.append(np.asarray(updates["w"]))
        assert np.isfinite(runs[0]).all() and np.array_equal(runs[0], runs[1])


NARROW = [
    pytest.param({"state_dtype": BF16, "fused": False}, id="bfloat16"),
    pytest.param({"state_dtype": BF16, "fused": True}, id="bfloat16-fused", marks=FUSED[1].marks),
    pytest.param({"state_dtype": U8, "fused": False}, id="8-bit"),
    pytest.param({"state_dtype": U8, "fused": True}, id="8-bit-fused", marks=FUSED[1].marks),
]


@pytest.mark.parametrize("options", NARROW)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_resumed_run_rounds_as_the_uninterrupted_one(name: str, options: dict[str, Any]) -> None:
    tx = OPTIMIZERS[name](**options)
    params = _params()
    straight = _run(tx, params, tx.init(params), range(10))[0]
    half_params, half_state = _run(tx, params, tx.init(params), range(5))
    # A checkpoint: the state leaves as NumPy arrays, restored into a fresh
    # init's structure (as orbax restores into a target).
    saved = jax.tree.map(np.asarray, half_state)
    restored = jax.tree.map(jnp.asarray, saved)
    resumed = _run(tx, half_params, restored, range(5, 10))[0]
    for k in params:
        assert np.array_equal(np.asarray(straight[k]), np.asarray(resumed[k]))


def test_float16_state_and_rounding_off_round_to_nearest() -> None:
    params, grads = _params(), _grads(_params(), 0)
    # float16 for QHM's buffer; QHAdam's second moment refuses it (below).
    narrow = qho.scale_by_qhm(state_dtype=jnp.float16)
    _, state = narrow.update(grads, narrow.init(params))
    _, wide_state = qho.scale_by_qhm().update(grads, qho.scale_by_qhm().init(params))
    for k in params:
        want = wide_state.momentum_buffer[k].astype(jnp.float16)
        assert np.array_equal(np.asarray(state.momentum_buffer[k]), np.asarray(want))
    tx = qho.scale_by_qhadam(nu1=0.7, state_dtype=BF16, stochastic_rounding=False)
    wide = qho.scale_by_qhadam(nu1=0.7)
    _, state = tx.update(grads, tx.init(params))
    _, wide_state = wide.update(grads, wide.init(params))
    for k in params:
        want = wide_state.mu[k].astype(BF16)
        assert np.array_equal(np.asarray(state.mu[k]), np.asarray(want))


@pytest.mark.parametrize("make", [qho.scale_by_qhadam, qho.qhadam, qho.qhadamw])
def test_float16_state_is_refused_for_qhadams_second_moment(make: Any) -> None:
    kwargs = {} if make is qho.scale_by_qhadam else {"learning_rate": 1e-3}
    with pytest.raises(ValueError, match=r"state_dtype=float16 cannot hold QHAdam's second"):
        make(state_dtype=jnp.float16, **kwargs)


def test_mu_dtype_still_casts_as_optax_adam_does() -> None:
    params, grads = _params(), _grads(_params(), 0)
    tx = qho.scale_by_qhadam(mu_dtype=BF16)
    _, state = tx.update(grads, tx.init(params))
    _, adam_state = optax.scale_by_adam(mu_dtype=BF16).update(
        grads, optax.scale_by_adam(mu_dtype=BF16).init(params)
    )
    for k in params:
        assert state.mu[k].dtype == jnp.dtype(BF16) and state.nu[k].dtype == jnp.float32
        assert np.array_equal(np.asarray(state.mu[k]), np.asarray(adam_state.mu[k]))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"state_dtype": "int8"}, ValueError, r"state_dtype must be None or one of bfloat16"),
        ({"state_dtype": "no-such-dtype"}, ValueError, r"received state_dtype='no-such-dtype'"),
        ({"stochastic_rounding": 1}, TypeError, r"stochastic_rounding must be None or a bool"),
        # True would change nothing where nothing is rounded stochastically.
        (
            {"stochastic_rounding": True},
            ValueError,
            r"received stochastic_rounding=True with state_dtype=None",
        ),
        (
            {"state_dtype": jnp.float32, "stochastic_rounding": True},
            ValueError,
            r"applies to a bfloat16 or 8-bit \(uint8\) state_dtype; .*state_dtype=float32$",
        ),
        ({"state_dtype": BF16, "mu_dtype": jnp.float32}, ValueError, r"give one"),
    ],
)
def test_invalid_settings_are_refused(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        qho.qhadam(1e-2, **kwargs)


def test_parameters_a_narrow_state_cannot_follow_are_refused() -> None:
    with pytest.raises(ValueError, match=r"wider than a parameter's dtype bfloat16"):
        qho.qhadam(1e-2, state_dtype=jnp.float32).init(jnp.zeros(3, BF16))
    with pytest.raises(ValueError, match=r"float16 is as wide as a parameter's dtype bfloat16"):
        qho.qhm(1e-2, state_dtype=jnp.float16).init(jnp.zeros(3, BF16))
    with pytest.raises(ValueError, match=r"real parameters"):
        qho.qhm(0.1, state_dtype=BF16).init(jnp.zeros(3, jnp.complex64))
    with pytest.raises(ValueError, match=r"give one"):
        qho.qhm(0.1, state_dtype=BF16, accumulator_dtype=BF16)


def test_the_plain_state_is_refused_where_the_counted_one_is_needed() -> None:
    params = _params()
    plain_state = qho.scale_by_qhm().init(params)
    with pytest.raises(TypeError, match=r"ScaleByQHMCountState"):
        qho.scale_by_qhm(state_dtype=BF16).update(_grads(params, 0), plain_state)


def _narrow_state_runs() -> list[Any]:
    """Each conformance case with each narrow state; QHMuon's buffer has no
    C++ step (its step is matrix products), so no ``fused`` for it."""
    runs = []
    for case in narrow_state_cases() + narrow_state_cases(("qhmuon",)):
        for option in NARROW:
            options = dict(option.values[0])
            if case.optimizer == "qhmuon":
                if options.pop("fused", False):
                    continue
            runs.append(
                pytest.param(case, options, id=f"{option.id}-{case.name}", marks=option.marks)
            )
    return runs


@pytest.mark.parametrize(("case", "options"), _narrow_state_runs())
def test_narrow_state_follows_float32_state_on_the_conformance_problems(
    case: Any, options: dict[str, Any]
) -> None:
    state_dtype = options["state_dtype"]
    problem = get_problem(case.problem_name)

    def run(**options: Any) -> tuple[np.ndarray, list[np.ndarray]]:
        tx = make_transformation(case, case.hparams["lr"], **options)
        params = [jnp.asarray(a, jnp.float32) for a in problem.split(problem.x0)]
        state, update = tx.init(params), jax.jit(tx.update)
        out, states = [], []
        for t in range(100):
            x = problem.join([np.asarray(p, np.float64) for p in params])
            grads = [jnp.asarray(g, jnp.float32) for g in problem.split(problem.grad(x, t))]
            updates, state = update(grads, state, params)
            params = optax.apply_updates(params, updates)
            out.append(problem.join([np.asarray(p, np.float64) for p in params]))
            # The moments, read back as float64: the floating leaves of the parameters' shapes.
            moments = [
                np.asarray(leaf, np.float64).ravel()
                for leaf in jax.tree.leaves(qho.decoded_state(state))
                if jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.ndim > 0
            ]
            states.append(np.concatenate([np.zeros(0), *moments]))
        return np.array(out), states

    (wide, wide_states), (narrow, narrow_states) = run(), run(**options)
    relative = np.linalg.norm(narrow - wide, axis=1) / np.linalg.norm(wide, axis=1)
    bound = narrow_state_tolerance(case) if state_dtype == BF16 else eight_bit_tolerance(case)
    assert relative.max() <= bound
    # The trajectories alone barely see a lost state where they barely depend on it.
    assert wide_states[0].size == narrow_states[0].size > 0
    assert relative_state_distance(narrow_states, wide_states) <= stored_state_tolerance(
        case, eight_bit=state_dtype != BF16
    )


# ------------------------------------------------------------------ 8-bit state
def _packed_bytes(state: Any) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(state) if x.ndim > 0)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_8_bit_state_takes_a_byte_and_a_share_of_a_scale_per_value(name: str) -> None:
    params = _params()
    tx = OPTIMIZERS[name](state_dtype=U8)
    state = _run(tx, params, tx.init(params), range(2))[1]
    arrays = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, qho.EightBitArray))
    stored = [x for x in arrays if isinstance(x, qho.EightBitArray)]
    per_parameter = {"qhm": 1, "qhadam": 2, "qhadamw-amsgrad": 3}[name]
    assert len(stored) == per_parameter * len(params)
    for x in stored:
        assert x.codes.dtype == jnp.uint8 and x.scales.dtype == jnp.float32
        # A scale per block of 256 values; rows of whole blocks keep their axis.
        blocks = (2, 2) if x.codes.shape == (2, 512) else (-(-x.codes.size // 256),)
        assert x.scales.shape == blocks
    want = sum(p.size + 4 * -(-p.size // 256) for p in params.values())
    assert _packed_bytes(state) == per_parameter * want


@pytest.mark.parametrize("fused", FUSED, ids=["xla", "fused"])
def test_the_8_bit_codes_are_the_rule_every_backend_follows(fused: bool) -> None:
    # QHAdam with betas 0 stores the gradient (signed) and its square
    # (unsigned), encoded: the leaf at position 1 ("b") is state index 4 * 1
    # (+ 1 for the second moment). A NaN keeps to its own code; a block of
    # zeros, a partial last block and tiny values are in there too.
    g = np.random.default_rng(3).standard_normal((50, 7)).astype(np.float32)
    g[3, 3], g[10:20] = np.nan, 0.0
    g[30:40] *= np.float32(1e-6)
    # The last block's scale above 2**126, whose reciprocal XLA would flush
    # to 0 (rounding.EIGHT_BIT_LARGEST_PLAIN_SCALE); its squares overflow.
    g[45:50] *= np.float32(1e38)
    with np.errstate(over="ignore"):
        squares = g * g
    params = {"a": jnp.zeros(3), "b": jnp.zeros((50, 7)), "c": jnp.zeros(2)}
    grads = {"a": jnp.ones(3), "b": jnp.asarray(g), "c": jnp.ones(2)}
    for stochastic in (None, False):
        tx = qho.scale_by_qhadam(
            b1=0.0, b2=0.0, state_dtype=U8, stochastic_rounding=stochastic, fused=fused
        )
        state = tx.init(params)
        for step in (1, 2):
            _, state = jax.jit(tx.update)(grads, state)
            for k, (moment, values) in enumerate(((state.mu, g), (state.nu, squares))):
                # The second moment rounds with its first moment's hashes' high halves.
                source, high = rounding.eight_bit_noise_source(k)
                seed = rounding.rounding_seed(step, rounding.state_index(1, source))
                signed = k == 0
                codes, scales = rounding.eight_bit_encode_reference(
                    values, signed, seed, stochastic is None, high=high
                )
                stored = moment["b"]
                assert stored.signed == signed
                assert np.array_equal(np.asarray(stored.codes).reshape(-1), codes)
                assert np.array_equal(np.asarray(stored.scales), scales)
                decoded = np.asarray(qho.decoded_state(moment)["b"]).reshape(-1)
                want = rounding.eight_bit_decode_reference(codes, scales, signed)
                assert np.array_equal(decoded, want, equal_nan=True)


def test_decoded_state_reads_8_bit_state_and_changes_nothing() -> None:
    params = _params()
    tx = OPTIMIZERS["qhadamw-amsgrad"](state_dtype=U8)
    params, state = _run(tx, params, tx.init(params), range(3))
    saved = jax.tree.map(np.asarray, state)
    decoded = qho.decoded_state(state)
    inner = decoded[0]
    assert isinstance(inner, qho.ScaleByQHAdamAmsgradState)
    wide = OPTIMIZERS["qhadamw-amsgrad"]()
    wide_state = _run(wide, _params(), wide.init(_params()), range(3))[1][0]
    for field in ("mu", "nu", "nu_max"):
        for k, p in params.items():
            value = getattr(inner, field)[k]
            assert value.dtype == jnp.float32 and value.shape == p.shape
            # within a level (12.5%) of the block's largest magnitude of the float32 state
            reference = np.asarray(getattr(wide_state, field)[k])
            scale = np.abs(reference).max()
            assert np.abs(np.asarray(value) - reference).max() <= 0.25 * scale
    assert jax.tree.all(jax.tree.map(np.array_equal, saved, jax.tree.map(np.asarray, state)))
    # A state without 8-bit arrays reads as itself.
    plain = qho.qhadam(1e-2).init(params)
    assert qho.decoded_state(plain) is not None
    assert jax.tree.all(jax.tree.map(np.array_equal, qho.decoded_state(plain), plain))


@pytest.mark.parametrize("fused", FUSED, ids=["xla", "fused"])
def test_8_bit_codes_of_values_over_sixty_decades_are_the_rules(fused: bool) -> None:
    # A million values whose blocks' scales span 1e-13 .. 1e13: the
    # reciprocal-of-the-scale products and the threshold products land on
    # the reference's side of every level (XLA's own arithmetic, no division).
    rng = np.random.default_rng(1)
    n = 1_000_003  # a partial last block
    decades = np.exp(rng.uniform(-30, 30, n // 256 + 1)).repeat(256)[:n]
    g = (rng.standard_normal(n) * decades).astype(np.float32)
    tx = qho.scale_by_qhadam(b1=0.0, b2=0.0, state_dtype=U8, fused=fused)
    params = {"w": jnp.zeros(n)}
    _, state = jax.jit(tx.update)({"w": jnp.asarray(g)}, tx.init(params))
    for k, (moment, values) in enumerate(((state.mu, g), (state.nu, g * g))):
        source, high = rounding.eight_bit_noise_source(k)
        codes, scales = rounding.eight_bit_encode_reference(
            values, k == 0, rounding.rounding_seed(1, source), True, high=high
        )
        assert np.array_equal(np.asarray(moment["w"].codes), codes)
        assert np.array_equal(np.asarray(moment["w"].scales), scales)


def _printed_on_host_devices(script: str, devices: int) -> list[str]:
    """The lines ``script`` prints, run in a fresh process whose JAX has
    ``devices`` CPU devices (XLA reads the flag when it starts)."""
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.split("\n")[:-1]


EXPLICIT_AXES = """
import jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import NamedSharding, PartitionSpec as P, AxisType
import qhoptim.optax as qho
mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Explicit,))
rng = np.random.default_rng(0)
values = {"w": rng.standard_normal((64, 9)), "b": rng.standard_normal((600,))}
for dtype in (jnp.uint8, jnp.bfloat16):
    for name, make in (("qhm", qho.qhm), ("qhadam", qho.qhadam)):
        for fused in (None, False):
            trajectories = []
            for place in (lambda a: a, lambda a: jax.device_put(a, NamedSharding(mesh, P("x")))):
                params = {k: place(jnp.asarray(v, jnp.float32)) for k, v in values.items()}
                tx = make(1e-2, state_dtype=dtype, fused=fused)
                state, update = tx.init(params), jax.jit(tx.update)
                for t in range(3):
                    grads = {k: place(jnp.asarray(np.cos(t + v), jnp.float32))
                             for k, v in values.items()}
                    updates, state = update(grads, state, params)
                    params = optax.apply_updates(params, updates)
                trajectories.append(jax.tree.leaves((params, state)))
            same = all(np.array_equal(a, b) for a, b in zip(*trajectories, strict=True))
            print(jnp.dtype(dtype).name, name, fused, same)
"""


@pytest.mark.skipif(
    not hasattr(jax.sharding, "AxisType"), reason="this JAX has no explicit mesh axes"
)
def test_narrow_state_on_a_mesh_of_explicit_axes_steps_as_on_one_device() -> None:
    # jax.make_mesh's default axes are explicit in newer JAX: there a gather
    # of a replicated table by a sharded index fails, so no narrow state's
    # step reads one. Sharded and unsharded runs store the same bits.
    lines = _printed_on_host_devices(EXPLICIT_AXES, 2)
    assert len(lines) == 8 and all(line.endswith(" True") for line in lines), lines


AUTO_AXES = """
import jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import qhoptim.optax as qho
mesh = Mesh(np.array(jax.devices()), ("x",))
rng = np.random.default_rng(0)
specs = {"cols": P(None, "x"), "rows": P("x", None), "kernel": P(None, None, None, "x"),
         "odd": P(None, "x"), "wide": P(None, "x")}
values = {"cols": rng.standard_normal((64, 512)), "rows": rng.standard_normal((128, 256)),
          "kernel": rng.standard_normal((3, 3, 8, 64)), "odd": rng.standard_normal((6, 100)),
          "wide": rng.standard_normal((8, 4096))}
for name, make in (("qhm", qho.qhm), ("qhadam", qho.qhadam)):
    runs = []
    for sharded in (False, True):
        def place(k, a):
            return jax.device_put(a, NamedSharding(mesh, specs[k])) if sharded else a
        params = {k: place(k, jnp.asarray(v, jnp.float32)) for k, v in values.items()}
        tx = qho.qhadam(1e-2, state_dtype=jnp.uint8) if name == "qhadam" else qho.qhm(
            1e-2, state_dtype=jnp.uint8)
        state = tx.init(params)

        @jax.jit
        def step(params, state, grads):
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        for t in range(3):
            grads = {k: place(k, jnp.asarray(np.cos(t + v), jnp.float32))
                     for k, v in values.items()}
            params, state = step(params, state, grads)
        runs.append((params, state))
    same = all(np.array_equal(a, b) for a, b in zip(*map(jax.tree.leaves, runs), strict=True))
    print(name, "same", same)
    eight_bit = lambda x: isinstance(x, qho.EightBitArray)
    moments = [m for m in jax.tree.leaves(runs[1][1], is_leaf=eight_bit) if eight_bit(m)]
    for k in sorted(values):
        held = {tuple(m.codes.sharding.spec) for m in moments if m.shape == values[k].shape}
        print(name, k, sorted(held, key=repr))
        held = {tuple(m.scales.sharding.spec) for m in moments if m.shape == values[k].shape}
        print(name, k, "scales", sorted(held, key=repr))
"""


def test_an_8_bit_state_on_a_mesh_of_automatic_axes_stays_split_as_its_parameter() -> None:
    # XLA places what it can't tell the split of: codes made of a flattened
    # array were put on every device where the parameter is split along a
    # later axis. Blocks keep the leading axes of an array whose trailing
    # axes hold whole blocks, and the codes (and scales) stay split as their
    # parameter; the bits are those of one device ("odd" holds no whole
    # block in its rows and is flattened: its bits are checked too).
    lines = _printed_on_host_devices(AUTO_AXES, 4)
    for name in ("qhm", "qhadam"):
        assert f"{name} same True" in lines, lines
        assert f"{name} cols [(None, 'x')]" in lines, lines
        assert f"{name} rows [('x',)]" in lines or f"{name} rows [('x', None)]" in lines, lines
        assert f"{name} kernel [(None, None, None, 'x')]" in lines, lines
        # The scales too, where each part of the split holds whole blocks
        # ("wide": 1,024 columns a device, (8, 16) scales).
        assert f"{name} wide scales [(None, 'x')]" in lines, lines
        assert f"{name} rows scales [('x',)]" in lines or (
            f"{name} rows scales [('x', None)]" in lines
        ), lines


INIT_SCALES = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import qhoptim.optax as qho
mesh = Mesh(np.array(jax.devices()), ("x",))
specs = {"w": P("x"), "d": P(None, "x")}
params = {k: jax.device_put(jnp.ones(s, jnp.float32), NamedSharding(mesh, specs[k]))
          for k, s in {"w": (1024, 3), "d": (2, 520)}.items()}
state = qho.qhadam(1e-2, state_dtype=jnp.uint8).init(params)
for k in ("w", "d"):
    scales = state[0].mu[k].scales
    print(k, tuple(scales.sharding.spec), len(scales.sharding.device_set))
"""


def test_an_8_bit_init_splits_the_scales_as_its_steps_do() -> None:
    # They were made on one device: as the parameter's first axis where each
    # part is whole blocks (w: 3,072 values, two parts of 6 blocks), else on
    # every device (d, split along its second axis).
    assert _printed_on_host_devices(INIT_SCALES, 2) == ["w ('x',) 2", "d () 2"]


@pytest.mark.parametrize(
    ("param_dtype", "grad_dtype", "state_dtype"),
    [
        (jnp.float32, BF16, BF16),
        (jnp.float32, BF16, U8),
        (BF16, BF16, U8),
        (jnp.float16, jnp.float16, U8),
    ],
)
@pytest.mark.parametrize("name", ["qhm", "qhadam", "qhmuon"])
def test_a_narrow_state_of_16_bit_gradients_decays_as_in_float32(
    name: str, param_dtype: Any, grad_dtype: Any, state_dtype: Any
) -> None:
    # In bfloat16, 0.999 * v rounds back to v: a state stepped in the
    # gradients' dtype (bfloat16 gradients of float32 parameters, after a
    # bfloat16 all-reduce) would never decay. After a gradient of ones and a
    # thousand of zeros the rule's averages are the first step's times
    # beta ** 1000 (stochastic rounding keeps the mean of 4,096 values).
    beta = 0.999
    make = {
        "qhm": lambda: qho.qhm(1e-3, momentum=beta, state_dtype=state_dtype),
        "qhadam": lambda: qho.qhadam(1e-3, b1=beta, b2=beta, state_dtype=state_dtype),
        "qhmuon": lambda: qho.qhmuon(1e-3, beta=beta, state_dtype=state_dtype),
    }[name]
    tx = make()
    params = {"w": jnp.zeros((64, 64), param_dtype)}
    update = jax.jit(tx.update)
    _, state = update({"w": jnp.ones((64, 64), grad_dtype)}, tx.init(params), params)

    def means(state: Any) -> list[float]:
        leaves = jax.tree.leaves(qho.decoded_state(state))
        return [float(jnp.mean(x.astype(jnp.float64))) for x in leaves if x.size == 64 * 64]

    first = means(state)
    zeros = {"w": jnp.zeros((64, 64), grad_dtype)}
    for _ in range(1000):
        _, state = update(zeros, state, params)
    later = means(state)
    assert len(first) == (2 if name == "qhadam" else 1)
    for before, after in zip(first, later, strict=True):
        assert after / before == pytest.approx(beta**1000, rel=0.01)


@pytest.mark.parametrize("fused", [None, False], ids=["default", "xla"])
def test_an_8_bit_state_with_its_scales_in_one_axis_steps_and_reads_as_it_would_shaped(
    fused: Any,
) -> None:
    # Earlier 2.0.0 development builds kept every state's scales in one axis;
    # rows of whole blocks keep their leading axes now ((2, 512): (2, 2)).
    # Such a state reads and steps to the same numbers.
    params = {"r": jnp.linspace(-1.0, 1.0, 1024, dtype=jnp.float32).reshape(2, 512)}
    grads = {"r": jnp.cos(params["r"] * 7.0)}
    tx = qho.qhadam(1e-2, nu1=0.7, state_dtype=U8, fused=fused)
    _, shaped = tx.update(grads, tx.init(params), params)
    assert shaped[0].mu["r"].scales.shape == (2, 2)

    def one_axis(x: Any) -> Any:
        if not isinstance(x, qho.EightBitArray):
            return x
        return qho.EightBitArray(x.codes, x.scales.reshape(-1), x.signed)

    flat = jax.tree.map(one_axis, shaped, is_leaf=lambda x: isinstance(x, qho.EightBitArray))
    assert flat[0].mu["r"].scales.shape == (4,)
    for got, want in zip(
        jax.tree.leaves(qho.decoded_state(flat)),
        jax.tree.leaves(qho.decoded_state(shaped)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    from_flat = tx.update(grads, flat, params)
    from_shaped = tx.update(grads, shaped, params)
    for got, want in zip(jax.tree.leaves(from_flat), jax.tree.leaves(from_shaped), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # Scales of another count are not this array's: refused before anything steps.
    wrong = jax.tree.map(
        lambda x: (
            qho.EightBitArray(x.codes, x.scales[:-1], x.signed)
            if isinstance(x, qho.EightBitArray)
            else x
        ),
        shaped,
        is_leaf=lambda x: isinstance(x, qho.EightBitArray),
    )
    with pytest.raises(ValueError, match=r"a scale per block of 256 values, of shape \(2, 2\)"):
        tx.update(grads, wrong, params)
    # Restored into init's structure by flax, it has the shaped scales at once,
    # so that what needs a step's state to keep its shapes (lax.scan's carry)
    # takes it.
    from flax import serialization

    restored = serialization.from_bytes(tx.init(params), serialization.to_bytes(flat))
    assert restored[0].mu["r"].scales.shape == (2, 2)

    def step(state: Any, _: None) -> tuple[Any, None]:
        return tx.update(grads, state, params)[1], None

    scanned = jax.lax.scan(step, restored, length=2)[0]
    stepped = jax.lax.scan(step, shaped, length=2)[0]
    for got, want in zip(jax.tree.leaves(scanned), jax.tree.leaves(stepped), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("n", [4, 256, 700])
def test_decoded_state_reads_a_batch_of_8_bit_states_each_with_its_own_scales(n: int) -> None:
    # jax.vmap of init and update (an ensemble) batches the codes and the
    # scales: each member is decoded with its own scales, as it alone would be.
    tx = qho.qhadam(1e-2, nu1=0.7, state_dtype=U8)
    params = jnp.zeros((3, n))
    grads = jnp.asarray([0.1, 1.0, 10.0])[:, None] * jnp.linspace(0.5, 1.0, n)
    state = jax.vmap(tx.init)(params)
    _, state = jax.vmap(tx.update)(grads, state, params)
    batched = qho.decoded_state(state)
    for member in range(3):
        alone = qho.decoded_state(jax.tree.map(lambda x, m=member: x[m], state))
        for got, want in zip(jax.tree.leaves(batched), jax.tree.leaves(alone), strict=True):
            np.testing.assert_array_equal(np.asarray(got[member]), np.asarray(want))
    mu = batched[0].mu
    assert float(mu[2, -1]) / float(mu[0, -1]) == pytest.approx(100.0, rel=0.05)
    stored = state[0].mu
    wrong = qho.EightBitArray(stored.codes[:2], stored.scales, stored.signed)
    with pytest.raises(ValueError, match="the same batch"):
        qho.decoded_state(wrong)
    flat = qho.EightBitArray(stored.codes[0], stored.scales[0, :1], stored.signed)
    if n > 256:
        with pytest.raises(ValueError, match="a scale per block of 256 values"):
            qho.decoded_state(flat)
