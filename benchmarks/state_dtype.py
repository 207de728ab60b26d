"""bfloat16 and 8-bit optimizer state (``state_dtype``) in qhoptim.torch, against float32 state.

    python -m benchmarks.state_dtype [--seeds 5] [--epochs 30] [--quick]

Prints, for QHM and QHAdam with float32 parameters:

* state bytes per parameter (the moments only; QHM's bfloat16 state adds a
  step count per tensor);
* the step's peak memory: how far a few steps of a 5e7-value model raise the
  process's peak resident memory above its parameters and gradients (state
  and temporaries), measured in a fresh process per setting (Linux);
* step time on ResNet-18 shapes (``benchmarks/shapes.py``, 2 threads, median
  of interleaved steps), foreach and fused;
* a digits MLP (scikit-learn's 8x8 digits, the sweep's 64-200-100-50-10
  network and data split) trained for ``--epochs`` epochs over ``--seeds``
  seeds with each state dtype: the mean validation error and its spread;
* QHAdam's paths and state dtypes against ``torch.optim.Adam(fused=True)``
  with float32 state, on ResNet-18 shapes and one tensor of about 1e7 values (and
  bitsandbytes' ``Adam8bit`` and torchao's ``AdamW8bit``, optional: rows where
  they are installed, a note where not).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np
import torch

import qhoptim.torch as qht
from benchmarks.shapes import RESNET18

SETTINGS = {
    "QHM": (qht.QHM, {"lr": 1.0, "momentum": 0.999, "nu": 0.7}),
    "QHAdam": (qht.QHAdam, {"lr": 1e-3, "betas": (0.995, 0.999), "nus": (0.7, 1.0)}),
}
STATE_KEYS = ("momentum_buffer", "exp_avg", "exp_avg_sq")
#: The narrow states compared with float32 state: (label, dtype, its source text).
NARROW = (("bfloat16", torch.bfloat16, "torch.bfloat16"), ("8-bit", torch.uint8, "torch.uint8"))


def _make(name: str, params: Any, state_dtype: torch.dtype | None, **flags: Any) -> Any:
    cls, kwargs = SETTINGS[name]
    return cls(params, **kwargs, **flags, state_dtype=state_dtype)


def state_bytes_per_value(name: str, state_dtype: torch.dtype | None) -> float:
    params = [torch.nn.Parameter(torch.zeros(1000))]
    params[0].grad = torch.ones(1000)
    opt = _make(name, params, state_dtype)
    opt.step()
    state = opt.state[params[0]]
    return sum(state[k].numel() * state[k].element_size() for k in STATE_KEYS if k in state) / 1000


def peak_growth_mb(name: str, state_dtype: str) -> float:
    """How far 3 steps of a 5e7-value model raise the process's peak resident memory
    above what its parameters and gradients already hold, in a fresh process.

    Linux: the peak (``VmHWM``) is reset after the set-up by writing 5 to
    ``/proc/self/clear_refs``, so torch's import (and the C++ extension's) does not
    hide the step's peak.
    """
    code = f"""
import torch, benchmarks.state_dtype as b
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) / 1024
torch.set_num_threads(2)
p = torch.nn.Parameter(torch.randn(50_000_000)); p.grad = torch.randn(50_000_000)
# The C++ extension (which rounds bfloat16 state) loaded before the peak is reset
# in every setting: its code and OpenMP's threads are not the step's memory.
from qhoptim.torch import _extension
_extension.cpu_kernel_available()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS:")
opt = b._make({name!r}, [p], {state_dtype})
for _ in range(3):
    opt.step()
print(status("VmHWM:") - before)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    return float(out.strip().splitlines()[-1])


def step_times(name: str, flags: dict[str, Any], steps: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    runs = {}
    for label, dtype in (("float32", None), *((label, dtype) for label, dtype, _ in NARROW)):
        params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in RESNET18]
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * 1e-3
        runs[label] = _make(name, params, dtype, **flags)
    for opt in runs.values():  # warm-up (and the fused kernel's build)
        opt.step()
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(steps):
        for label, opt in runs.items():
            t = time.perf_counter()
            opt.step()
            times[label].append(time.perf_counter() - t)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


# The comparison with torch's fused Adam and other 8-bit Adams: QHAdam's
# settings (nu1 = 0.7, nu2 = 1), the same lr and betas for the others.
_LR, _BETAS = SETTINGS["QHAdam"][1]["lr"], SETTINGS["QHAdam"][1]["betas"]
COMPARED: dict[str, Any] = {
    "torch Adam fused, float32 state": lambda p: torch.optim.Adam(
        p, lr=_LR, betas=_BETAS, fused=True
    ),
    "QHAdam fused, float32 state": lambda p: _make("QHAdam", p, None, fused=True),
    "QHAdam fused, bfloat16 state": lambda p: _make("QHAdam", p, torch.bfloat16, fused=True),
    "QHAdam foreach, bfloat16 state": lambda p: _make("QHAdam", p, torch.bfloat16, foreach=True),
    "QHAdam fused, 8-bit state": lambda p: _make("QHAdam", p, torch.uint8, fused=True),
    "QHAdam default path, 8-bit state": lambda p: _make("QHAdam", p, torch.uint8),
}


def _other_eight_bit_adams() -> tuple[dict[str, Any], list[str]]:
    """bitsandbytes' and torchao's 8-bit Adams where they are installed, and a note
    for each that is not (they are optional: neither is a dependency)."""
    found: dict[str, Any] = {}
    notes = []
    try:
        import bitsandbytes

        found[f"bitsandbytes {bitsandbytes.__version__} Adam8bit"] = lambda p: (
            bitsandbytes.optim.Adam8bit(p, lr=_LR, betas=_BETAS)
        )
    except ImportError:
        notes.append("bitsandbytes is not installed (`pip install bitsandbytes`): no row")
    try:
        import torchao
        from torchao.optim import AdamW8bit

        found[f"torchao {torchao.__version__} AdamW8bit (weight_decay=0)"] = lambda p: AdamW8bit(
            p, lr=_LR, betas=_BETAS, weight_decay=0.0
        )
    except ImportError:
        notes.append("torchao is not installed (`pip install torchao`): no row")
    return found, notes


