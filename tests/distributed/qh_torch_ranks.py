"""The training problem of ``test_torch_distributed.py`` and the program each rank runs.

The parent (the pytest process) starts ``WORLD_SIZE`` ranks once, with
:func:`run_ranks`; each rank runs every check of :data:`CHECKS` in turn on the
gloo backend and saves what it measured to ``OUTDIR/rank{N}.pt``. The parent
compares that with single-process runs of :func:`train_single` — the
reference never touches ``torch.distributed``.

Everything is float64 so that the only difference between a distributed run
and the single-process one, the order in which gradients are summed, stays at
the level of float64 rounding.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

import qhoptim.torch as qht
from qhoptim.torch import QHM, QHAdam

WORLD_SIZE = 2
GLOBAL_BATCH = 16  # split evenly: each rank sees GLOBAL_BATCH // WORLD_SIZE rows
STEPS = 8
CHECKPOINT_AT = 4  # the checkpoint test saves after this many steps
F64 = torch.float64

# QHM with coupled weight decay; QHAdam with nu2 < 1, so the denominator mixes
# the gradient and the second moment (the "mix" kernels of both paths).
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "QHM": (QHM, {"lr": 0.5, "momentum": 0.9, "nu": 0.7, "weight_decay": 1e-2}),
    "QHAdam": (QHAdam, {"lr": 1e-2, "betas": (0.9, 0.999), "nus": (0.7, 0.9)}),
}

Trajectory = list[list[Tensor]]  # [step][param]: the full parameters after each step


# ------------------------------------------------------------------ the problem
def make_model(seed: int = 0) -> nn.Sequential:
    """A float64 MLP; its last layer has 3 rows, which 2 ranks shard unevenly (2 + 1)."""
    model = nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
    ).to(F64)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=gen, dtype=F64))
    return model


def batches(steps: int = STEPS) -> list[tuple[Tensor, Tensor]]:
    """A fresh global batch ``(x, y)`` per step."""
    gen = torch.Generator().manual_seed(1234)
    return [
        (
            torch.randn(GLOBAL_BATCH, 8, generator=gen, dtype=F64),
            torch.randn(GLOBAL_BATCH, 3, generator=gen, dtype=F64),
        )
        for _ in range(steps)
    ]


def local_rows(rank: int | None, world_size: int = WORLD_SIZE) -> slice:
    """This rank's share of a global batch (all of it for ``rank=None``)."""
    if rank is None:
        return slice(None)
    n = GLOBAL_BATCH // world_size
    return slice(rank * n, (rank + 1) * n)


def snapshot(model: nn.Module) -> list[Tensor]:
    """The model's full parameters (a collective for DTensor parameters)."""
    return [full_copy(p) for p in model.parameters()]


def full_copy(p: Tensor) -> Tensor:
    """A copy of all of ``p``: ``full_tensor()`` of a replicated DTensor is no copy."""
    t = p.detach()
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    steps: range,
    rank: int | None,
    world_size: int = WORLD_SIZE,
) -> Trajectory:
    """Mean-squared-error steps on this rank's rows of the global batches ``steps``."""
    data = batches(max(steps.stop, STEPS))
    rows = local_rows(rank, world_size)
    trajectory = []
    for t in steps:
        x, y = data[t]
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()
        trajectory.append(snapshot(model))
    return trajectory


def train_single(name: str, *, steps: int = STEPS, **flags: Any) -> Trajectory:
    """The reference: one process, the whole global batch, no ``torch.distributed``."""
    cls, kwargs = OPTIMIZERS[name]
    model = make_model()
    return train(model, cls(model.parameters(), **kwargs, **flags), range(steps), rank=None)


