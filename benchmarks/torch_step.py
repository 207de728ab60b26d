"""Time one optimizer step of ``qhoptim.torch`` against torch's own optimizers.

Usage::

    python -m benchmarks.torch_step [--steps 30] [--warmup 5] [--qhoptim-110 DIR]
                                    [--shapes resnet18 small] [--device cpu] [--threads N]
    python -m benchmarks.torch_step --scale [--sizes 1e6 1e7 1e8] [--device cpu]
    python -m benchmarks.torch_step --host-only [--steps 200]

``--scale`` times the fused steps on one flat tensor of each size instead, with
the bandwidth each achieves (the bytes a step must move -- 20 per float32
parameter for SGD-Nesterov and QHM, 28 for Adam and QHAdam -- over its time)
beside a plain copy's (8 bytes per element), measured in the same interleaved run.

``--host-only`` times the host's share of the fused CUDA step on CPU: the
Triton path runs on CPU tensors (``TRITON_INTERPRET=1``) with its one launch
replaced by a no-op, on 62 and on 500 tensors of 4 values, against torch's
``Adam(fused=True)`` and ``SGD(fused=True)`` on the same tiny CPU tensors (their
host work and a kernel of negligible size); it also counts the operations a
step issues on the parameters' device (each launch, and each torch operation on
a tensor of one or more dimensions; the step counts are 0-d and live on the host).

Two parameter sets (``benchmarks/shapes.py``): the 62 tensors of torchvision's
ResNet-18 (11,689,512 float32 values) and 500 tensors of 1,000 values. For each
set every optimizer gets its own parameters and fixed gradients; after a
warm-up the optimizers step *interleaved* (one step each, round robin) so that
machine noise hits all of them alike, and the median of ``--steps`` steps is
reported, with ratios against torch's ``SGD(momentum=0.9, nesterov=True)``
and ``Adam`` on their for-loop, foreach and fused implementations. qhoptim
1.1.0 is timed too when ``--qhoptim-110`` names a directory it was installed
into (``pip install --no-deps --target DIR qhoptim==1.1.0``).

The targets: QHM <= 1.0x and QHAdam <= 1.15x torch's fastest *non-fused*
implementation of SGD-Nesterov / Adam on the same parameters; the default
(``foreach=None``) should be the faster of qhoptim's two implementations; and
``fused=True``: QHM <= 1.0x torch's fused SGD-Nesterov, QHAdam <= 1.05x
torch's fused Adam.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks import positive_float, positive_int
from benchmarks.shapes import RESNET18, SMALL
from qhoptim.torch import QHM, QHAdam

SHAPES = {"resnet18": RESNET18, "small": SMALL}

QHM_KW = {"lr": 1.0, "momentum": 0.999, "nu": 0.7}  # the paper's rule of thumb
QHADAM_KW = {"lr": 1e-3, "betas": (0.999, 0.999), "nus": (0.7, 1.0)}  # the paper's QH default
QHADAM_NU2_KW = {"lr": 1e-3, "betas": (0.95, 0.98), "nus": (0.8, 0.7)}  # the paper's NMT setting


def load_qhoptim_110(target: Path) -> Any:
    """qhoptim 1.1.0's ``pyt`` module, loaded from ``target`` as ``qhoptim_1_1_0``."""
    root = target / "qhoptim"
    spec = importlib.util.spec_from_file_location(
        "qhoptim_1_1_0", root / "__init__.py", submodule_search_locations=[str(root)]
    )
    if spec is None or spec.loader is None:
        raise ImportError(f"no qhoptim package under {target}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["qhoptim_1_1_0"] = module
    spec.loader.exec_module(module)
    return importlib.import_module("qhoptim_1_1_0.pyt")


def candidates(
    qh110: Any, device: str = "cpu"
) -> dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]]:
    sgd = {"lr": 0.1, "momentum": 0.9, "nesterov": True}
    c: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
        "torch SGD-nesterov loop": lambda p: torch.optim.SGD(p, **sgd, foreach=False),
        "torch SGD-nesterov foreach": lambda p: torch.optim.SGD(p, **sgd, foreach=True),
        "torch SGD-nesterov fused": lambda p: torch.optim.SGD(p, **sgd, fused=True),
        "torch Adam loop": lambda p: torch.optim.Adam(p, foreach=False),
        "torch Adam foreach": lambda p: torch.optim.Adam(p, foreach=True),
        "torch Adam fused": lambda p: torch.optim.Adam(p, fused=True),
        "QHM loop": lambda p: QHM(p, **QHM_KW, foreach=False),
        "QHM foreach": lambda p: QHM(p, **QHM_KW, foreach=True),
        "QHM default": lambda p: QHM(p, **QHM_KW),
        "QHAdam loop": lambda p: QHAdam(p, **QHADAM_KW, foreach=False),
        "QHAdam foreach": lambda p: QHAdam(p, **QHADAM_KW, foreach=True),
        "QHAdam default": lambda p: QHAdam(p, **QHADAM_KW),
        "QHAdam nu2<1 loop": lambda p: QHAdam(p, **QHADAM_NU2_KW, foreach=False),
        "QHAdam nu2<1 foreach": lambda p: QHAdam(p, **QHADAM_NU2_KW, foreach=True),
        "QHM fused": lambda p: QHM(p, **QHM_KW, fused=True),
        "QHAdam fused": lambda p: QHAdam(p, **QHADAM_KW, fused=True),
        "QHAdam nu2<1 fused": lambda p: QHAdam(p, **QHADAM_NU2_KW, fused=True),
    }
    if device.startswith("cuda"):
        # capturable=True (CUDA graphs) with a tensor lr on the device, as graph
        # replays need; compared with torch's capturable Adam.
        def lr(value: float) -> torch.Tensor:
            return torch.tensor(value, device=device)

        c["torch Adam capturable foreach"] = lambda p: torch.optim.Adam(
            p, lr=lr(1e-3), capturable=True, foreach=True
        )
        c["torch Adam capturable fused"] = lambda p: torch.optim.Adam(
            p, lr=lr(1e-3), capturable=True, fused=True
        )
        c["QHAdam capturable fused"] = lambda p: QHAdam(
            p, **{**QHADAM_KW, "lr": lr(1e-3)}, capturable=True, fused=True
        )
        for impl, foreach in (("loop", False), ("foreach", True)):
            c[f"QHM capturable {impl}"] = lambda p, f=foreach: QHM(
                p, **{**QHM_KW, "lr": lr(QHM_KW["lr"])}, capturable=True, foreach=f
            )
            c[f"QHAdam capturable {impl}"] = lambda p, f=foreach: QHAdam(
                p, **{**QHADAM_KW, "lr": lr(1e-3)}, capturable=True, foreach=f
            )
    if qh110 is not None:
        c["qhoptim 1.1.0 QHM"] = lambda p: qh110.QHM(p, **QHM_KW)
        c["qhoptim 1.1.0 QHAdam"] = lambda p: qh110.QHAdam(p, **QHADAM_KW)
    return c


