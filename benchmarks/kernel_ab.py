"""Two builds of the fused CPU kernel side by side: the fused step of each, interleaved.

    python -m benchmarks.kernel_ab OLD.so NEW.so [--rounds 9] [--states f32 bf16 u8]
        [--cases resnet18 1e7 1e6]

A change to ``qhoptim/torch/csrc/fused_cpu.cpp`` is measured against the build
before it in one process, so that the machine's drift (a tenth and more from
run to run on a shared 2-core machine) hits both alike. Each argument is a
built extension (``qhoptim.torch._extension.cpu_extension().__file__`` prints
the current one; an older one stays in torch's extension folder, or comes from
a ``git worktree`` of the older commit). For QHAdam and QHM (the settings of
``benchmarks.state_dtype``) with float32, bfloat16 and 8-bit state, on
ResNet-18 shapes and one tensor of 1e7 values (and of 1e6, where the host's share of
a step shows), each build's optimizers step in
turn (3 steps per turn, ``--rounds`` turns) and the median step time is
printed, with the narrow states' ratio to the same build's float32-state step.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import positive_int
from benchmarks.shapes import RESNET18
from benchmarks.state_dtype import SETTINGS
from qhoptim.torch import _fused

CASES = {"resnet18": RESNET18, "1e7": [(10_000_000,)], "1e6": [(1_000_000,)]}
STATES: dict[str, torch.dtype | None] = {"f32": None, "bf16": torch.bfloat16, "u8": torch.uint8}


def load_build(path: Path) -> Any:
    """The extension module built at ``path`` (its name is the file's stem)."""
    spec = importlib.util.spec_from_file_location(path.name.split(".")[0], path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path} is not a loadable extension")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def use(build: Any) -> None:
    """Make the fused steps call ``build``'s kernels."""
    _fused.cpu_extension = lambda: build


def compare(builds: dict[str, Any], states: list[str], rounds: int, cases: list[str]) -> None:
    for case in cases:
        shapes = CASES[case]
        runs = {}
        for name, (cls, kwargs) in SETTINGS.items():
            for state in states:
                for label in builds:
                    gen = torch.Generator().manual_seed(0)
                    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
                    for p in params:
                        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
                    runs[(name, state, label)] = cls(
                        params, **kwargs, fused=True, state_dtype=STATES[state]
                    )
        for (_, _, label), opt in runs.items():  # warm-up
            use(builds[label])
            opt.step()
        times: dict[tuple[str, str, str], list[float]] = {key: [] for key in runs}
        for _ in range(rounds):
            for key, opt in runs.items():
                use(builds[key[2]])
                start = time.perf_counter()
                for _ in range(3):
                    opt.step()
                times[key].append((time.perf_counter() - start) / 3)
        ms = {key: statistics.median(t) * 1e3 for key, t in times.items()}
        for name in SETTINGS:
            cells = []
            for state in states:
                for label in builds:
                    cell = f"{state}-{label} {ms[(name, state, label)]:6.2f} ms"
                    if state != "f32" and "f32" in states:
                        cell += f" ({ms[(name, state, label)] / ms[(name, 'f32', label)]:.2f}x)"
                    cells.append(cell)
            print(f"{case:9s} {name:7s} " + "  ".join(cells))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--rounds", type=positive_int, default=9)
    parser.add_argument("--states", nargs="+", default=list(STATES), choices=list(STATES))
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--threads", type=positive_int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"old: {args.old}\nnew: {args.new}\n{args.threads} threads, median of {args.rounds}")
    builds = {"old": load_build(args.old), "new": load_build(args.new)}
    compare(builds, args.states, args.rounds, args.cases)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
