"""The fused CPU step's C++ extension (``csrc/fused_cpu.cpp``): an MLX primitive,
built on first use against the installed MLX and cached on disk.

The bottom layer of ``qhoptim.mlx``: it imports only MLX and the core's
:mod:`qhoptim.rounding` (whose C++ header the kernel includes), and, to build,
nanobind, the binding library MLX's own Python module is built with. The
optimizers (``__init__.py``) ask :func:`fused_extension` for it under
``fused=True``, and :func:`fused_extension_available` whether a bfloat16
state may step in it under ``fused=None``.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx

from qhoptim import rounding

_CSRC = Path(__file__).with_name("csrc") / "fused_cpu.cpp"

#: ``-ffp-contract=off``: each product and sum rounded as written, as MLX's
#: operations round them one by one, so that the fused step gives their bits
#: (GCC contracts ``a * b + c`` into a fused multiply-add where the CPU has
#: one, in C++ modes too). ``-march=native`` (``-mcpu=native`` on ARM): the
#: build is for the machine that runs it (its name holds the CPU's flags).
_NATIVE = "-mcpu=native" if platform.machine().lower() in ("arm64", "aarch64") else "-march=native"
_CFLAGS = ["-O3", _NATIVE, "-fno-math-errno", "-ffp-contract=off", "-std=c++20"]
#: macOS links an extension without Python's library: the interpreter that
#: loads it provides the symbols.
_LDFLAGS = ["-undefined", "dynamic_lookup"] if sys.platform == "darwin" else []
#: A build that takes longer is given up (nanobind and the step take ~10 s).
_BUILD_TIMEOUT_S = 600


def _fail(reason: str) -> RuntimeError:
    return RuntimeError(
        f"fused=True compiles qhoptim.mlx's C++ step on first use; {reason}. "
        "Install what is missing, or use fused=False (MLX's own operations)."
    )


def fused_extension() -> Any:
    """The compiled step (built on first use, then loaded from the disk cache).

    Raises ``RuntimeError`` saying what is missing where it cannot be built,
    or where the build does not take MLX's arrays (a nanobind whose ABI is not
    the one MLX was built with).
    """
    module, reason = _built()
    if module is None:
        raise _fail(reason)
    return module


def fused_extension_available() -> bool:
    """Whether :func:`fused_extension` gives the step (it is tried once per process)."""
    return _built()[0] is not None


@functools.cache
def _built() -> tuple[Any, str]:
    """The module, or None and why not. Tried once per process; a failed
    compilation is recorded beside where the library would be and not tried
    again for the same source, MLX, nanobind, Python and CPU (delete the
    ``.failed`` file to try again). Under ``fused=None`` any failure only
    means MLX's operations step the state, so every error is caught here."""
    try:
        return _build_or_load()
    except Exception as error:  # a read-only cache, a broken install: not built
        return None, f"{type(error).__name__}: {error}"


def _build_or_load() -> tuple[Any, str]:
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return None, f"it needs a C++ compiler (`c++`, or the one $CXX names: {compiler!r})"
    try:
        import nanobind  # type: ignore[import-untyped]
    except ImportError:
        return None, "it needs nanobind (`pip install nanobind`)"
    name = _module_name(nanobind.__version__)
    library = _cache_directory() / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}"
    failed = library.with_name(f"{name}.failed")
    if failed.is_file():
        return None, f"it failed to compile before ({failed}):\n{failed.read_text()}"
    if not library.is_file():
        failure = _build(compiler, nanobind, name, library)
        if failure:
            failed.write_text(failure)
            return None, f"compiling {_CSRC.name} failed:\n{failure}"
    try:
        module = _load(name, library)
        _smoke_test(module)
    except (ImportError, TypeError, ValueError) as error:  # another nanobind ABI, a broken file
        return None, (
            f"the build in {library} does not take MLX's arrays ({error}); nanobind "
            f"{nanobind.__version__} may not be the version MLX {_mlx_version()} was built with"
        )
    return module, ""


