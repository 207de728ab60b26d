"""qhoptim.optax's C++ state step (``fused``): a bfloat16 or 8-bit state of
float32 parameters stepped and stored in one XLA custom call on the CPU.

The rule is :mod:`qhoptim.rounding`'s, bit for bit where the moving average is
exact (``test_optax_state_dtype.py`` runs its rule, resume and conformance
tests on both paths). Elsewhere a bfloat16 value is one of the two bfloat16
neighbours of its average computed within float32's rounding; an 8-bit state
is the NumPy statement of the rule's bytes for the averages computed in
float32 as written. The stored bits are XLA's operations' own but where XLA
contracts a product and a sum into one fused multiply-add.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qhoptim.optax as qho
from qhoptim import rounding, rules
from qhoptim.optax import _extension

#: Set where the step must build (the optax nox session): its tests fail
#: rather than skip there.
REQUIRED = os.environ.get("QHOPTIM_REQUIRE_FUSED", "") not in ("", "0")
pytestmark = pytest.mark.skipif(
    not REQUIRED and not _extension.state_extension_available(),
    reason=f"the C++ state step does not build here: {_extension._built()[1]}",
)


def test_the_step_builds() -> None:
    target, reason = _extension._built()
    assert target == _extension.TARGET, reason


BF16, U8 = jnp.bfloat16, jnp.uint8
#: The narrow states the call stores, with the name of its target and how the
#: state's arrays are spelled in the call's result types.
NARROW = {
    "bfloat16": (BF16, _extension.TARGET, "bf16>"),
    "8-bit": (U8, _extension.EIGHT_BIT_TARGET, "ui8>"),
}
#: Shapes that cover a 0-d and an empty parameter, and one of more than
#: 2**17 values, which is stepped in slices on several threads.
# "rows": rows of whole 8-bit blocks, whose scales keep the leading axis (2, 2).
SHAPES = {
    "big": (300, 500),
    "conv": (8, 3, 3, 3),
    "empty": (0, 4),
    "rows": (2, 512),
    "scalar": (),
    "vector": (7,),
}
CONFIGS = {
    "qhm": lambda **kw: qho.qhm(0.1, momentum=0.9, nu=0.7, **kw),
    "qhm-nu1": lambda **kw: qho.qhm(0.1, momentum=0.99, nu=1.0, **kw),
    "qhadam": lambda **kw: qho.qhadam(1e-2, nu1=0.7, **kw),
    "qhadam-nu2": lambda **kw: qho.qhadam(1e-2, b1=0.8, b2=0.99, nu1=0.7, nu2=0.5, **kw),
    "qhadamw-amsgrad": lambda **kw: qho.qhadamw(1e-2, nu1=0.7, nu2=0.8, amsgrad=True, **kw),
}


def _params() -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    return {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in SHAPES.items()}


def _grads(t: int) -> dict[str, jax.Array]:
    rng = np.random.default_rng(100 + t)
    # Magnitudes over decades, so that the averages cancel and round somewhere.
    return {
        k: jnp.asarray(rng.standard_normal(s) * 10.0 ** rng.integers(-4, 2, s), jnp.float32)
        for k, s in SHAPES.items()
    }


def _calls(tx: Any, params: Any, narrow: str = "bfloat16") -> list[int]:
    """The number of states each call of the C++ step in ``tx``'s jitted update stores."""
    _, target, spelled = NARROW[narrow]
    text = jax.jit(tx.update).lower(_grads_like(params), tx.init(params), params).as_text()
    return [
        line.split("->", 1)[1].count(spelled)
        for line in text.splitlines()
        if f"custom_call @{target}(" in line
    ]


def _grads_like(params: Any) -> Any:
    return jax.tree.map(jnp.ones_like, params)