def time_steps(
    makers: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]],
    shapes: list[tuple[int, ...]],
    *,
    steps: int,
    warmup: int,
    device: str,
) -> dict[str, float]:
    """Median ms per step of each optimizer, stepping them interleaved."""
    gen = torch.Generator().manual_seed(0)
    opts = {}
    for name, make in makers.items():
        params = [torch.randn(s, generator=gen).to(device).requires_grad_() for s in shapes]
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(device) * 1e-3
        opts[name] = make(params)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    times: dict[str, list[float]] = {name: [] for name in opts}
    for i in range(warmup + steps):
        for name, opt in opts.items():
            sync()
            t0 = time.perf_counter()
            opt.step()
            sync()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def report(shape_name: str, ms: dict[str, float]) -> list[str]:
    def best(prefix: str) -> tuple[str, float]:
        rows = [
            (ms[n], n)
            for n in ms
            if n.startswith(prefix) and not n.endswith("fused") and "capturable" not in n
        ]
        t, n = min(rows)
        return n, t

    def has_baseline(prefix: str) -> bool:  # one best() takes
        return any(
            n.startswith(prefix) and not n.endswith("fused") and "capturable" not in n for n in ms
        )

    if not (has_baseline("torch SGD") and has_baseline("torch Adam")):
        # --only left no non-fused baseline: the times, and the fused ratios.
        times = [f"{n}: {t:.2f} ms" for n, t in ms.items()]
        return [f"\n### {shape_name}", *times, *fused_ratios(ms)]
    sgd_name, sgd = best("torch SGD")
    adam_name, adam = best("torch Adam")
    lines = [
        f"\n### {shape_name}: {sum(torch.Size(s).numel() for s in SHAPES[shape_name]):,} values "
        f"in {len(SHAPES[shape_name])} tensors",
        "",
        f"| optimizer | ms/step | vs {sgd_name} | vs {adam_name} |",
        "|---|---:|---:|---:|",
    ]
    for name, t in ms.items():
        lines.append(f"| {name} | {t:.2f} | {t / sgd:.2f}x | {t / adam:.2f}x |")
    # Each ratio needs its rows: --only may have left some out.
    lines.append("")
    for qh, target, base, base_name in (
        ("QHM default", 1.00, sgd, "SGD-nesterov"),
        ("QHAdam default", 1.15, adam, "Adam"),
    ):
        if qh in ms:
            ratio = ms[qh] / base
            lines.append(
                f"{qh} / best non-fused {base_name} = {ratio:.2f}x (target <= {target:.2f}x)"
            )
    for opt in ("QHM", "QHAdam"):
        if f"{opt} loop" in ms and f"{opt} foreach" in ms:
            faster = "loop" if ms[f"{opt} loop"] < ms[f"{opt} foreach"] else "foreach"
            lines.append(f"{opt}: faster implementation here: {faster}")
    lines += fused_ratios(ms)
    for impl in ("foreach", "fused"):
        qh, base = f"QHAdam capturable {impl}", f"torch Adam capturable {impl}"
        if qh in ms and base in ms:
            lines.append(f"{qh} / {base} = {ms[qh] / ms[base]:.2f}x (target <= 1.00x)")
    return lines


