r"""QHM, QHAdam, QHAdamW and QHMuon for Keras 3 (``keras.optimizers.Optimizer`` subclasses).

The package is laid out as Keras lays out its own optimizers: one module per
optimizer family (``_qhm.py``; ``_qhadam.py`` with ``QHAdamW``) beside the
shared base class (``_base.py``). ``build`` creates the slot variables,
``update_step`` names them and runs one variable's step (``_step.py``),
written once with ``keras.ops`` from :func:`qhoptim.rules.qhm_update` /
:func:`qhoptim.rules.qhadam_update`, unchanged on the TensorFlow, JAX and torch
backends; slots in a narrower ``state_dtype`` step through ``_narrow.py``;
``get_config`` adds the QH hyperparameters to the base configuration. The
hyperparameters are checked by :mod:`qhoptim.validation`, with Keras's argument
names.

How a step runs is chosen once, at import, as a mixin of the shared base class
from the active backend's module (imported only on that backend):
``_tensorflow`` runs each variable's step as one XLA computation (see
:data:`TF_JIT_COMPILE`), ``_torch`` steps all variables at once with
:mod:`qhoptim.torch`'s kernel layer; JAX runs ``update_step`` as written.

Every base keyword of Keras optimizers is accepted and behaves as in Keras's own
``SGD`` and ``Adam``. In particular ``weight_decay`` is Keras's *decoupled*
weight decay (``variable -= variable * weight_decay * learning_rate``, AdamW
style) on all three classes; it is folded into the update (one pass over the
variable, ``rules.apply_update``) instead of being applied by the base class
as a separate pass, and honours ``exclude_from_weight_decay``. Coupled (L2)
decay is what Keras expresses with layer regularizers
(``kernel_regularizer=keras.regularizers.L2(weight_decay / 2)`` adds
``weight_decay * variable`` to the gradient).

Every write to a variable goes through the optimizer's ``assign`` (Keras's
contract for optimizers), or on torch through in-place kernels, as Keras's own
torch ``SGD`` and ``Adam`` do.

The classes are registered as Keras serializables (package ``"qhoptim"``), so
``keras.models.load_model`` restores them, configuration and state, without
``custom_objects`` once ``qhoptim.keras`` is imported. Importing it also makes
the names ``"qhm"``, ``"qhadam"`` and ``"qhadamw"`` (and ``"QHM"``, ``"QHAdam"``,
``"QHAdamW"``) strings ``model.compile(optimizer=...)`` and
``keras.optimizers.get`` accept, each giving the class with its defaults.

References:
  Ma & Yarats, `Quasi-hyperbolic momentum and Adam for deep learning
  <https://arxiv.org/abs/1810.06801>`_, ICLR 2019.
"""

from __future__ import annotations

import os
import sys
import types
import warnings
from typing import Any

try:
    import keras
except ImportError as error:  # pragma: no cover - exercised where Keras is absent
    if error.name is not None and error.name.split(".")[0] not in ("keras", "qhoptim"):
        # Keras is installed; the framework of its backend is not (Keras takes
        # TensorFlow unless KERAS_BACKEND or keras.json names another).
        raise ImportError(
            f"qhoptim.keras: Keras is installed, but its backend needs {error.name}, which is "
            "not; set KERAS_BACKEND to an installed framework (jax, torch or tensorflow) "
            f"or install {error.name}."
        ) from error
    raise ImportError(
        "qhoptim.keras needs Keras 3, which is not installed. Install it with "
        '`pip install "qhoptim[tensorflow]"` (Keras on TensorFlow), or `pip install keras` '
        "beside JAX or torch."
    ) from error

__all__ = ["QHM", "QHAdam", "QHAdamW", "QHMuon"]


# The oldest Keras tested (the lowest nox session): 3.10 added
# Optimizer.add_optimizer_variables, which build() uses.
MIN_KERAS = (3, 10)


def _check_keras_version(version: str, environ: Any = os.environ) -> None:
    """Refuse Keras 2 and Keras 3 before 3.10; warn when ``tf.keras`` has been switched
    to Keras 2 (tf_keras)."""
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:  # pragma: no cover - an unparsable version: let Keras fail later
        return
    if (major, minor) < MIN_KERAS:
        raise ImportError(
            f"qhoptim.keras requires Keras >= {MIN_KERAS[0]}.{MIN_KERAS[1]} (found keras "
            f"{version}). Install it with `pip install -U 'keras>=3.10'` (Keras 3 is "
            "TensorFlow's tf.keras from TensorFlow 2.16). Keras 2 and tf_keras optimizers "
            "are not supported; Keras before 3.10 lacks Optimizer.add_optimizer_variables."
        )
    if environ.get("TF_USE_LEGACY_KERAS", "").strip().lower() in ("1", "true", "yes"):
        warnings.warn(
            "TF_USE_LEGACY_KERAS is set, so `tf.keras` is Keras 2 (tf_keras), which cannot use "
            "qhoptim.keras optimizers: they are Keras 3 optimizers. Build the model with "
            "`import keras` (Keras 3), or unset TF_USE_LEGACY_KERAS.",
            UserWarning,
            stacklevel=3,
        )


_check_keras_version(keras.__version__)

from qhoptim.keras import _settings  # noqa: E402
from qhoptim.keras._qhadam import QHAdam, QHAdamW  # noqa: E402
from qhoptim.keras._qhm import QHM  # noqa: E402
from qhoptim.keras._qhmuon import QHMuon  # noqa: E402

# The classes' public home: Keras records it in saved configs, Sphinx documents it.
for _cls in (QHM, QHAdam, QHAdamW, QHMuon):
    _cls.__module__ = __name__


# ---------------------------------------------------------------- settings
def _setting(name: str) -> property:
    """A setting of ``_settings``, read and set through the package."""

    def read(module: types.ModuleType) -> Any:
        return getattr(_settings, name)

    def write(module: types.ModuleType, value: Any) -> None:
        setattr(_settings, name, value)

    return property(read, write)


class _Package(types.ModuleType):
    """This package, whose settings are kept in ``_settings``, where the steps
    read them at every step: set here, they are set there."""

    TF_JIT_COMPILE = _setting("TF_JIT_COMPILE")
    TORCH_FUSED = _setting("TORCH_FUSED")


sys.modules[__name__].__class__ = _Package

# ------------------------------------------------------------------ by name
#: The strings ``model.compile(optimizer=...)`` and ``keras.optimizers.get``
#: accept for qhoptim's optimizers once this module is imported, as Keras
#: accepts ``"adam"`` and ``"Adam"`` for its own.
NAMES = {
    "qhm": QHM,
    "QHM": QHM,
    "qhadam": QHAdam,
    "QHAdam": QHAdam,
    "qhadamw": QHAdamW,
    "QHAdamW": QHAdamW,
    "qhmuon": QHMuon,
    "QHMuon": QHMuon,
}


def _register_names(custom_objects: dict[str, Any]) -> None:
    """Add :data:`NAMES` to Keras's global custom objects, where ``keras.optimizers.get``
    looks a string up; a name the user registered first is left as it is."""
    for name, cls in NAMES.items():
        custom_objects.setdefault(name, cls)


_register_names(keras.saving.get_custom_objects())