@pytest.mark.parametrize("narrow", list(NARROW))
@pytest.mark.parametrize("fused", [None, True])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_float32_parameter_with_a_narrow_state_takes_one_call(
    name: str, fused: Any, narrow: str
) -> None:
    params = _params()
    dtype = NARROW[narrow][0]
    states = 1 if name.startswith("qhm") else 3 if "amsgrad" in name else 2
    assert _calls(CONFIGS[name](state_dtype=dtype, fused=fused), params, narrow) == [
        states * len(SHAPES)
    ]
    assert _calls(CONFIGS[name](state_dtype=dtype, fused=False), params, narrow) == []


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"state_dtype": BF16, "stochastic_rounding": False}],
    ids=["float32-state", "bfloat16-nearest"],
)
def test_other_states_keep_xla_s_operations(kwargs: dict[str, Any]) -> None:
    for narrow in NARROW:
        assert _calls(qho.qhadam(1e-2, **kwargs), _params(), narrow) == []


@pytest.mark.parametrize("narrow", list(NARROW))
def test_parameters_of_other_dtypes_keep_xla_s_operations(narrow: str) -> None:
    params = {"half": jnp.zeros((4, 4), BF16), "single": jnp.zeros(5, jnp.float32)}
    assert _calls(qho.qhm(0.1, state_dtype=NARROW[narrow][0]), params, narrow) == [1]


def test_8_bit_states_of_another_signedness_keep_xla_s_operations() -> None:
    # The call reads the first moment as signed and the second as unsigned, as
    # init makes them; a state built otherwise steps in XLA's operations.
    params = {"w": jnp.zeros((4, 3), jnp.float32)}
    tx = qho.qhadam(1e-2, state_dtype=U8, fused=True)
    state = tx.init(params)
    mu = state[0].mu["w"]
    flipped = qho.EightBitArray(mu.codes, mu.scales, signed=False)
    state = (state[0]._replace(mu={"w": flipped}), *state[1:])
    text = jax.jit(tx.update).lower(params, state, params).as_text()
    assert _extension.EIGHT_BIT_TARGET not in text
    assert (
        _extension.EIGHT_BIT_TARGET
        in jax.jit(tx.update).lower(params, tx.init(params), params).as_text()
    )


