"""Benchmarks: each a module run with ``python -m benchmarks.NAME`` (see its docstring)."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An argparse type: a count of at least 1 (0 steps has no median)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1; received {text}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a size above 0."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0; received {text}")
    return value