# Every branch of the step on DTensors built directly (``distribute_tensor``),
# without FSDP: complex parameters (the real views), ``capturable`` and a tensor
# ``lr`` (the out-of-place formula path), maximize and both weight decays, and
# the CPU chunks of the multi-tensor path (made small in ``_dtensor``).
BRANCH_SHAPES: list[tuple[tuple[int, ...], torch.dtype]] = [
    ((6, 4), torch.complex128),
    ((5,), F64),
    ((40, 30), F64),
    ((7, 3), F64),
]
BRANCH_CHUNK_NUMEL = 32  # qhoptim.torch._CPU_CHUNK_NUMEL in the ranks: several chunks
BRANCH_STEPS = 3
BRANCH_CONFIGS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "QHM": (QHM, {"lr": 0.5, "weight_decay": 0.1}),
    "QHM-direct-maximize": (
        QHM,
        {"lr": 0.5, "weight_decay": 0.1, "decoupled_weight_decay": True, "maximize": True},
    ),
    "QHM-capturable": (QHM, {"lr": 0.5, "capturable": True}),
    "QHAdam": (QHAdam, {"lr": 1e-2, "nus": (0.7, 0.8), "weight_decay": 0.1}),
    "QHAdam-decoupled-maximize": (
        QHAdam,
        {
            "lr": 1e-2,
            "nus": (0.7, 0.0),
            "decoupled_weight_decay": True,
            "weight_decay": 0.1,
            "maximize": True,
        },
    ),
    "QHAdam-capturable": (QHAdam, {"lr": 1e-2, "nus": (0.7, 0.8), "capturable": True}),
}
TENSOR_LR = ("QHM", "QHAdam")  # also run with ``lr`` as a 0-d tensor


def branch_cases() -> list[tuple[str, type[torch.optim.Optimizer], dict[str, Any]]]:
    cases = []
    for name, (cls, kwargs) in BRANCH_CONFIGS.items():
        variants = [(name, kwargs)]
        if name in TENSOR_LR:
            variants.append((f"{name}-tensor-lr", {**kwargs, "lr": torch.tensor(kwargs["lr"])}))
        for label, kw in variants:
            for foreach in (False, True):
                cases.append((f"{label}-foreach={foreach}", cls, {**kw, "foreach": foreach}))
    return cases


def branch_run(
    cls: type[torch.optim.Optimizer],
    kwargs: dict[str, Any],
    distribute: Callable[[Tensor], Tensor] = lambda t: t,
) -> Trajectory:
    """Steps on fixed gradients; ``distribute`` turns each tensor into a DTensor."""
    gen = torch.Generator().manual_seed(7)
    params0 = [torch.randn(shape, generator=gen, dtype=dtype) for shape, dtype in BRANCH_SHAPES]
    grads = [
        [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params0]
        for _ in range(BRANCH_STEPS)
    ]
    params = [nn.Parameter(distribute(p)) for p in params0]
    opt = cls(params, **kwargs)
    trajectory = []
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = distribute(g)
        opt.step()
        trajectory.append([full_copy(p) for p in params])
    return trajectory


# --------------------------------------------------------------------- checks
# Each check runs on every rank and returns what the parent needs to judge it.
def _ddp(rank: int, world_size: int, outdir: Path) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    for name, (cls, kwargs) in OPTIMIZERS.items():
        model = DDP(make_model())
        opt = cls(model.parameters(), **kwargs)
        out[name] = train(model, opt, range(STEPS), rank, world_size)
    return out


def _zero(rank: int, world_size: int, outdir: Path) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    with warnings.catch_warnings():
        # Importing torch.distributed.optim scripts its functional optimizers
        # with torch.jit, which torch 2.13 deprecates: torch's warning, not ours.
        warnings.filterwarnings("ignore", r"`torch\.jit\.\w+` is deprecated", DeprecationWarning)
        from torch.distributed.optim import ZeroRedundancyOptimizer

    out: dict[str, Any] = {}
    for name, (cls, kwargs) in OPTIMIZERS.items():
        for key, flags in ((name, {}), (f"{name}-fused", {"fused": True})):
            model = DDP(make_model())
            index = {p: i for i, p in enumerate(model.parameters())}
            opt = ZeroRedundancyOptimizer(
                model.parameters(), optimizer_class=cls, **kwargs, **flags
            )
            trajectory = train(model, opt, range(STEPS), rank, world_size)
            out[key] = {
                "trajectory": trajectory,
                "local_type": type(opt.optim).__name__,
                "fused": bool(opt.optim.defaults.get("fused")),
                # The parameters this rank's optimizer holds state for: its partition.
                "local_state": sorted(index[p] for p in opt.optim.state),
            }
    return out