def _neighbours(value: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The bfloat16 values at or below and at or above each float64 ``value``
    (float32 first: a bfloat16 is a float32 with 16 low bits zero)."""
    bits = np.asarray(value, np.float32).view(np.uint32).astype(np.uint64)
    down = (bits & 0xFFFF0000).astype(np.uint32).view(np.float32).astype(np.float64)
    up = ((bits & 0xFFFF0000) + 0x10000).astype(np.uint32).view(np.float32).astype(np.float64)
    # For negative values the truncated bits are the one nearer zero, above.
    lower = np.where(value < 0, up, down)
    upper = np.where(value < 0, down, up)
    return np.minimum(lower, upper), np.maximum(lower, upper)


def _steps(name: str, fused: bool, state: Any, steps: range, state_dtype: Any = BF16) -> Any:
    params = _params()
    tx = CONFIGS[name](state_dtype=state_dtype, fused=fused)
    state = tx.init(params) if state is None else state
    update = jax.jit(tx.update)
    for t in steps:
        _, state = update(_grads(t), state, params)
    return state


@pytest.mark.parametrize("name", ["qhm", "qhadam-nu2", "qhadamw-amsgrad"])
def test_each_stored_value_rounds_its_average_up_or_down(name: str) -> None:
    # One step from a stored state: the stored value is one of the bfloat16
    # values bracketing the exact average, give or take float32's rounding of
    # its two terms (and of the square).
    before = _steps(name, True, None, range(3))
    after = _steps(name, True, before, range(3, 4))
    decays = {"qhm": (0.9, None), "qhadam-nu2": (0.8, 0.99), "qhadamw-amsgrad": (0.9, 0.999)}[name]
    g = [np.asarray(x, np.float64) for x in jax.tree.leaves(_grads(3))]
    eps = float(np.finfo(np.float32).eps)
    fields = ["momentum_buffer"] if name == "qhm" else ["mu", "nu"]
    for field, decay in zip(fields, decays, strict=False):
        old = jax.tree.leaves(getattr(before[0], field))
        new = jax.tree.leaves(getattr(after[0], field))
        for grad, stored, stepped in zip(g, old, new, strict=True):
            x = grad * grad if field == "nu" else grad
            old64 = np.asarray(stored, np.float64)
            exact = decay * old64 + (1 - decay) * x
            slack = 4 * eps * (np.abs(decay * old64) + np.abs((1 - decay) * x))
            low, _ = _neighbours(exact - slack)
            _, high = _neighbours(exact + slack)
            got = np.asarray(stepped, np.float64)
            assert np.all((low <= got) & (got <= high)), field


#: Each configuration's moving averages: (decay, weight) of the first (QHM's
#: buffer) and of the second moment, as the transformations compute them.
AVERAGES = {
    "qhm": rules.qhm_coefficients(0.9, 0.7)[:2],
    "qhm-nu1": rules.qhm_coefficients(0.99, 1.0)[:2],
    "qhadam": rules.qhadam_moment_weights(0.9, 0.999),
    "qhadam-nu2": rules.qhadam_moment_weights(0.8, 0.99),
    "qhadamw-amsgrad": rules.qhadam_moment_weights(0.9, 0.999),
}


def _moments(state: Any) -> list[list[qho.EightBitArray]]:
    """Each parameter's 8-bit states, in the call's order (buffer; or first and
    second moment, and the running maximum)."""
    inner = next(s for s in state if hasattr(s, "count"))
    fields = [f for f in ("momentum_buffer", "mu", "nu", "nu_max") if hasattr(inner, f)]
    is_8_bit = {"is_leaf": lambda x: isinstance(x, qho.EightBitArray)}
    per_field = [jax.tree.leaves(getattr(inner, f), **is_8_bit) for f in fields]
    return [list(states) for states in zip(*per_field, strict=True)]


@pytest.mark.parametrize("stochastic", [None, False], ids=["stochastic", "nearest"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_8_bit_states_are_the_rule_s_bytes_for_the_float32_averages(
    name: str, stochastic: Any
) -> None:
    # One step from a stored 8-bit state: each state's codes and scales are the
    # NumPy statement's (qhoptim.rounding.eight_bit_encode_reference, with the
    # noise rounding.eight_bit_noise_source names) for the
    # moving averages of the decoded state computed in float32, each product
    # and sum rounded as written -- every byte, for every shape (the big one
    # in slices on several threads, blocks cut by the end of a parameter).
    params = _params()
    tx = CONFIGS[name](state_dtype=U8, stochastic_rounding=stochastic, fused=True)
    update = jax.jit(tx.update)
    state = tx.init(params)
    for t in range(3):
        _, state = update(_grads(t), state, params)
    _, after = update(_grads(3), state, params)
    b1, w1, *second = (np.float32(w) for w in AVERAGES[name])
    grads = [np.asarray(g).reshape(-1) for g in jax.tree.leaves(_grads(3))]
    for position, (g, old, new) in enumerate(
        zip(grads, _moments(state), _moments(after), strict=True)
    ):
        decoded = [
            rounding.eight_bit_decode_reference(np.asarray(x.codes).reshape(-1), x.scales, x.signed)
            for x in old
        ]
        averages = [b1 * decoded[0] + w1 * g]
        if second:
            b2, w2 = second
            averages.append(b2 * decoded[1] + w2 * (g * g))
        if len(old) == 3:  # the running maximum (NaN from either side, as jnp.maximum)
            averages.append(np.maximum(decoded[2], averages[1]))
        for k, (value, stored) in enumerate(zip(averages, new, strict=True)):
            source, high = rounding.eight_bit_noise_source(k)
            seed = rounding.rounding_seed(4, rounding.state_index(position, source))
            codes, scales = rounding.eight_bit_encode_reference(
                value, stored.signed, seed, stochastic is None, high=high
            )
            assert np.array_equal(np.asarray(stored.codes).reshape(-1), codes), (position, k)
            assert np.asarray(stored.scales).tobytes() == scales.tobytes(), (position, k)


@pytest.mark.parametrize("narrow", list(NARROW))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_stored_bits_are_xla_s_but_for_its_fused_multiply_adds(name: str, narrow: str) -> None:
    # One step of each path from one state. A wrong noise (another key, seed
    # or slice offset) changes about half the values; XLA's contractions a
    # few in 100,000 (an 8-bit value's neighbours are a level apart: fewer).
    dtype = NARROW[narrow][0]
    start = _steps(name, False, None, range(4), dtype)
    xla = jax.tree.leaves(_steps(name, False, start, range(4, 5), dtype))
    cpp = jax.tree.leaves(_steps(name, True, start, range(4, 5), dtype))
    differing = total = 0
    for a, b in zip(xla, cpp, strict=True):
        if a.dtype not in (BF16, U8):  # the count, an 8-bit state's scales
            close = np.isclose(np.asarray(a), np.asarray(b), rtol=4e-7, atol=0)
            assert np.all(close), (a, b)
            continue
        bits = np.dtype(f"uint{8 * a.dtype.itemsize}")  # one per value
        differing += int(np.sum(np.asarray(a).view(bits) != np.asarray(b).view(bits)))
        total += a.size
    assert total > 0
    assert differing <= total * 1e-3, (differing, total)


@pytest.mark.parametrize("narrow", list(NARROW))
def test_the_update_is_xla_s_on_both_paths(narrow: str) -> None:
    params = _params()
    results = []
    for fused in (False, True):
        tx = qho.qhadam(1e-2, nu1=0.7, state_dtype=NARROW[narrow][0], fused=fused)
        updates, _ = jax.jit(tx.update)(_grads(0), tx.init(params), params)
        results.append(updates)
    for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1]), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("narrow", list(NARROW))
def test_donated_state_and_parameters_step_as_kept_ones(narrow: str) -> None:
    tx = qho.qhadam(1e-2, nu1=0.7, amsgrad=True, state_dtype=NARROW[narrow][0], fused=True)

    def step(params: Any, state: Any, grads: Any) -> Any:
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    runs = []
    for donate in ((), (0, 1)):
        params = _params()
        state, fn = tx.init(params), jax.jit(step, donate_argnums=donate)
        for t in range(3):
            params, state = fn(params, state, _grads(t))
        runs.append(jax.tree.leaves((params, state)))
    for a, b in zip(*runs, strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.mark.parametrize("narrow", list(NARROW))
def test_under_vmap_each_member_steps_as_alone(narrow: str) -> None:
    tx = qho.qhm(0.1, momentum=0.9, nu=0.7, state_dtype=NARROW[narrow][0], fused=True)
    members = jnp.asarray(np.random.default_rng(5).standard_normal((3, 600, 5)), jnp.float32)
    state = jax.vmap(tx.init)(members)
    _, batched = jax.jit(jax.vmap(tx.update))(members, state, members)
    for i in range(3):
        _, alone = jax.jit(tx.update)(members[i], tx.init(members[i]), members[i])
        for a, b in zip(jax.tree.leaves(batched[0]), jax.tree.leaves(alone[0]), strict=True):
            assert np.asarray(a[i]).tobytes() == np.asarray(b).tobytes()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"fused": 1}, TypeError, r"fused must be None or a bool; received fused=1"),
        ({"fused": True}, ValueError, r"received state_dtype=None$"),
        ({"fused": True, "state_dtype": jnp.float32}, ValueError, r"state_dtype='float32'"),
        (
            {"fused": True, "state_dtype": BF16, "stochastic_rounding": False},
            ValueError,
            r"state_dtype='bfloat16', rounded stochastically: False$",
        ),
    ],
)
def test_invalid_settings_are_refused(kwargs: dict[str, Any], error: type, match: str) -> None:
    for make in (qho.qhm, qho.qhadam, qho.qhadamw):
        with pytest.raises(error, match=match):
            make(1e-2, **kwargs)


def test_without_a_build_none_keeps_xla_and_true_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_extension, "_built", lambda: (None, "it needs a C++ compiler"))
    params = _params()
    assert _calls(qho.qhm(0.1, state_dtype=BF16), params) == []
    tx = qho.qhm(0.1, state_dtype=BF16, fused=True)
    with pytest.raises(RuntimeError, match=r"it needs a C\+\+ compiler.*fused=False"):
        tx.update(_grads(0), tx.init(params), params)


def test_the_first_use_may_be_inside_a_jitted_function() -> None:
    def step(x: jax.Array) -> jax.Array:
        target, reason = _extension._build_or_load()  # loads the cached build, smoke test included
        assert target == _extension.TARGET, reason
        return x

    jax.jit(step)(jnp.zeros(()))


SHARDED = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import qhoptim.optax as qho
sharding = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
params = {"w": jax.device_put(jnp.ones((64, 8), jnp.float32), sharding)}
for fused in (None, True, False):
    tx = qho.qhadam(1e-2, nu1=0.7, state_dtype=jnp.STATE_DTYPE, fused=fused)
    state = tx.init(params)
    step = jax.jit(tx.update)
    text = step.lower(params, state, params).as_text()
    _, state = step(params, state, params)
    mu = getattr(state[0].mu["w"], "codes", state[0].mu["w"])  # an 8-bit state's codes
    print(fused, "qhoptim_store" in text, tuple(mu.sharding.spec))
"""


def _in_a_process_of_its_own(script: str, narrow: str, **environment: str) -> str:
    """What ``script`` prints, run for the ``narrow`` state (its ``STATE_DTYPE``)
    in a fresh Python with ``environment`` added: JAX reads its device count and
    x64 setting once, when it is imported."""
    env = dict(os.environ, **environment)
    script = script.replace("STATE_DTYPE", jnp.dtype(NARROW[narrow][0]).name)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True
    )
    return result.stdout


