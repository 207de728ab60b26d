"""The fused CPU kernel's C++ extension (``csrc/fused_cpu.cpp``): built on first use,
then loaded from torch's extension cache.

The bottom layer beside ``_tensors.py``: it imports only torch. The fused
steps (``_fused.py``) and the narrow state's rounding (``_state_dtype.py``) call
the extension; :func:`cpu_kernel_available` lets a caller fall back to the
multi-tensor kernels where it cannot be built.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

import torch

_CSRC = Path(__file__).with_name("csrc") / "fused_cpu.cpp"


@functools.cache
def cpu_extension() -> Any:
    """The compiled C++ kernels (built on first use, then loaded from the disk cache)."""
    from torch.utils import cpp_extension

    missing = []
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        missing.append("a C++ compiler (`c++`, or the one $CXX names)")
    try:
        cpp_extension.verify_ninja_availability()
    except RuntimeError:
        missing.append("ninja (`pip install ninja`)")
    if missing:
        raise RuntimeError(
            "fused=True on CPU compiles qhoptim's C++ kernel on first use, which needs "
            + " and ".join(missing)
            + "; install them, or use fused=False (the multi-tensor kernels)."
        )
    # The vector width torch found this CPU to have (it dispatches its own
    # kernels likewise): AVX2 and FMA where present, else the compiler's baseline.
    # The kernel is built on the machine that runs it, under a name per width and
    # per source: two qhoptim versions (or two checkouts) sharing torch's
    # extension cache then each keep their own build instead of rebuilding the
    # other's, even at the same time.
    wide = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    digest = hashlib.sha256(_CSRC.read_bytes()).hexdigest()[:12]
    try:
        return cpp_extension.load(
            name="qhoptim_fused_cpu" + ("_avx2" if wide else "") + f"_{digest}",
            sources=[str(_CSRC)],
            # OpenMP: at::parallel_for is inline, so without it the kernel would run on
            # one thread; libgomp.so.1 resolves to the copy torch has already loaded.
            # -std=c++20 (ISO) keeps FMA contraction off: the same rounding either way.
            extra_cflags=["-O3", "-fno-math-errno", "-fopenmp"]
            + (["-mavx2", "-mfma"] if wide else []),
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as error:  # the compiler's own failure, with its output
        raise RuntimeError(
            f"fused=True on CPU: compiling qhoptim's C++ kernel ({_CSRC.name}) failed; "
            f"use fused=False (the multi-tensor kernels). The build said: {error}"
        ) from error


@functools.cache
def cpu_kernel_available() -> bool:
    """Whether the fused CPU kernel can be had (built, or loaded from the disk cache).

    For callers that fall back to the multi-tensor kernels (``qhoptim.keras`` on
    torch); the answer is kept, so a missing compiler is found once, not each step.
    """
    try:
        cpu_extension()
    except RuntimeError:
        return False
    return True
