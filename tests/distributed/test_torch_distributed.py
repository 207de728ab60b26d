"""qhoptim.torch under torch's own distributed engines: DDP, ZeRO, FSDP2 and DCP.

Two ranks on CPU with the gloo backend, started once for the whole module
(``qh_torch_ranks.run_ranks``); every check runs inside that one process group
and the tests below judge what the ranks saved. The expected values are
single-process runs on the same global batch (``train_single``), made here in
the pytest process, which never joins a process group.

Tolerances. A distributed gradient is the mean of per-rank means over half a
batch; the single-process one a mean over the whole batch: the same float64
numbers, summed in another order, so they differ in the last bits (relative
1e-16). Eight steps of QHM or QHAdam carry that forward; measured differences
stay below 1e-15 (see the summary printed at the end of the run). ``RTOL`` and
``ATOL`` leave three orders of magnitude of margin and still fail on any real
error: one rank's half batch lost moves the parameters by 0.08 or more; a
gradient summed instead of averaged by 0.4 with QHM, and even with QHAdam,
nearly invariant to the gradient's scale (only eps is not), by 1e-7.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
    pytest.skip("this torch build has no torch.distributed with gloo", allow_module_level=True)

from qh_torch_ranks import (  # noqa: E402
    CHECKPOINT_AT,
    NARROW_DTENSOR_REFUSED,
    OPTIMIZERS,
    STEPS,
    WORLD_SIZE,
    Trajectory,
    branch_cases,
    branch_run,
    max_difference,
    run_ranks,
    train_single,
)

RTOL = 1e-10
ATOL = 1e-12
TOLERANCE = f"(rtol {RTOL:.0e}, atol {ATOL:.0e})"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(Path(tmp_path_factory.mktemp("torch-ranks")))


def _results(ranks: list[dict[str, Any]], check: str) -> list[dict[str, Any]]:
    """Each rank's results of ``check``; a check that raised fails the test with its traceback."""
    for rank, results in enumerate(ranks):
        if "error" in results[check]:
            pytest.fail(f"{check} raised on rank {rank}:\n{results[check]['error']}")
    return [results[check] for results in ranks]


def _assert_close(got: Trajectory, want: Trajectory) -> None:
    assert len(got) == len(want)
    for t, (g_step, w_step) in enumerate(zip(got, want, strict=True)):
        for i, (g, w) in enumerate(zip(g_step, w_step, strict=True)):
            torch.testing.assert_close(
                g, w, rtol=RTOL, atol=ATOL, msg=lambda m, t=t, i=i: f"step {t}, param {i}: {m}"
            )


def _assert_equal(got: Trajectory, want: Trajectory) -> None:
    """Bit for bit."""
    assert len(got) == len(want)
    for t, (g_step, w_step) in enumerate(zip(got, want, strict=True)):
        for i, (g, w) in enumerate(zip(g_step, w_step, strict=True)):
            assert torch.equal(g, w), f"step {t}, param {i}: max |diff| {(g - w).abs().max():.3g}"


@pytest.mark.parametrize(
    ("case", "cls", "kwargs"), branch_cases(), ids=[c[0] for c in branch_cases()]
)
@pytest.mark.parametrize("placement", ["S(0)", "R"], ids=["sharded", "replicated"])
def test_dtensor_step_equals_plain_tensor_step(
    ranks: list[dict[str, Any]],
    case: str,
    cls: type,
    kwargs: dict[str, Any],
    placement: str,
    report_difference: Callable[..., None],
) -> None:
    """Each branch of the step, on DTensors, against the same step on plain tensors.

    The gradients are given, not reduced, and every operation of the step is
    element-wise, so the results agree to the last bit (measured: 0); the
    tolerance only allows a kernel to take another vectorised code path on a
    shard than on the whole tensor.
    """
    per_rank = [r[f"{case}-{placement}"] for r in _results(ranks, "dtensor")]
    want = branch_run(cls, kwargs)
    diffs = [max_difference(got, want) for got in per_rank]
    report_difference(
        f"torch DTensor {placement} {case}",
        max(d[0] for d in diffs),
        max(d[1] for d in diffs),
        "(rtol 1e-14, atol 1e-15)",
    )
    for got in per_rank:
        for g_step, w_step in zip(got, want, strict=True):
            for g, w in zip(g_step, w_step, strict=True):
                torch.testing.assert_close(g, w, rtol=1e-14, atol=1e-15)


def test_a_narrow_state_of_dtensors_off_the_fused_kernel_is_refused_before_anything_moves(
    ranks: list[dict[str, Any]],
) -> None:
    # 8-bit blocks and working copies are made for whole tensors: these failed
    # inside the step (a DTensor copied into a plain tensor), after QHAdam's
    # count had moved.
    for result in _results(ranks, "dtensor"):
        refused = result["narrow-refused"]
        assert sorted(refused) == sorted(label for label, *_ in NARROW_DTENSOR_REFUSED)
        for label, (message, moved, state_keys) in refused.items():
            assert message.startswith("a narrow state of DTensor parameters"), (label, message)
            assert not moved and state_keys == [], label


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_ddp_equals_single_process(
    ranks: list[dict[str, Any]], name: str, report_difference: Callable[..., None]
) -> None:
    per_rank = [r[name] for r in _results(ranks, "ddp")]
    for rank in range(1, WORLD_SIZE):  # DDP keeps the replicas identical
        _assert_equal(per_rank[rank], per_rank[0])
    want = train_single(name)
    report_difference(f"torch DDP {name}", *max_difference(per_rank[0], want), TOLERANCE)
    _assert_close(per_rank[0], want)