def _tensor_bytes(t: torch.Tensor) -> int:
    """The bytes a tensor holds: a tensor subclass's (torchao's 8-bit state) are
    its inner tensors', not its dtype's size times its shape."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, name)) for name in names)
    return t.numel() * t.element_size()


def _state_bytes(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> float:
    """Bytes of state tensors per parameter value (step counts and other 0-d
    tensors left out)."""
    total = sum(
        _tensor_bytes(v)
        for p in params
        for v in opt.state[p].values()
        if torch.is_tensor(v) and v.dim() > 0
    )
    return total / sum(p.numel() for p in params)


def compare(steps: int) -> None:
    """QHAdam's paths and state dtypes against torch's fused Adam with float32 state
    (and bitsandbytes' and torchao's 8-bit Adams where installed), in one
    interleaved run per set of shapes: the median step over ``steps`` rounds."""
    others, notes = _other_eight_bit_adams()
    makers = {**COMPARED, **others}
    base = "torch Adam fused, float32 state"
    # About 1e7 values in whole blocks of 256: torchao quantizes only such tensors.
    flat = 10**7 // 256 * 256
    for label, shapes in (("ResNet-18 shapes", RESNET18), (f"one tensor of {flat:,}", [(flat,)])):
        gen = torch.Generator().manual_seed(0)
        runs = {}
        for name, make in makers.items():
            params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen) * 1e-3
            runs[name] = (make(params), params)
        for opt, _ in runs.values():  # warm-up (builds, compilations)
            opt.step()
        times: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(steps):
            for name, (opt, _) in runs.items():
                t = time.perf_counter()
                opt.step()
                times[name].append(time.perf_counter() - t)
        ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(f"\n### {label}: step time against torch's fused Adam (float32 state)\n")
        print("| step | ms | vs torch Adam fused | state bytes / value |\n|---|---:|---:|---:|")
        for name, (opt, params) in runs.items():
            print(
                f"| {name} | {ms[name]:.1f} | {ms[name] / ms[base]:.2f}x "
                f"| {_state_bytes(opt, params):.2f} |"
            )
    for note in notes:
        print(f"\n{note}")


def digits_errors(
    name: str, state_dtype: torch.dtype | None, seeds: int, epochs: int
) -> list[float]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    errors = []
    for seed in range(seeds):
        x_tr, x_va, y_tr, y_va = (
            torch.tensor(a)
            for a in train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
        )
        torch.manual_seed(seed)
        sizes = (64, 200, 100, 50, 10)
        layers: list[torch.nn.Module] = []
        for i in range(len(sizes) - 1):
            layers += [torch.nn.Linear(sizes[i], sizes[i + 1]), torch.nn.ReLU()]
        model = torch.nn.Sequential(*layers[:-1])
        opt = _make(name, model.parameters(), state_dtype)
        batch = 64
        order = torch.Generator().manual_seed(seed)
        for _ in range(epochs):
            perm = torch.randperm(len(x_tr), generator=order)
            for i in range(0, len(x_tr) - batch + 1, batch):
                idx = perm[i : i + batch]
                loss = torch.nn.functional.cross_entropy(model(x_tr[idx]), y_tr[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
        with torch.no_grad():
            errors.append(float((model(x_va).argmax(1) != y_va).float().mean()))
    return errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--steps", type=int, default=15, help="timed steps per setting")
    parser.add_argument("--quick", action="store_true", help="1 seed, 2 epochs, 3 steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.epochs, args.steps = 1, 2, 3
    torch.set_num_threads(2)
    print(f"torch {torch.__version__}, 2 threads; float32 parameters")
    print("\n| optimizer | state | bytes/value | state + temporaries, 5e7 values | ", end="")
    print("ResNet-18 step, foreach | fused | digits val. error (mean ± sd) |")
    print("|---|---|---:|---:|---:|---:|---|")
    results: dict[str, Any] = {}
    for name in SETTINGS:
        foreach = step_times(name, {"foreach": True}, args.steps)
        fused = step_times(name, {"fused": True}, args.steps)
        for label, dtype, arg in (("float32", None, "None"), *NARROW):
            errors = digits_errors(name, dtype, args.seeds, args.epochs)
            row = {
                "bytes": state_bytes_per_value(name, dtype),
                "peak_mb": peak_growth_mb(name, arg),
                "foreach_ms": foreach[label],
                "fused_ms": fused[label],
                "errors": errors,
            }
            results[f"{name}/{label}"] = row
            print(
                f"| {name} | {label} | {row['bytes']:.3g} | {row['peak_mb']:.0f} MB "
                f"| {row['foreach_ms']:.1f} ms | {row['fused_ms']:.1f} ms "
                f"| {100 * np.mean(errors):.2f}% ± {100 * np.std(errors):.2f} |"
            )
    print()
    for name in SETTINGS:
        a = results[f"{name}/float32"]
        for label, _, _ in NARROW:
            b = results[f"{name}/{label}"]
            diff = 100 * (np.mean(b["errors"]) - np.mean(a["errors"]))
            print(
                f"{name}: {label} state - float32 state, digits error {diff:+.2f} points; "
                f"step time foreach {b['foreach_ms'] / a['foreach_ms']:.2f}x, "
                f"fused {b['fused_ms'] / a['fused_ms']:.2f}x"
            )
    compare(args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