def fused_ratios(ms: dict[str, float]) -> list[str]:
    """QH fused / torch fused, against their targets."""
    lines = []
    for qh, torch_name, target in (
        ("QHM fused", "torch SGD-nesterov fused", 1.0),
        ("QHAdam fused", "torch Adam fused", 1.05),
        ("QHAdam nu2<1 fused", "torch Adam fused", 1.05),
    ):
        if qh in ms and torch_name in ms:
            lines.append(
                f"{qh} / {torch_name} = {ms[qh] / ms[torch_name]:.2f}x (target <= {target:.2f}x)"
            )
    return lines


class _Copy:
    """A plain ``param.copy_(grad)``: the bandwidth a step can reach on this machine."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params

    def step(self) -> None:
        for p in self.params:
            p.detach().copy_(p.grad)  # type: ignore[arg-type]


# Bytes a step must move per element (read + write), float32 (shared/guides).
_BYTES = {
    "copy": 8,
    "torch SGD-nesterov fused": 20,
    "QHM fused": 20,
    "torch Adam fused": 28,
    "QHAdam fused": 28,
    "QHAdam nu2<1 fused": 28,
    "torch Adam capturable fused": 28,
    "QHAdam capturable fused": 28,
    # bfloat16 state (state_dtype): 2 bytes read and 2 written per state value
    "QHM fused, bfloat16 state": 16,
    "QHAdam fused, bfloat16 state": 20,
    # 8-bit state: a byte read and written per state value (the scales: 1/64 more)
    "QHM fused, 8-bit state": 14,
    "QHAdam fused, 8-bit state": 16,
}
# Narrow state's fused steps, each against its float32-state twin (targets:
# at most 0.9x the float32-state step, which moves more bytes, at 1e7-1e8).
NARROW_FUSED: dict[str, tuple[Callable[[list[torch.Tensor]], torch.optim.Optimizer], str]] = {
    f"{name} fused, {label} state": (
        lambda p, cls=cls, kw=kw, dtype=dtype: cls(p, **kw, fused=True, state_dtype=dtype),
        f"{name} fused",
    )
    for label, dtype in (("bfloat16", torch.bfloat16), ("8-bit", torch.uint8))
    for name, cls, kw in (("QHM", QHM, QHM_KW), ("QHAdam", QHAdam, QHADAM_KW))
}


def scale(sizes: list[int], *, steps: int, warmup: int, device: str) -> None:
    """Fused steps on one flat tensor per size: ratios and achieved bandwidth."""
    fused = {n: m for n, m in candidates(None, device).items() if n.endswith("fused")}
    narrow = {name: make for name, (make, _) in NARROW_FUSED.items()}
    makers: dict[str, Any] = {"copy": _Copy, **fused, **narrow}
    for n in sizes:
        ms = time_steps(makers, [(n,)], steps=steps, warmup=warmup, device=device)
        print(f"\n### one tensor of {n:,} float32 values\n")
        print("| step | ms/step | GB/s moved | vs copy's bandwidth |\n|---|---:|---:|---:|")
        copy_bw = _BYTES["copy"] * n / (ms["copy"] * 1e-3) / 1e9
        for name, t in ms.items():
            bw = _BYTES[name] * n / (t * 1e-3) / 1e9
            print(f"| {name} | {t:.2f} | {bw:.1f} | {bw / copy_bw:.2f} |")
        lines = fused_ratios(ms)
        for name, (_, wide) in NARROW_FUSED.items():
            lines.append(f"{name} / {wide} = {ms[name] / ms[wide]:.2f}x (target <= 0.90x)")
        print("\n" + "\n".join(lines), flush=True)


def host_only(*, steps: int, warmup: int) -> None:
    """The fused CUDA step's host work, its launch stubbed, against torch's fused steps."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from qhoptim.torch import _triton

    launches: list[int] = []
    _triton._launch = lambda *args, **kwargs: launches.append(1)  # type: ignore[assignment]

    class DeviceOps(TorchDispatchMode):
        """Counts torch operations on tensors of one or more dimensions."""

        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            flat = [a for x in args for a in (x if isinstance(x, (list, tuple)) else [x])]
            if any(isinstance(a, torch.Tensor) and a.dim() > 0 for a in flat):
                self.count += 1
            return func(*args, **(kwargs or {}))

    sgd = {"lr": 0.1, "momentum": 0.9, "nesterov": True}
    makers: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
        "torch SGD-nesterov fused": lambda p: torch.optim.SGD(p, **sgd, fused=True),
        "torch Adam fused": lambda p: torch.optim.Adam(p, fused=True),
        "QHM fused (host only)": lambda p: QHM(p, **QHM_KW, fused=True),
        "QHAdam fused (host only)": lambda p: QHAdam(p, **QHADAM_KW, fused=True),
        "QHAdam nu2<1 fused (host only)": lambda p: QHAdam(p, **QHADAM_NU2_KW, fused=True),
    }
    for n in (62, 500):
        ms = time_steps(makers, [(4,)] * n, steps=steps, warmup=warmup, device="cpu")
        print(f"\n### {n} tensors of 4 values: host work per step\n")
        print("| step | us/step | device operations per step |\n|---|---:|---:|")
        for name, make in makers.items():
            ops = ""
            if "host only" in name:
                params = [torch.zeros(4, requires_grad=True) for _ in range(n)]
                for p in params:
                    p.grad = torch.ones(4)
                opt = make(params)
                opt.step()
                launches.clear()
                with DeviceOps() as counted:
                    opt.step()
                ops = str(len(launches) + counted.count)
            print(f"| {name} | {1e3 * ms[name]:.0f} | {ops} |")
        print()
        for qh, base in (
            ("QHM fused (host only)", "torch SGD-nesterov fused"),
            ("QHAdam fused (host only)", "torch Adam fused"),
            ("QHAdam nu2<1 fused (host only)", "torch Adam fused"),
        ):
            print(f"{qh} / {base} = {ms[qh] / ms[base]:.2f}x (target <= 1.00x)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=positive_int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--threads", type=positive_int, help="torch.set_num_threads (default: torch's)"
    )
    parser.add_argument("--qhoptim-110", type=Path, help="directory qhoptim 1.1.0 is installed in")
    parser.add_argument("--only", nargs="+", help="time only optimizers whose name contains one")
    parser.add_argument("--scale", action="store_true", help="fused steps on flat tensors")
    parser.add_argument("--sizes", nargs="+", type=positive_float, default=[1e6, 1e7, 1e8])
    parser.add_argument(
        "--host-only", action="store_true", help="the fused CUDA step's host work, on CPU"
    )
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU (torch.cuda.is_available() is False here)")
    if args.threads:
        torch.set_num_threads(args.threads)

    qh110 = None
    if args.qhoptim_110 is not None:
        qh110 = load_qhoptim_110(args.qhoptim_110)
        # 1.1.0 calls the deprecated add_(Number, Tensor) overloads.
        warnings.filterwarnings("ignore", message="This overload of", category=UserWarning)

    print(
        f"torch {torch.__version__}, device {args.device}, {torch.get_num_threads()} threads, "
        f"median of {args.steps} interleaved steps after {args.warmup} warm-up steps"
    )
    if args.host_only:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: CPU tensors take it
        host_only(steps=args.steps, warmup=args.warmup)
        return 0
    if args.scale:
        sizes = [int(s) for s in args.sizes]
        scale(sizes, steps=args.steps, warmup=args.warmup, device=args.device)
        return 0
    for shape_name in args.shapes:
        makers = candidates(qh110, args.device)
        if args.only:
            makers = {n: m for n, m in makers.items() if any(o in n for o in args.only)}
        ms = time_steps(
            makers,
            SHAPES[shape_name],
            steps=args.steps,
            warmup=args.warmup,
            device=args.device,
        )
        print("\n".join(report(shape_name, ms)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