@pytest.mark.parametrize("narrow", list(NARROW))
def test_on_several_cpu_devices_none_keeps_xla_and_the_state_s_sharding(narrow: str) -> None:
    stdout = _in_a_process_of_its_own(
        SHARDED, narrow, XLA_FLAGS="--xla_force_host_platform_device_count=2"
    )
    lines = stdout.split("\n")
    assert lines[:3] == [
        "None False ('x',)",
        "True True ()",  # documented: gathered, and replicated
        "False False ('x',)",
    ], stdout


@pytest.mark.parametrize("narrow", list(NARROW))
def test_a_gradient_through_the_update_is_xla_s(narrow: str) -> None:
    # jax.grad through an update (meta-learning, hypergradients) differentiates
    # both branches of the platform's choice; the call's operands are constants.
    params = {"w": jnp.asarray(np.random.default_rng(7).standard_normal((600, 5)), jnp.float32)}
    results = []
    for fused in (False, None):
        tx = qho.qhadam(1e-2, nu1=0.7, state_dtype=NARROW[narrow][0], fused=fused)
        state = tx.init(params)

        def loss(grads: Any, tx: Any = tx, state: Any = state) -> jax.Array:
            updates, _ = tx.update(grads, state, params)
            return sum(jnp.sum(u**2) for u in jax.tree.leaves(updates))

        results.append(jax.jit(jax.grad(loss))(params))
    assert np.array_equal(np.asarray(results[0]["w"]), np.asarray(results[1]["w"]))


