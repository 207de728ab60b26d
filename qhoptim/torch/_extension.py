"""The fused CPU kernel's C++ extension (``csrc/fused_cpu.cpp``): built on first use,
then loaded from torch's extension cache.

The bottom layer beside ``_tensors.py``: it imports only torch and the
core's :mod:`qhoptim.rounding` and :mod:`qhoptim._build` (the C++ headers the
kernel includes). The fused
steps (``_fused.py``) and the narrow state's rounding (``_state_dtype.py``) call
the extension; :func:`cpu_kernel_available` lets a caller fall back to the
multi-tensor kernels where it cannot be built.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
import shutil
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from qhoptim import _build, rounding

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
    name = _extension_name()
    build_directory = extension_build_directory(name)
    try:
        with _builder_lock(build_directory):
            built = _load_built(name, build_directory)
            if built is not None:
                return built
            return cpp_extension.load(
                name=name,
                sources=[str(_CSRC)],
                extra_include_paths=[str(rounding.CPP_INCLUDE_DIR)],
                extra_cflags=_cflags(),
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_directory),
                verbose=False,
            )
    except Exception as error:  # the compiler's own failure, with its output
        raise RuntimeError(
            f"fused=True on CPU: compiling qhoptim's C++ kernel ({_CSRC.name}) failed; "
            f"use fused=False (the multi-tensor kernels). The build said: {error}"
        ) from error


# The compiler's flags for each vector width torch dispatches its own kernels
# to. AVX-512 builds prefer 512-bit vectors (GCC's default for most targets is
# 256): the 8-bit state's encoding and decoding take 16 values at a time there
# (fused 8-bit QHAdam 2.0x the float32-state step at 1e7 values, against 3.5x
# with AVX2); float32 steps are memory-bound either way. Every build gives the
# same bits (no reductions but maxima, no contraction: see _cflags).
_VECTOR_FLAGS = {
    "": [],
    "avx2": ["-mavx2", "-mfma"],
    "avx512": [
        *("-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
        "-mprefer-vector-width=512",
    ],
}


def _cflags() -> list[str]:
    """The compiler's flags for this CPU's build.

    OpenMP: ``at::parallel_for`` is inline, so without it the kernel would run
    on one thread (``libgomp.so.1`` resolves to the copy torch has loaded).
    ``-ffp-contract=off``: each product and sum rounded as written, as the
    multi-tensor paths and the Triton kernels round them, and the same bits
    from every build (GCC and Clang would otherwise contract ``a * b + c``
    into a fused multiply-add where the CPU has one, in C++ modes too).
    """
    flags = ["-O3", "-fno-math-errno", "-ffp-contract=off", "-fopenmp"]
    return flags + _VECTOR_FLAGS[_vector_width()]


def _vector_width() -> str:
    """The vector width torch found this CPU to have: a key of ``_VECTOR_FLAGS``
    ("" for the compiler's baseline)."""
    capability = torch.backends.cpu.get_cpu_capability()
    return {"AVX2": "avx2", "AVX512": "avx512"}.get(capability, "")


def _extension_name() -> str:
    # The kernel is built on the machine that runs it, under a name per vector
    # width, per source and per torch build: two qhoptim versions (or two
    # torch builds of one version) sharing the extension cache then each keep
    # their own build instead of rebuilding the other's, even at the same time.
    digest = hashlib.sha256(_CSRC.read_bytes())
    for header in _build.shared_headers():  # qhoptim/csrc, which the kernel includes
        digest.update(header.read_bytes())
    digest.update(str(torch.version.git_version).encode())
    digest.update(" ".join(_cflags()).encode())  # new flags, a new build
    return (
        "qhoptim_fused_cpu"
        + (f"_{_vector_width()}" if _vector_width() else "")
        + f"_{digest.hexdigest()[:12]}"
    )


def _install_tag() -> str:
    """A short digest of the paths a build's commands name: torch's and Python's
    headers, the source, and the core's header folder.

    Two environments holding the same torch (two virtualenvs), or two checkouts
    of the same source, would write different commands into one folder, and
    ninja would rebuild whenever the other one built last (tens of seconds each
    time). One folder per installation and checkout keeps each build.
    """
    from torch.utils import cpp_extension

    paths = [
        *cpp_extension.include_paths(),
        sysconfig.get_paths()["include"],
        str(_CSRC),
        str(rounding.CPP_INCLUDE_DIR),
    ]
    return hashlib.sha256("\0".join(paths).encode()).hexdigest()[:8]


def _builds_of(name: str) -> Path:
    """The folder of every build named ``name``: one per Python and torch version.

    Under ``TORCH_EXTENSIONS_DIR`` when set, else torch's default extension root.
    The torch version is part of the path because a build links against one torch.
    """
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    torch_version = torch.__version__.replace("+", "_")
    return Path(root) / f"{python}_torch{torch_version}" / name


def extension_build_directory(name: str | None = None) -> Path:
    """Where this installation builds and caches the kernel: a folder per Python,
    torch build, source, and installation (the paths its build commands name)."""
    path = _builds_of(name or _extension_name()) / _install_tag()
    path.mkdir(parents=True, exist_ok=True)
    return path


def _load_built(name: str, build_directory: Path) -> Any | None:
    """The kernel as built before, here or by another installation; ``None``
    where there is no build, or none loads (a build killed while linking).

    A build's name holds a digest of its source, flags and torch build, so a
    library under that name is this source's build whatever its files' times.
    It is loaded without asking ninja, which compares times: a fresh clone's
    source is newer than the library, and ninja would compile it again (25-35 s
    a vector width, on every CI run). The same source, Python and torch build
    compile to the same library, whatever the paths, so a second virtualenv with
    the same torch loads the first one's build instead of compiling its own.
    """
    own = build_directory / f"{name}.so"
    if own.is_file() and (module := _load_library(name, own)) is not None:
        return module
    for other in sorted(_builds_of(name).iterdir()):
        library = other / f"{name}.so"
        if other == build_directory or not library.is_file():
            continue
        with _builder_lock(other):  # not while its own builder writes it
            module = _load_library(name, library)
        if module is not None:
            return module
    return None


def _load_library(name: str, library: Path) -> Any | None:
    try:
        spec = importlib.util.spec_from_file_location(name, library)
        if spec is None or spec.loader is None:
            return None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError:
        return None
    return module


@contextlib.contextmanager
def _builder_lock(build_directory: Path) -> Iterator[None]:
    """Hold an OS lock on the build folder while torch builds or loads the kernel.

    torch guards a build with a file (``lock``) that it creates and deletes, and
    waits for as long as the file exists, so a build killed part-way (a timeout,
    Ctrl-C, an out-of-memory kill) leaves every later process waiting forever.
    An ``flock`` is released by the kernel when its holder dies; whoever holds it
    knows that no live process of ours is building here, so a ``lock`` file it
    finds was left by a dead one and is removed.
    """
    try:
        import fcntl
    except ImportError:  # no flock (Windows): torch's own file lock alone
        yield
        return
    with open(build_directory / "qhoptim-builder.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (build_directory / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def loaded_cpu_extension() -> Any | None:
    """The extension where this process has it already (built or loaded by an
    earlier call), else None: for host work it speeds up that must never wait
    for a build."""
    return cpu_extension() if cpu_extension.cache_info().currsize else None


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
