"""qhoptim 1.1.0's version module, kept for code that reads ``qhoptim.version.version``.

The version is defined once, as :data:`qhoptim.__version__` (pyproject.toml
reads it from there).
"""

from __future__ import annotations

from . import __version__ as version

__all__ = ["version"]