@pytest.mark.parametrize("fused", [False, None])
@pytest.mark.parametrize("narrow", list(NARROW))
def test_a_stored_state_has_no_derivative_on_either_path(narrow: str, fused: Any) -> None:
    # A loss that reads the stored state (a later step's, unrolled) gets no
    # gradient through it: a bfloat16 state is a bit cast, an 8-bit state's
    # scales (its blocks' maxima, which XLA would differentiate) are stopped.
    params = {"w": jnp.asarray(np.random.default_rng(7).standard_normal((600, 5)), jnp.float32)}
    tx = qho.qhadam(1e-2, nu1=0.7, state_dtype=NARROW[narrow][0], fused=fused)

    def loss(grads: Any) -> jax.Array:
        _, state = tx.update(grads, tx.init(params), params)
        stored = jax.tree.leaves(qho.decoded_state(state))
        return sum(jnp.sum(x.astype(jnp.float32)) for x in stored if x.ndim > 0)

    gradient = jax.jit(jax.grad(loss))(params)
    assert not np.any(np.asarray(gradient["w"]))


@pytest.mark.parametrize("narrow", list(NARROW))
def test_inside_shard_map_xla_steps_the_state(narrow: str) -> None:
    # Per-device values inside shard_map: XLA's branch (the call's results
    # would not carry the values' varying axes).
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    spec = jax.sharding.PartitionSpec("x")
    params = {"w": jnp.asarray(np.random.default_rng(8).standard_normal((4, 3)), jnp.float32)}
    states = []
    for fused in (False, None):
        tx = qho.qhm(0.1, momentum=0.9, nu=0.7, state_dtype=NARROW[narrow][0], fused=fused)
        update = jax.shard_map(
            lambda g, s, tx=tx: tx.update(g, s)[1][0].momentum_buffer,
            mesh=mesh,
            in_specs=(spec, jax.sharding.PartitionSpec()),
            out_specs=spec,
        )
        states.append(jax.jit(update)(params, tx.init(params)))
    a, b = (jax.tree.leaves(s["w"]) for s in states)
    assert [np.asarray(x).tobytes() for x in a] == [np.asarray(x).tobytes() for x in b]