@pytest.mark.parametrize("fused", [False, True], ids=["default", "fused"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_zero_redundancy_optimizer_equals_single_process(
    ranks: list[dict[str, Any]], name: str, fused: bool, report_difference: Callable[..., None]
) -> None:
    per_rank = [r[f"{name}-fused" if fused else name] for r in _results(ranks, "zero")]
    cls = OPTIMIZERS[name][0]
    assert {r["local_type"] for r in per_rank} == {cls.__name__}
    assert {r["fused"] for r in per_rank} == {fused}
    # Each rank keeps the state of its own partition only; together, of every parameter.
    partitions = [r["local_state"] for r in per_rank]
    assert all(partitions), partitions
    flat = sorted(i for part in partitions for i in part)
    assert flat == list(range(len(per_rank[0]["trajectory"][0]))), partitions
    for rank in range(1, WORLD_SIZE):
        _assert_equal(per_rank[rank]["trajectory"], per_rank[0]["trajectory"])
    want = train_single(name)
    got = per_rank[0]["trajectory"]
    report_difference(
        f"torch ZeRO {name}{' fused' if fused else ''}", *max_difference(got, want), TOLERANCE
    )
    _assert_close(got, want)


def _assert_sharded_like_params(layout: list[dict[str, Any]], name: str) -> None:
    """Every state tensor but QHAdam's step count is a DTensor laid out as its parameter."""
    moments = {"QHM": {"momentum_buffer"}, "QHAdam": {"exp_avg", "exp_avg_sq"}}[name]
    for i, entry in enumerate(layout):
        p_type, p_placements, p_local_shape = entry["param"]
        assert p_type == "DTensor" and "Shard(dim=0)" in p_placements, entry
        assert set(entry["state"]) == moments | ({"step"} if name == "QHAdam" else set())
        for key in moments:
            s_type, s_placements, s_local_shape, same_mesh = entry["state"][key]
            assert (s_type, s_placements, s_local_shape, same_mesh) == (
                "DTensor",
                p_placements,
                p_local_shape,
                True,
            ), f"param {i}, {key}: {entry['state'][key]} vs param {entry['param']}"
        if name == "QHAdam":  # as torch's Adam: a 0-d tensor, the same on every rank
            assert entry["state"]["step"][:3] == ("Tensor", None, ())


@pytest.mark.parametrize("foreach", [False, True, None], ids=["loop", "foreach", "default"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fsdp2_equals_single_process(
    ranks: list[dict[str, Any]], name: str, foreach: bool, report_difference: Callable[..., None]
) -> None:
    per_rank = [r[f"{name}-foreach={foreach}"] for r in _results(ranks, "fsdp")]
    local_shapes = []
    for r in per_rank:
        _assert_sharded_like_params(r["layout"], name)
        local_shapes.append([e["param"][2] for e in r["layout"]])
    # The last layer (3 rows) is sharded unevenly, so that padding is exercised.
    assert local_shapes[0][-1] == (2,) and local_shapes[1][-1] == (1,), local_shapes
    # foreach=None takes the multi-tensor kernels for DTensors on CPU too, as for
    # plain CPU tensors: one DTensor dispatch per kernel and list instead of one per tensor.
    want_steps = 0 if foreach is False else STEPS
    assert [r["multi_tensor_steps"] for r in per_rank] == [want_steps] * WORLD_SIZE
    for rank in range(1, WORLD_SIZE):  # full_tensor() gathers the same parameters everywhere
        _assert_equal(per_rank[rank]["trajectory"], per_rank[0]["trajectory"])
    want = train_single(name, foreach=foreach)
    got = per_rank[0]["trajectory"]
    report_difference(
        f"torch FSDP2 {name} foreach={foreach}", *max_difference(got, want), TOLERANCE
    )
    _assert_close(got, want)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fsdp2_with_fused_steps_equals_single_process(
    ranks: list[dict[str, Any]], name: str, report_difference: Callable[..., None]
) -> None:
    per_rank = [r[f"{name}-fused"] for r in _results(ranks, "fsdp")]
    for r in per_rank:
        _assert_sharded_like_params(r["layout"], name)
        assert r["fused_steps"] == STEPS
    for rank in range(1, WORLD_SIZE):
        _assert_equal(per_rank[rank]["trajectory"], per_rank[0]["trajectory"])
    want = train_single(name)
    got = per_rank[0]["trajectory"]
    report_difference(f"torch FSDP2 {name} fused", *max_difference(got, want), TOLERANCE)
    _assert_close(got, want)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fsdp2_checkpoint_resumes_bit_for_bit(
    ranks: list[dict[str, Any]], name: str, report_difference: Callable[..., None]
) -> None:
    for r in _results(ranks, "checkpoint"):
        result = r[name]
        assert len(result["resumed"]) == STEPS - CHECKPOINT_AT
        _assert_sharded_like_params(result["layout"], name)
        _assert_equal(result["resumed"], result["uninterrupted"])
        # Without the optimizer state the continuation departs: the check above can fail.
        departed, _ = max_difference(result["fresh_optimizer"], result["uninterrupted"])
        assert departed > 1e-4, departed
    report_difference(
        f"torch FSDP2+DCP {name} resumed",
        *max_difference(result["resumed"], result["uninterrupted"]),
        "(bit for bit)",
    )
