"""Building the C++ CPU kernels of the MLX and optax backends on first use.

What the builds share, framework-free: the compiler flags (no fused
multiply-add contraction, tuned for this CPU), the on-disk cache and its
file names (a digest of everything a build depends on), compiling into a
temporary file renamed into place, and the record of a failed compilation,
which is not tried again. Each backend's ``_extension`` module writes its own
compiler command (its framework's headers and libraries) and loads the result.
(The torch backend builds through ``torch.utils.cpp_extension`` instead.)
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from qhoptim import rounding

#: ``-ffp-contract=off``: each product and sum rounded as written, as the
#: frameworks' own element-wise operations round them one by one (GCC
#: contracts ``a * b + c`` into a fused multiply-add where the CPU has one, in
#: C++ modes too). ``-march=native`` (``-mcpu=native`` on ARM): the build is
#: for the machine that runs it (its name holds the CPU's flags).
NATIVE = "-mcpu=native" if platform.machine().lower() in ("arm64", "aarch64") else "-march=native"
CFLAGS = ("-O3", NATIVE, "-fno-math-errno", "-ffp-contract=off", "-std=c++20")
#: macOS links an extension without Python's library: the interpreter that
#: loads it provides the symbols.
LDFLAGS = ("-undefined", "dynamic_lookup") if sys.platform == "darwin" else ()
#: A build that takes longer is given up (the kernels take seconds), and
#: tried again in the next process.
BUILD_TIMEOUT_S = 600
TIMED_OUT = "the compiler ran past"


def shared_headers() -> list[Path]:
    """The headers the kernels share (``qhoptim/csrc``: the rounding rule, the 8-bit
    state's encoding, the slicing over threads), which each build's name digests."""
    return sorted(rounding.CPP_INCLUDE_DIR.glob("*.h"))


def compiler() -> str | None:
    """The C++ compiler (``$CXX``, else ``c++``) where it is on the path, else None."""
    name = os.environ.get("CXX", "c++")
    return name if shutil.which(name) is not None else None


@functools.cache
def compiler_version() -> str:
    """The first line of ``$CXX --version`` (a build's name holds it: another
    compiler is another build, and another chance after a failure)."""
    name = compiler()
    if name is None:
        return ""
    try:
        result = subprocess.run([name, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return name
    return f"{name}: {(result.stdout.splitlines() or [''])[0]}"


#: What to say where :func:`compiler` finds none.
NO_COMPILER = "it needs a C++ compiler (`c++`, or the one $CXX names) on the path"


def cpu_flags() -> str:
    """What ``-march=native`` compiles for: the CPU's flags where Linux lists them."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.machine() + platform.processor()


def cache_directory(backend: str) -> Path:
    """``$QHOPTIM_CACHE_DIR``, else ``$XDG_CACHE_HOME/qhoptim`` (``~/.cache/qhoptim``),
    then ``/backend``; made where missing."""
    root = os.environ.get("QHOPTIM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "qhoptim"
    )
    path = Path(root) / backend
    path.mkdir(parents=True, exist_ok=True)
    return path


def library_name(stem: str, sources: Iterable[Path], versions: Iterable[str]) -> str:
    """``stem`` and a digest of the sources, the versions of what the build
    links against, Python, the compiler, the flags and the CPU: two qhoptim versions or two
    environments sharing the cache each keep their own build."""
    digest = hashlib.sha256()
    for source in sources:
        digest.update(source.read_bytes())
    flags = " ".join([*CFLAGS, *LDFLAGS])
    for part in (*versions, sys.version, compiler_version(), flags, cpu_flags()):
        digest.update(b"\0" + part.encode())
    return f"{stem}_{digest.hexdigest()[:12]}"


def compile_library(
    compiler: str,
    library: Path,
    sources: Iterable[Path],
    *,
    include: Iterable[str] = (),
    defines: Iterable[str] = (),
    link: Iterable[str] = (),
) -> str:
    """Compile ``sources`` into the shared library ``library`` with :data:`CFLAGS`
    (the shared headers on the include path, only exported symbols visible);
    "" where it was built, else the command and what the compiler said.

    Written to a temporary file and renamed into place: two processes building
    at once each write their own, and a reader never sees half a library.
    """
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        output = Path(scratch) / library.name
        command = [
            compiler,
            *CFLAGS,
            "-shared",
            "-fPIC",
            "-fvisibility=hidden",
            "-DNDEBUG",
            *(f"-D{define}" for define in defines),
            f"-I{rounding.CPP_INCLUDE_DIR}",
            *(f"-I{path}" for path in include),
            *(str(source) for source in sources),
            *link,
            *LDFLAGS,
            "-o",
            str(output),
        ]
        try:
            result = subprocess.run(
                command, capture_output=True, text=True, check=False, timeout=BUILD_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            return f"{TIMED_OUT} {BUILD_TIMEOUT_S} s: {' '.join(command)}"
        if result.returncode != 0:
            return f"{' '.join(command)}\n{result.stderr[-4000:]}"
        os.replace(output, library)
    return ""


def built(library: Path, build: Callable[[], str]) -> str:
    """Make sure ``library`` exists: "" where it does (cached, or ``build()``
    made it), else why not.

    A failed compilation is recorded beside the library (``NAME.failed``, with
    the command and the compiler's output) and not tried again for the same
    name (delete the file to try again).
    """
    if library.is_file():  # built here, or by another process since a failure here
        return ""
    failed = library.with_name(library.name.split(".")[0] + ".failed")
    if failed.is_file():
        return f"it failed to compile before ({failed}):\n{failed.read_text()}"
    failure = build()
    if failure and not failure.startswith(TIMED_OUT):  # a slow machine may do better next time
        failed.write_text(failure)
    return f"compiling it failed:\n{failure}" if failure else ""
