"""qhoptim.mlx with ``state_dtype``: state in bfloat16, stochastically rounded.

The rounding is :mod:`qhoptim.rounding`'s, bit for bit (the same as torch's,
optax's and Keras's); the trajectories follow float32 state's on the
conformance problems; a resumed run rounds as the uninterrupted one.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map, tree_unflatten

import qhoptim.mlx as qhmlx
from conformance.adapters.mlx import make_optimizer
from conformance.cases import (
    narrow_state_cases,
    narrow_state_tolerance,
    relative_state_distance,
    stored_state_tolerance,
)
from conformance.problems import get_problem
from qhoptim import rounding
from qhoptim.mlx import _extension

BF16 = mx.bfloat16
OPTIMIZERS = {
    "qhm": lambda **kw: qhmlx.QHM(0.1, momentum=0.9, nu=0.7, **kw),
    "qhadam": lambda **kw: qhmlx.QHAdam(1e-2, nus=(0.7, 1.0), **kw),
    "qhadamw-amsgrad": lambda **kw: qhmlx.QHAdamW(1e-2, nus=(0.7, 0.8), amsgrad=True, **kw),
}
# NaNs made from bits (as uint32), with payloads in the half bfloat16 drops.
NAN_PAYLOADS = [0x7FFFFFFF, 0xFFFFFFFF, 0x7F80FFFF, 0x7FC00000]


def _params() -> dict[str, mx.array]:
    rng = np.random.default_rng(0)
    shapes = {"w": (64, 33), "b": (33,), "c": (7,)}
    return {k: mx.array(rng.standard_normal(s).astype(np.float32)) for k, s in shapes.items()}


def _grads(params: dict[str, mx.array], t: int) -> dict[str, mx.array]:
    rng = np.random.default_rng(1000 + t)
    return {k: mx.array(rng.standard_normal(p.shape).astype(np.float32)) for k, p in params.items()}


def _run(opt: Any, params: dict[str, mx.array], steps: range) -> dict[str, mx.array]:
    for t in steps:
        params = opt.apply_gradients(_grads(params, t), params)
        mx.eval(params, opt.state)
    return params


def _state_arrays(opt: Any) -> list[mx.array]:
    return [v for k, v in tree_flatten(opt.state) if k != "step" and "learning_rate" not in k]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_state_is_stored_in_bfloat16_at_half_the_bytes(name: str) -> None:
    narrow, wide = OPTIMIZERS[name](state_dtype=BF16), OPTIMIZERS[name]()
    params = _params()
    _run(narrow, params, range(2))
    _run(wide, params, range(2))
    assert {x.dtype for x in _state_arrays(narrow)} == {BF16}
    narrow_bytes = sum(x.nbytes for x in _state_arrays(narrow))
    assert 2 * narrow_bytes == sum(x.nbytes for x in _state_arrays(wide))
    if name == "qhadam":  # 4 bytes per parameter instead of 8
        assert narrow_bytes == 4 * sum(p.size for p in params.values())


@pytest.mark.parametrize("fused", [False, True], ids=["operations", "fused"])
@pytest.mark.parametrize("compiled", [False, True])
def test_the_rounding_is_the_rule_every_backend_follows(compiled: bool, fused: bool) -> None:
    # With momentum 0 QHM stores the gradient itself, rounded, and with betas
    # 0 QHAdam its gradient and the gradient squared: the stored bits are the
    # rule's of those numbers. "a" and "b" share a shape (and the positions
    # the rounding reads); each state has its own seed, rounding.state_index
    # of the parameter's place in the gradients' tree and of which state it is.
    # AMSGrad's maximum (state 2) is the rounded second moment's only at the
    # first step. "s", a 0-d parameter, keeps its shape. MLX's operations
    # (fused=False) and the C++ step (fused=True) alike.
    if fused and not _extension.fused_extension_available():
        pytest.skip("qhoptim.mlx's C++ step does not build here (a C++ compiler and nanobind)")
    rng = np.random.default_rng(3)
    shape = (50, 7)
    grads = {
        "a": mx.array(rng.standard_normal(shape).astype(np.float32)) * 1e-3,
        "b": mx.array(rng.standard_normal(shape).astype(np.float32)) * 1e-3,
        "c": mx.ones(2),
        "s": mx.array(np.float32(1.2345e-3)),
        # NaNs made from bits, whose payloads fill the half bfloat16 drops: the
        # rule adds them no noise (it carried 0x7FFFFFFF into the sign).
        "z": mx.array(np.array(NAN_PAYLOADS, np.uint32).view(np.float32)),
    }
    narrow = {"state_dtype": BF16, "fused": fused}
    amsgrad = qhmlx.QHAdam(1e-3, betas=(0.0, 0.0), amsgrad=True, **narrow)
    for opt, moments, steps in [
        (qhmlx.QHM(0.1, momentum=0.0, nu=0.7, **narrow), {"momentum_buffer": 1}, 2),
        (qhmlx.QHAdam(1e-3, betas=(0.0, 0.0), **narrow), {"m": 1, "v": 2}, 2),
        (amsgrad, {"m": 1, "v": 2, "v_max": 2}, 1),
    ]:
        params = {k: mx.zeros(g.shape) for k, g in grads.items()}
        opt.init(params)

        def step(params: dict[str, mx.array], opt: Any = opt) -> dict[str, mx.array]:
            return opt.apply_gradients(grads, params)

        run = mx.compile(step, inputs=opt.state, outputs=opt.state) if compiled else step
        for t in range(1, steps + 1):
            params = run(params)
            mx.eval(params, opt.state)
            assert all(params[k].shape == g.shape for k, g in grads.items())
            for position, name in enumerate(grads):
                g = np.array(grads[name])
                for k, (key, power) in enumerate(moments.items()):
                    stored = np.array(opt.state[name][key].view(mx.uint16))
                    with np.errstate(invalid="ignore"):  # the NaNs' squares
                        moment = g**power
                    want = rounding.stochastic_round_reference(
                        moment, t, rounding.state_index(position, k)
                    )
                    assert np.array_equal(stored, want), (type(opt).__name__, name, key, t)
            first = np.array(opt.state["a"][next(iter(moments))].view(mx.uint16))
            assert not np.array_equal(first, np.array(grads["a"].astype(BF16).view(mx.uint16)))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_resumed_run_rounds_as_the_uninterrupted_one(name: str, tmp_path: Any) -> None:
    straight = OPTIMIZERS[name](state_dtype=BF16)
    final = _run(straight, _params(), range(10))
    first = OPTIMIZERS[name](state_dtype=BF16)
    half = _run(first, _params(), range(5))
    # Saved as MLX users save optimizer state: flattened, to safetensors.
    path = str(tmp_path / "state.safetensors")
    mx.save_safetensors(path, dict(tree_flatten(first.state)))
    resumed = OPTIMIZERS[name](state_dtype=BF16)
    resumed.state = tree_unflatten(list(mx.load(path).items()))
    resumed_final = _run(resumed, half, range(5, 10))
    for k in final:
        assert np.array_equal(np.array(final[k]), np.array(resumed_final[k]))


@pytest.mark.parametrize("state_dtype", [None, BF16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["QHM", "QHAdam", "QHMuon"])
def test_a_copy_or_a_pickle_steps_as_the_optimizer(name: str, state_dtype: Any) -> None:
    # As MLX's own optimizers copy and pickle (their state's arrays): the
    # state's dtype and the step's dtype-keyed values do not pickle as they are.
    import copy
    import pickle

    shape = (3, 4) if name == "QHMuon" else (5,)
    opt = getattr(qhmlx, name)(0.1, state_dtype=state_dtype)
    params = {"w": mx.ones(shape)}
    grads = {"w": mx.full(shape, 0.3)}
    params = opt.apply_gradients(grads, params)
    copies = [copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))]
    want = np.array(opt.apply_gradients(grads, params)["w"])
    for other in copies:
        assert (
            other.state_dtype == state_dtype
            if state_dtype is not None
            else other.state_dtype is None
        )
        np.testing.assert_array_equal(np.array(other.apply_gradients(grads, params)["w"]), want)


def test_float16_state_and_rounding_off_round_to_nearest() -> None:
    # float16 for QHM's buffer; QHAdam's second moment refuses it (below).
    for make, slot, kwargs in (
        (qhmlx.QHM, "momentum_buffer", {"state_dtype": mx.float16}),
        (qhmlx.QHAdam, "m", {"state_dtype": BF16, "stochastic_rounding": False}),
    ):
        opt, wide = make(1e-2, **kwargs), make(1e-2)
        _run(opt, _params(), range(1))
        _run(wide, _params(), range(1))
        for k in opt.state:
            if k == "step" or k == "learning_rate":
                continue
            want = wide.state[k][slot].astype(kwargs["state_dtype"])
            assert mx.array_equal(opt.state[k][slot], want).item()


@pytest.mark.parametrize("cls", [qhmlx.QHAdam, qhmlx.QHAdamW])
def test_float16_state_is_refused_for_qhadams_second_moment(cls: type) -> None:
    with pytest.raises(ValueError, match=r"state_dtype=float16 cannot hold QHAdam's second"):
        cls(1e-3, state_dtype=mx.float16)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"state_dtype": mx.int8}, ValueError, r"state_dtype must be None or one of mx.bfloat16"),
        (
            {"state_dtype": "bfloat16"},
            ValueError,
            r"one of mx\.bfloat16, .*; received state_dtype='bfloat16'",
        ),
        ({"stochastic_rounding": 1}, TypeError, r"stochastic_rounding must be None or a bool"),
        # True would change nothing where nothing is rounded stochastically.
        (
            {"stochastic_rounding": True},
            ValueError,
            r"received stochastic_rounding=True with state_dtype=None",
        ),
        (
            {"state_dtype": mx.float32, "stochastic_rounding": True},
            ValueError,
            r"applies to a bfloat16 state_dtype; .*state_dtype=mx\.float32$",
        ),
    ],
)
@pytest.mark.parametrize("cls", [qhmlx.QHM, qhmlx.QHAdam, qhmlx.QHAdamW])
def test_invalid_settings_are_refused(
    cls: type, kwargs: dict[str, Any], error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        cls(0.1, **kwargs)


def test_a_state_wider_than_the_parameters_is_refused() -> None:
    opt = qhmlx.QHAdam(1e-2, state_dtype=mx.float32)
    with pytest.raises(ValueError, match=r"wider than a parameter's dtype float16"):
        opt.init({"x": mx.zeros(3, dtype=mx.float16)})
    # As wide and another: it would step in the parameters' 16 bits, where
    # 0.999 * v rounds back to v (the average never decayed).
    opt = qhmlx.QHM(1e-2, state_dtype=mx.float16)
    with pytest.raises(ValueError, match=r"float16 is as wide as a parameter's dtype bfloat16"):
        opt.init({"x": mx.zeros(3, dtype=mx.bfloat16)})


@pytest.mark.parametrize(
    "case", narrow_state_cases() + narrow_state_cases(("qhmuon",)), ids=lambda c: c.name
)
def test_bfloat16_state_follows_float32_state_on_the_conformance_problems(case: Any) -> None:
    problem = get_problem(case.problem_name)

    def run(**options: Any) -> tuple[np.ndarray, list[np.ndarray]]:
        opt = make_optimizer(case, case.hparams["lr"], **options)
        params = {
            f"p{i}": mx.array(a.astype(np.float32)) for i, a in enumerate(problem.split(problem.x0))
        }
        out, states = [], []
        for t in range(100):
            x = problem.join([np.array(p, dtype=np.float64) for p in params.values()])
            grads = problem.split(problem.grad(x, t))
            named = {k: mx.array(g.astype(np.float32)) for k, g in zip(params, grads, strict=True)}
            params = opt.apply_gradients(named, params)
            mx.eval(params, opt.state)
            out.append(problem.join([np.array(p, dtype=np.float64) for p in params.values()]))
            # Each parameter's states, read back as float64 (their names sorted).
            states.append(
                np.concatenate(
                    [
                        np.array(opt.state[name][key].astype(mx.float32), dtype=np.float64).ravel()
                        for name in params
                        for key in sorted(opt.state[name])
                    ]
                )
            )
        return np.array(out), states

    (wide, wide_states), (narrow, narrow_states) = run(), run(state_dtype=BF16)
    relative = np.linalg.norm(narrow - wide, axis=1) / np.linalg.norm(wide, axis=1)
    assert relative.max() <= narrow_state_tolerance(case)
    # The trajectories alone barely see a lost state where they barely depend on it.
    assert relative_state_distance(narrow_states, wide_states) <= stored_state_tolerance(
        case, eight_bit=False
    )


@pytest.mark.parametrize(
    ("saved", "own"), [(BF16, None), (None, BF16)], ids=["bfloat16->own", "own->bfloat16"]
)
def test_a_checkpoint_of_another_state_dtype_steps_in_the_optimizers_own(
    saved: Any, own: Any
) -> None:
    # state_dtype is how an optimizer stores its state: a state loaded from a
    # checkpoint of another one is converted to it (as torch's load_state_dict).
    source = qhmlx.QHAdam(1e-2, state_dtype=saved)
    params = _run(source, _params(), range(2))
    resumed = qhmlx.QHAdam(1e-2, state_dtype=own)
    resumed.state = tree_map(lambda x: x, source.state)
    _run(resumed, params, range(2, 3))
    want = mx.float32 if own is None else own
    assert {x.dtype for x in _state_arrays(resumed)} == {want}