def _mlx_version() -> str:
    try:
        return importlib.metadata.version("mlx")
    except importlib.metadata.PackageNotFoundError:  # MLX built from source, not installed
        return str(Path(mx.__file__).resolve().parent)


def _module_name(nanobind_version: str) -> str:
    # One build per source, MLX, nanobind, Python, flags and CPU: two qhoptim
    # versions or two environments sharing the cache each keep their own.
    digest = hashlib.sha256(_CSRC.read_bytes())
    digest.update((rounding.CPP_INCLUDE_DIR / "rounding.h").read_bytes())
    flags = " ".join([*_CFLAGS, *_LDFLAGS])
    for part in (_mlx_version(), nanobind_version, sys.version, flags, _cpu()):
        digest.update(b"\0" + part.encode())
    return f"qhoptim_mlx_fused_cpu_{digest.hexdigest()[:12]}"


def _cpu() -> str:
    """What ``-march=native`` compiles for: the CPU's flags where Linux lists them."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.machine() + platform.processor()


def _cache_directory() -> Path:
    """``$QHOPTIM_CACHE_DIR``, else ``$XDG_CACHE_HOME/qhoptim`` (``~/.cache/qhoptim``), ``/mlx``."""
    root = os.environ.get("QHOPTIM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "qhoptim"
    )
    path = Path(root) / "mlx"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _build(compiler: str, nanobind: Any, name: str, library: Path) -> str:
    """Compile the step and nanobind's own sources into ``library``; the
    command and what the compiler said where it failed, or "" where it was built.

    Written to a temporary file and renamed into place: two processes building
    at once each write their own, and a reader never sees half a library.
    """
    mlx_root = Path(mx.__file__).resolve().parent
    source_dir = Path(nanobind.source_dir())
    include = [
        nanobind.include_dir(),
        str(source_dir.parent / "ext" / "robin_map" / "include"),
        sysconfig.get_paths()["include"],
        str(mlx_root / "include"),
        str(rounding.CPP_INCLUDE_DIR),  # the rounding rule in C++
    ]
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        output = Path(scratch) / library.name
        command = [
            compiler,
            *_CFLAGS,
            "-shared",
            "-fPIC",
            "-fvisibility=hidden",
            "-DNDEBUG",
            # MLX binds its arrays in nanobind's "mlx" domain; the step's
            # module joins it to take them.
            "-DNB_DOMAIN=mlx",
            f"-DQHOPTIM_MODULE_NAME={name}",
            *(f"-I{path}" for path in include),
            str(_CSRC),
            str(source_dir / "nb_combined.cpp"),
            f"-L{mlx_root / 'lib'}",
            "-lmlx",
            f"-Wl,-rpath,{mlx_root / 'lib'}",
            *_LDFLAGS,
            "-o",
            str(output),
        ]
        try:
            result = subprocess.run(
                command, capture_output=True, text=True, check=False, timeout=_BUILD_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            return f"the compiler ran past {_BUILD_TIMEOUT_S} s: {' '.join(command)}"
        if result.returncode != 0:
            return f"{' '.join(command)}\n{result.stderr[-4000:]}"
        os.replace(output, library)
    return ""


def _load(name: str, library: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:  # pragma: no cover - a file we just built
        raise ImportError(f"{library} is not a Python extension")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _smoke_test(module: Any) -> None:
    """One QHM step of one value: the module takes MLX's arrays and gives them back."""
    coefficients = mx.array([0.5, 0.5, 0.0, 1.0, 1.0, 1.0, 0.0], dtype=mx.float32)
    one = mx.ones((1,), dtype=mx.float32)
    buffer, param = module.fused_step(
        one, one, [mx.zeros((1,), dtype=mx.float32)], coefficients, mx.zeros((0,), dtype=mx.uint32),
        False, 0, False, False, False, 0, 0,
    )  # fmt: skip
    mx.eval(buffer, param)
    if buffer.item() != 0.5 or param.item() != 0.5:
        raise ValueError(f"one step of 1.0 gave buffer {buffer.item()}, parameter {param.item()}")
