"""Settings of the MLX backend's tests (``tests/mlx``).

Every test runs on MLX's CPU device: float64 exists only there, and the
reference comparisons are made in float64.
"""

from __future__ import annotations

import mlx.core as mx

mx.set_default_device(mx.cpu)
