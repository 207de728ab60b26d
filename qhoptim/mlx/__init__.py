r"""QHM, QHAdam, QHAdamW and QHMuon for Apple's MLX (``mlx.optimizers.Optimizer`` subclasses).

They are used like ``mlx.optimizers.SGD`` and ``Adam``: ``optimizer.update(model,
grads)`` after ``nn.value_and_grad``, a learning rate that is a number or one
of MLX's schedules, the state in ``optimizer.state`` (saved with
``mlx.utils.tree_flatten`` and ``mx.save_safetensors``), and a training step
that ``mx.compile`` compiles with ``inputs=`` / ``outputs=`` naming the state::

    import mlx.optimizers as optim
    import qhoptim.mlx as qhmlx

    optimizer = qhmlx.QHM(learning_rate=1.0, momentum=0.999, nu=0.7)  # the rule of thumb
    optimizer = qhmlx.QHAdam(optim.cosine_decay(1e-3, 10_000), betas=(0.999, 0.999), nus=(0.7, 1.0))

The math of every step comes from :mod:`qhoptim.rules`; this module only keeps
MLX's optimizer conventions. Each parameter's step is one ``mx.compile``\ d
function of the rule, so an eager step is one fused kernel per parameter and a
compiled training step inlines it. Hyperparameters other than the learning
rate are Python numbers and constants of that function (``1 - beta`` is formed
in float64 before it meets the array, as in every backend); the first step of
a configuration compiles its kernel, and changing one of them later compiles
again. Schedule only ``learning_rate``.

``fused=True`` steps each float32 parameter in one pass over memory: a C++
kernel, an MLX primitive (``csrc/fused_cpu.cpp``) that reads the parameter,
its gradient and its state once and writes them back (in place where MLX
donates the old arrays), float32 or bfloat16 state alike, with the same
coefficients and the same bits as the operations' step run one by one. It
has no gradient or ``vmap`` rule. It is built on first
use against the installed MLX (a C++ compiler and nanobind, which the ``mlx``
extra installs; ``$QHOPTIM_CACHE_DIR`` or ``~/.cache/qhoptim`` keeps the
build) and runs on MLX's CPU stream. A bfloat16 state steps there by default
(``fused=None``) where the default device is the CPU and the kernel builds:
MLX does not fuse its operations across the bit cast that rounding needs, and
its own step of a bfloat16 state takes three passes or more.

Dtypes: a Python float ``learning_rate`` becomes a float32 ``mx.array`` (MLX's
convention), so float64 parameters would step with a learning rate rounded to
float32. A float64 user passes ``learning_rate=mx.array(lr, dtype=mx.float64)``
or a schedule that returns float64 (float64 runs on MLX's CPU stream).

The package holds one module per optimizer family:
``_qhm.py``, ``_qhadam.py`` (with ``QHAdamW``) and ``_qhmuon.py``, beside what
they share (``_base.py``: the narrow state, its rounding and the checked
learning rate and state) and the C++ step's build (``_extension.py``).

References:
  Ma & Yarats, `Quasi-hyperbolic momentum and Adam for deep learning
  <https://arxiv.org/abs/1810.06801>`_, ICLR 2019.
"""

from __future__ import annotations

try:
    import mlx.optimizers  # noqa: F401  (and mlx.core, which it imports)
except ImportError as error:  # pragma: no cover - exercised where MLX is absent
    raise ImportError(
        f"qhoptim.mlx needs MLX ({error.name} is not installed). "
        'Install it with `pip install "qhoptim[mlx]"`.'
    ) from error

# What state_dtype may be, and the type of a learning rate.
from qhoptim.mlx._base import STATE_DTYPES, LearningRate, _DtypeName  # noqa: F401
from qhoptim.mlx._qhadam import QHAdam, QHAdamW
from qhoptim.mlx._qhm import QHM
from qhoptim.mlx._qhmuon import QHMuon

__all__ = ["QHM", "QHAdam", "QHAdamW", "QHMuon"]

# Their public home, where pickles (and the docs) find them.
for _cls in (QHM, QHAdam, QHAdamW, QHMuon, _DtypeName):
    _cls.__module__ = __name__
del _cls
