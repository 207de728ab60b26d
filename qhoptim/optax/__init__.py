r"""QHM, QHAdam and QHMuon as optax gradient transformations.

``scale_by_qhm``, ``scale_by_qhadam`` and ``scale_by_qhmuon`` are the scalings;
``qhm``, ``qhadam``, ``qhadamw`` and ``qhmuon`` compose them with the learning
rate exactly as ``optax.sgd``, ``optax.adam``, ``optax.adamw`` and
``optax.contrib.muon`` do, so they chain, inject and checkpoint like any optax
optimizer; ``from_params`` builds one from a :mod:`qhoptim.convert` result::

    import optax
    import qhoptim.optax as qho
    from qhoptim import convert

    tx = optax.chain(optax.clip_by_global_norm(1.0), qho.qhadam(1e-3, nu1=0.7))
    tx = qho.from_params(convert.from_nesterov(lr=0.01, momentum=0.9))  # sgd(nesterov=True)

The math of every step comes from :mod:`qhoptim.rules`; this module only maps it
over pytrees, keeps optax's state and dtype conventions, and lets XLA fuse it
-- but for a bfloat16 or 8-bit state's moving averages on the CPU, which one
C++ custom call per step steps and stores (``fused``;
:mod:`qhoptim.optax._extension`).

References:
  Ma & Yarats, `Quasi-hyperbolic momentum and Adam for deep learning
  <https://arxiv.org/abs/1810.06801>`_, ICLR 2019.
"""

from __future__ import annotations

from typing import Any

try:
    import jax  # noqa: F401  (every module below needs it)
    import optax
except ImportError as error:  # pragma: no cover - exercised where JAX or optax is absent
    raise ImportError(
        f"qhoptim.optax needs JAX and optax ({error.name} is not installed). "
        'Install them with `pip install "qhoptim[jax]"`.'
    ) from error

from qhoptim import convert, validation
from qhoptim.optax._narrow import EightBitArray, decoded_state
from qhoptim.optax._qhadam import (
    ScaleByQHAdamAmsgradState,
    ScaleByQHAdamState,
    qhadam,
    qhadamw,
    scale_by_qhadam,
)
from qhoptim.optax._qhm import ScaleByQHMCountState, ScaleByQHMState, qhm, scale_by_qhm
from qhoptim.optax._qhmuon import ScaleByQHMuonState, qhmuon, scale_by_qhmuon

__all__ = [
    "EightBitArray",
    "ScaleByQHAdamAmsgradState",
    "ScaleByQHAdamState",
    "ScaleByQHMCountState",
    "ScaleByQHMState",
    "ScaleByQHMuonState",
    "decoded_state",
    "from_params",
    "qhadam",
    "qhadamw",
    "qhm",
    "qhmuon",
    "scale_by_qhadam",
    "scale_by_qhm",
    "scale_by_qhmuon",
]


def from_params(
    params: convert.QHMParams | convert.QHAdamParams | convert.QHMuonParams, **kwargs: Any
) -> optax.GradientTransformationExtraArgs:
    """Build :func:`qhm`, :func:`qhadam` or :func:`qhmuon` from a :mod:`qhoptim.convert` result.

    A :class:`qhoptim.convert.QHMParams` gives :func:`qhm`, a
    :class:`qhoptim.convert.QHAdamParams` gives :func:`qhadam`, a
    :class:`qhoptim.convert.QHMuonParams` (:func:`qhoptim.convert.from_muon`)
    gives :func:`qhmuon`, whose ``learning_rate`` is then a keyword; keyword
    arguments (``accumulator_dtype``, ``mu_dtype``, ``state_dtype``, ...) are passed on. This is
    the optax counterpart of Keras's ``QHM.from_params`` /
    ``QHAdam.from_params``.

    Args:
      params: the hyperparameters, e.g. ``convert.from_nesterov(lr, momentum)``.
      **kwargs: further keyword arguments of :func:`qhm` or :func:`qhadam`.

    Returns:
      The corresponding :class:`optax.GradientTransformationExtraArgs`.

    Raises:
      TypeError: ``params`` is none of ``QHMParams``, ``QHAdamParams``, ``QHMuonParams``.

    Example:
      ``optax.sgd(0.1, momentum=0.9, nesterov=True)`` is QHM with
      ``learning_rate = 0.1 / (1 - 0.9)`` and ``nu = momentum``:

      >>> import jax.numpy as jnp, optax
      >>> import qhoptim.optax as qho
      >>> from qhoptim import convert
      >>> solver = qho.from_params(convert.from_nesterov(lr=0.1, momentum=0.9))
      >>> sgd = optax.sgd(0.1, momentum=0.9, nesterov=True)
      >>> params, grads = jnp.array([1.0, 2.0]), jnp.array([0.5, -1.0])
      >>> s1, s2 = solver.init(params), sgd.init(params)
      >>> for _ in range(3):
      ...     u1, s1 = solver.update(grads, s1, params)
      ...     u2, s2 = sgd.update(grads, s2, params)
      >>> print(", ".join(f"{x:.3f}" for x in u1), bool(jnp.allclose(u1, u2, rtol=1e-6)))
      -0.172, 0.344 True
    """
    validation.check_conversion(
        "from_params", params, convert.QHMParams, convert.QHAdamParams, convert.QHMuonParams
    )
    if isinstance(params, convert.QHMuonParams):
        # optax's Muon ties its AdamW's Nesterov to its own: nu = 1 is
        # muon(nesterov=False), whose other arrays step without it.
        adam_nesterov = params.nu != 1
        return qhmuon(
            **{"beta": params.momentum, "nu": params.nu, "adam_nesterov": adam_nesterov, **kwargs}
        )
    if isinstance(params, convert.QHMParams):
        return qhm(learning_rate=params.lr, momentum=params.momentum, nu=params.nu, **kwargs)
    (b1, b2), (nu1, nu2) = params.betas, params.nus
    return qhadam(learning_rate=params.lr, b1=b1, b2=b2, nu1=nu1, nu2=nu2, eps=params.eps, **kwargs)