def _fully_shard(model: nn.Sequential) -> nn.Sequential:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _state_layout(model: nn.Module, opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Per parameter: its placements and local shape, and those of each state tensor."""
    layout = []
    for p in model.parameters():
        entry: dict[str, Any] = {
            "param": (type(p).__name__, repr(p.placements), tuple(p.to_local().shape)),
            "state": {},
        }
        for key, value in opt.state[p].items():
            if hasattr(value, "placements"):
                desc = (
                    type(value).__name__,
                    repr(value.placements),
                    tuple(value.to_local().shape),
                    value.device_mesh == p.device_mesh,
                )
            else:
                desc = (type(value).__name__, None, tuple(value.shape), None)
            entry["state"][key] = desc
        layout.append(entry)
    return layout


def _fsdp(rank: int, world_size: int, outdir: Path) -> dict[str, Any]:
    out = {}
    for name, (cls, kwargs) in OPTIMIZERS.items():
        multi_tensor = f"_multi_tensor_{name.lower()}"
        for foreach in (False, True, None):
            model = _fully_shard(make_model())
            opt = cls(model.parameters(), **kwargs, foreach=foreach)
            # Count the steps the multi-tensor implementation took.
            module = getattr(qht, f"_{name.lower()}")
            with mock.patch.object(
                module, multi_tensor, wraps=getattr(module, multi_tensor)
            ) as spy:
                trajectory = train(model, opt, range(STEPS), rank, world_size)
            out[f"{name}-foreach={foreach}"] = {
                "trajectory": trajectory,
                "layout": _state_layout(model, opt),
                "multi_tensor_steps": spy.call_count,
            }
        # fused=True: the one-pass kernels on each rank's local shards.
        model = _fully_shard(make_model())
        opt = cls(model.parameters(), **kwargs, fused=True)
        fused = getattr(qht._fused, f"fused_{name.lower()}")
        with mock.patch.object(qht._fused, fused.__name__, wraps=fused) as spy:
            trajectory = train(model, opt, range(STEPS), rank, world_size)
        out[f"{name}-fused"] = {
            "trajectory": trajectory,
            "layout": _state_layout(model, opt),
            "fused_steps": spy.call_count,
        }
    return out


def _checkpoint(rank: int, world_size: int, outdir: Path) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    def state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
        return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}

    out = {}
    for name, (cls, kwargs) in OPTIMIZERS.items():
        path = outdir / f"checkpoint-{name}"
        steps_before, steps_after = range(CHECKPOINT_AT), range(CHECKPOINT_AT, STEPS)

        model = _fully_shard(make_model())
        opt = cls(model.parameters(), **kwargs)
        uninterrupted = train(model, opt, range(STEPS), rank, world_size)

        model = _fully_shard(make_model())
        opt = cls(model.parameters(), **kwargs)
        train(model, opt, steps_before, rank, world_size)
        dcp.save(state(model, opt), checkpoint_id=path)
        del model, opt

        # A new model with other weights and a new optimizer: all from the checkpoint.
        model = _fully_shard(make_model(seed=1))
        opt = cls(model.parameters(), **kwargs)
        loaded = state(model, opt)
        dcp.load(loaded, checkpoint_id=path)
        set_model_state_dict(model, loaded["model"])
        set_optimizer_state_dict(model, opt, loaded["optim"])
        layout = _state_layout(model, opt)
        resumed = train(model, opt, steps_after, rank, world_size)

        # Control: the model restored but the optimizer state not. If this matched,
        # the comparison above could not tell a restored state from a lost one.
        model = _fully_shard(make_model(seed=1))
        model_only = {"model": get_model_state_dict(model)}
        dcp.load(model_only, checkpoint_id=path)
        set_model_state_dict(model, model_only["model"])
        fresh = train(model, cls(model.parameters(), **kwargs), steps_after, rank, world_size)

        out[name] = {
            "uninterrupted": uninterrupted[CHECKPOINT_AT:],
            "resumed": resumed,
            "fresh_optimizer": fresh,
            "layout": layout,
        }
    return out


def _dtensor(rank: int, world_size: int, outdir: Path) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    with mock.patch.object(qht._kernels, "CPU_CHUNK_NUMEL", BRANCH_CHUNK_NUMEL):
        for placement in (Shard(0), Replicate()):
            for case, cls, kwargs in branch_cases():
                out[f"{case}-{placement}"] = branch_run(
                    cls, kwargs, lambda t, p=placement: distribute_tensor(t, mesh, [p])
                )
    # Narrow state the fused kernel does not step on shards: refused at the
    # step, before anything moves (it failed inside, after the count moved).
    refused = {}
    for label, cls, dtype, flags in NARROW_DTENSOR_REFUSED:
        gen = torch.Generator().manual_seed(0)
        p = nn.Parameter(
            distribute_tensor(torch.randn(8, 4, generator=gen, dtype=dtype), mesh, [Shard(0)])
        )
        p.grad = distribute_tensor(torch.randn(8, 4, generator=gen, dtype=dtype), mesh, [Shard(0)])
        opt = cls([p], lr=0.1, **flags)
        before = p.detach().full_tensor().clone()
        try:
            opt.step()
            message = ""
        except ValueError as error:
            message = str(error)
        moved = not torch.equal(before, p.detach().full_tensor())
        refused[label] = (message, moved, sorted(opt.state[p]))
    out["narrow-refused"] = refused
    return out


#: Narrow states of DTensor parameters that only the fused kernel steps on shards.
NARROW_DTENSOR_REFUSED = [
    ("QHAdam-8-bit", qht.QHAdam, torch.float32, {"state_dtype": torch.uint8}),
    ("QHM-8-bit-loop", qht.QHM, torch.float32, {"state_dtype": torch.uint8, "foreach": False}),
    (
        "QHAdam-bfloat16-nearest",
        qht.QHAdam,
        torch.float32,
        {"state_dtype": torch.bfloat16, "stochastic_rounding": False},
    ),
    ("QHM-bfloat16-of-float64", qht.QHM, torch.float64, {"state_dtype": torch.bfloat16}),
]


CHECKS: dict[str, Callable[[int, int, Path], dict[str, Any]]] = {
    "dtensor": _dtensor,
    "ddp": _ddp,
    "zero": _zero,
    "fsdp": _fsdp,
    "checkpoint": _checkpoint,
}


# ------------------------------------------------------------------ the ranks
def _rank_main(rank: int, world_size: int, port: int, outdir: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)  # two ranks on a small CPU machine
    warnings.simplefilter("error")  # as the suite: a warning here is a failure
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    results: dict[str, Any] = {}
    try:
        for name, check in CHECKS.items():
            start = time.perf_counter()
            try:
                results[name] = check(rank, world_size, Path(outdir))
            except Exception:
                results[name] = {"error": traceback.format_exc()}
            results[name]["seconds"] = time.perf_counter() - start
    finally:
        torch.save(results, Path(outdir) / f"rank{rank}.pt")
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(outdir: Path, world_size: int = WORLD_SIZE, timeout: float = 240.0) -> list[Any]:
    """Run every check on ``world_size`` spawned ranks; return each rank's results."""
    ctx = mp.start_processes(
        _rank_main,
        args=(world_size, free_port(), str(outdir)),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1.0):  # raises if a rank failed
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            raise TimeoutError(f"the ranks did not finish within {timeout:.0f} s")
    return [torch.load(outdir / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def max_difference(
    got: Sequence[Sequence[Tensor]], want: Sequence[Sequence[Tensor]]
) -> tuple[float, float]:
    """The largest absolute difference, and relative to the largest ``|want|`` of its tensor."""
    abs_max = rel_max = 0.0
    for g_step, w_step in zip(got, want, strict=True):
        for g, w in zip(g_step, w_step, strict=True):
            diff = float((g - w).abs().max())
            abs_max = max(abs_max, diff)
            rel_max = max(rel_max, diff / float(w.abs().max()))
    return abs_max, rel_max
