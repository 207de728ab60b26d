"""qhoptim._build: the MLX and optax kernels' build, cache and failure record
(framework-free; each backend's tests build and load its own kernel)."""

from __future__ import annotations

from pathlib import Path

import pytest

from qhoptim import _build, rounding


def test_a_failed_compilation_is_recorded_and_not_tried_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("QHOPTIM_CACHE_DIR", str(tmp_path))
    library = _build.cache_directory("backend") / "name_0123.cpython-311-x86_64-linux-gnu.so"
    attempts = []

    def failing() -> str:
        attempts.append(1)
        return "c++: error: the compiler said no"

    first = _build.built(library, failing)
    assert "compiling it failed" in first and "the compiler said no" in first
    again = _build.built(library, failing)
    assert "failed to compile before" in again and "the compiler said no" in again
    assert len(attempts) == 1
    assert [p.name for p in (tmp_path / "backend").iterdir()] == ["name_0123.failed"]


def test_a_cached_library_is_not_built_again(tmp_path: Path) -> None:
    library = tmp_path / "name.so"
    library.write_bytes(b"")
    assert _build.built(library, lambda: pytest.fail("built again")) == ""


def test_a_compiler_error_is_reported_with_its_command(tmp_path: Path) -> None:
    source = tmp_path / "broken.cpp"
    source.write_text("this is not C++\n")
    if _build.compiler() is None:
        pytest.skip("no C++ compiler here")
    failure = _build.compile_library(_build.compiler() or "c++", tmp_path / "x.so", [source])
    assert "broken.cpp" in failure and "-ffp-contract=off" in failure
    assert not (tmp_path / "x.so").exists()


def test_the_name_follows_sources_versions_and_the_shared_headers() -> None:
    source = rounding.CPP_INCLUDE_DIR / "rounding.h"
    name = _build.library_name("x", [source], ["1"])
    assert name == _build.library_name("x", [source], ["1"])
    assert name != _build.library_name("x", [source], ["2"])
    assert name.startswith("x_")
    assert [p.name for p in _build.shared_headers()] == ["eight_bit.h", "rounding.h", "slices.h"]


def test_a_timed_out_compilation_is_tried_again(tmp_path: Path) -> None:
    library = tmp_path / "name.so"
    reason = _build.built(library, lambda: f"{_build.TIMED_OUT} 600 s: c++ step.cpp")
    assert _build.TIMED_OUT in reason
    assert list(tmp_path.iterdir()) == []
