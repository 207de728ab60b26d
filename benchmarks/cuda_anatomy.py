"""Where a fused CUDA step's time goes: host, launch and kernel, against torch's.

    python -m benchmarks.cuda_anatomy [--blocks 1024 2048 4096] [--warps 4 8]

For each parameter set (ResNet-18 shapes, 500 x 1k, one tensor of 1e6, 1e7 and
1e8 values) and optimizer (torch's fused SGD-Nesterov and Adam, qhoptim's fused
QHM and QHAdam), three medians over 30 steps after a warm-up:

* ``host``: the time ``step()`` takes to return, the GPU kept ahead of the host
  (what the host spends issuing the step);
* ``launch``: of that, the time in qhoptim's Triton launch (``_triton._launch``);
* ``kernel``: the step's kernels' time on the device (torch's profiler).

qhoptim's rows are repeated for each Triton block size and warp count given, so
that the kernel's shape can be chosen by measurement. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.shapes import RESNET18, SMALL
from qhoptim.torch import QHM, QHAdam

try:
    from qhoptim.torch import _triton
except ImportError as error:  # run as a script: say what it needs, not a traceback
    sys.exit(f"cuda_anatomy needs Triton and a CUDA GPU (torch's CUDA build ships Triton): {error}")

SETS = {
    "resnet18": RESNET18,
    "500x1k": SMALL,
    "1e6": [(1_000_000,)],
    "1e7": [(10_000_000,)],
    "1e8": [(100_000_000,)],
}


def _params(shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    params = [torch.randn(s, device="cuda").requires_grad_() for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    return params


def _kernel_ms(opt: Any, steps: int) -> float:
    """The median device time of one step's kernels, from torch's profiler."""
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CUDA], acc_events=True
    ) as prof:
        for _ in range(steps):
            opt.step()
        torch.cuda.synchronize()
    total_us = sum(e.device_time_total for e in prof.key_averages() if e.device_time_total > 0)
    return total_us / steps / 1e3


def measure(
    make: Callable[[list[torch.Tensor]], Any], shapes: list[tuple[int, ...]]
) -> dict[str, float]:
    params = _params(shapes)
    opt = make(params)
    for _ in range(5):
        opt.step()
    torch.cuda.synchronize()
    launch: list[float] = []
    original = _triton._launch

    def timed_launch(*args: Any, **kwargs: Any) -> None:
        t0 = time.perf_counter()
        original(*args, **kwargs)
        launch.append(time.perf_counter() - t0)

    _triton._launch = timed_launch  # type: ignore[assignment]
    host = []
    try:
        for _ in range(30):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.step()
            host.append(time.perf_counter() - t0)
    finally:
        _triton._launch = original  # type: ignore[assignment]
    torch.cuda.synchronize()
    per_step_launch = sum(launch) / 30 if launch else 0.0
    return {
        "host": 1e3 * statistics.median(host),
        "launch": 1e3 * per_step_launch,
        "kernel": _kernel_ms(opt, 20),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", nargs="+", type=int, default=[_triton._BLOCK])
    parser.add_argument("--warps", nargs="+", type=int, default=[_triton._NUM_WARPS])
    parser.add_argument("--sets", nargs="+", choices=list(SETS), default=list(SETS))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (torch.cuda.is_available() is False here)")
    sgd = {"lr": 0.1, "momentum": 0.9, "nesterov": True}
    torch_makers = {
        "torch SGD-nesterov fused": lambda p: torch.optim.SGD(p, **sgd, fused=True),
        "torch Adam fused": lambda p: torch.optim.Adam(p, fused=True),
    }
    qh_makers = {
        "QHM fused": lambda p: QHM(p, lr=1.0, momentum=0.999, nu=0.7, fused=True),
        "QHAdam fused": lambda p: QHAdam(
            p, lr=1e-3, betas=(0.999, 0.999), nus=(0.7, 1.0), fused=True
        ),
    }
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; ms per step, medians")
    for name in args.sets:
        shapes = SETS[name]
        print(f"\n### {name}\n\n| optimizer | block | warps | host | launch | kernel |")
        print("|---|---:|---:|---:|---:|---:|")
        for label, make in torch_makers.items():
            m = measure(make, shapes)
            print(f"| {label} | | | {m['host']:.3f} | | {m['kernel']:.3f} |", flush=True)
        for block in args.blocks:
            for warps in args.warps:
                _triton._BLOCK, _triton._NUM_WARPS = block, warps
                _triton._BLOCKS.clear()
                for label, make in qh_makers.items():
                    m = measure(make, shapes)
                    print(
                        f"| {label} | {block} | {warps} | {m['host']:.3f} | {m['launch']:.3f} "
                        f"| {m['kernel']:.3f} |",
                        flush=True,
                    )
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