def test_a_transfer_guard_does_not_stop_the_first_build(monkeypatch: pytest.MonkeyPatch) -> None:
    with jax.transfer_guard("disallow"):
        target, reason = _extension._build_or_load()
    assert target == _extension.TARGET, reason


WITHOUT_X64 = """
import jax, jax.numpy as jnp, numpy as np
import qhoptim.optax as qho
assert not jax.config.jax_enable_x64
rng = np.random.default_rng(0)
params = {"w": jnp.asarray(rng.standard_normal((70, 30)), jnp.float32)}
grads = {"w": jnp.asarray(rng.standard_normal((70, 30)) * 1e-2, jnp.float32)}
states = {}
for fused in (False, True):
    tx = qho.qhadam(
        1e-2, b1=0.8, nu1=0.7, nu2=0.9, amsgrad=True, state_dtype=jnp.STATE_DTYPE, fused=fused
    )
    state, update = tx.init(params), jax.jit(tx.update)
    text = update.lower(grads, state, params).as_text()
    for _ in range(3):
        _, state = update(grads, state, params)
    states[fused] = state
    print(fused, "qhoptim_store" in text)
for a, b in zip(jax.tree.leaves(states[False]), jax.tree.leaves(states[True])):
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype == np.float32:  # an 8-bit state's scales: maxima of averages, to rounding
        a, b = np.isclose(a, b, rtol=4e-7, atol=0), np.ones(a.shape, bool)
    elif a.dtype != np.int32:
        bits = np.dtype(f"uint{8 * a.dtype.itemsize}")
        a, b = a.view(bits), b.view(bits)
    print(int(np.sum(a != b)), a.size)
"""


@pytest.mark.parametrize("narrow", list(NARROW))
def test_without_x64_the_call_steps_as_xla_does(narrow: str) -> None:
    # This directory's tests run with jax_enable_x64 (conftest.py); JAX's default
    # is without it, where the weights and counts are float32 and int32 throughout.
    stdout = _in_a_process_of_its_own(WITHOUT_X64, narrow, JAX_ENABLE_X64="0")
    lines = stdout.split("\n")
    assert lines[:2] == ["False False", "True True"], stdout
    for line in lines[2:]:
        if line:
            differing, total = map(int, line.split())
            assert differing <= max(1, total // 1000), stdout


@pytest.mark.parametrize("state_dtype", [jnp.bfloat16, jnp.uint8])
@pytest.mark.parametrize("name", ["qhm", "qhadam"])
@pytest.mark.parametrize("shape", [(), (1,)])
def test_a_gradient_that_broadcasts_against_its_parameter_steps_as_in_xla(
    name: str, state_dtype: Any, shape: tuple[int, ...]
) -> None:
    # optax.adam takes a gradient of shape () or (1,) for a (1000,) parameter;
    # the C++ step takes a gradient of its state's shape, so this one takes
    # XLA's operations (it failed inside the call).
    make = {"qhm": qho.qhm, "qhadam": qho.qhadam}[name]
    params = jnp.zeros(1000, jnp.float32)
    grads = jnp.full(shape, 0.5, jnp.float32)
    results = []
    for fused in (True, False):
        tx = make(1e-2, state_dtype=state_dtype, fused=fused)
        state = tx.init(params)
        for _ in range(2):
            updates, state = jax.jit(tx.update)(grads, state, params)
        results.append((updates, state))
    for got, want in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1]), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
