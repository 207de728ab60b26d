r"""QHM, QHAdam and QHAdamW for Keras 3 (``keras.optimizers.Optimizer`` subclasses).

The classes follow ``keras/src/optimizers/adam.py``: ``build`` creates the slot
variables, ``update_step`` is written once with ``keras.ops`` and runs unchanged
on the TensorFlow, JAX and torch backends, ``get_config`` adds the QH
hyperparameters to the base configuration. The math of ``update_step`` is
:func:`qhoptim.rules.qhm_update` / :func:`qhoptim.rules.qhadam_update` (wrapped
in ``_qhm_step`` / ``_qhadam_step``, one variable's step); the hyperparameters
are checked by :mod:`qhoptim.validation`, with Keras's argument names.

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
import warnings
from typing import Any

try:
    import keras
except ImportError as error:  # pragma: no cover - exercised where Keras is absent
    raise ImportError(
        "qhoptim.keras needs Keras 3, which is not installed. Install it with "
        '`pip install "qhoptim[tensorflow]"` (Keras on TensorFlow), or `pip install keras` '
        "beside JAX or torch."
    ) from error

__all__ = ["QHM", "QHAdam", "QHAdamW"]


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

import functools  # noqa: E402

from keras import ops  # noqa: E402

from qhoptim import convert, rounding, rules, validation  # noqa: E402

try:  # the text Keras's own optimizers substitute for {{base_optimizer_keyword_args}}
    from keras.src.optimizers.optimizer import base_optimizer_keyword_args as _BASE_ARGS
except ImportError:  # pragma: no cover - keras moved its private module
    _BASE_ARGS = "name, weight_decay, clipnorm, clipvalue, global_clipnorm, use_ema, ..."

#: On the TensorFlow backend each variable's step -- reading the state, the
#: rule, writing the state back -- runs as one XLA computation
#: (``tf.function(jit_compile=True)``): one fused loop over memory, as on the
#: JAX backend, and one op per variable in the training graph. Without it
#: TensorFlow runs every ``+ - * /`` of the rule as a separate op and pass over
#: memory, and QHAdam is up to ~1.6x slower than Keras's ``Adam`` on CPU
#: (``benchmarks/keras_step.py``). Set to ``False`` before the first step (before
#: ``fit``) to use plain TensorFlow ops, e.g. on a device without XLA; the
#: numbers are the same. Read from this module at every step; TensorFlow only.
TF_JIT_COMPILE = True

#: On the torch backend, variables on the CPU step through ``qhoptim.torch``'s
#: fused CPU kernel (one pass over memory per step, as ``fused=True``) when it
#: can be had: it is compiled on first use (about 30 s, once per machine; it
#: needs a C++ compiler and ninja) and the multi-tensor kernels serve where it
#: cannot be built, and for CUDA variables. Set to ``False`` to always use the
#: multi-tensor kernels; the numbers agree to rounding. Read at every step.
TORCH_FUSED = True

_BACKEND = keras.backend.backend()


# ------------------------------------------------------------ one variable's step
def _scalar_input(value: Any, dtype: Any) -> Any:
    """A learning rate (or step count) as the step's input.

    A Python number becomes a tensor of the variable's dtype directly
    (``ops.cast(0.1, "float64")`` would round through float32 first); variables
    and tensors pass through and are cast inside the step, as Keras's own
    optimizers cast their float32 learning-rate variable.
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return ops.convert_to_tensor(float(value), dtype=dtype)
    return value


def _bias_correction_dtype() -> str:
    """The dtype bias corrections are computed in before the cast to the variable's dtype.

    float64 wherever the backend has it (TensorFlow, torch, JAX with
    ``jax_enable_x64``), else float32. ``1 - 0.999**t`` evaluated in float32 is
    off by ~1e-5 relative (0.999 itself rounds), in bfloat16 by a factor of 4.
    """
    if _BACKEND == "jax":
        import jax

        # float64 canonicalizes to itself only with ``jax_enable_x64``.
        x64 = jax.dtypes.canonicalize_dtype("float64") == "float64"
        return "float64" if x64 else "float32"
    return "float64"


def _new_value(param: Any, update: Any, lr: Any, weight_decay: Any) -> Any:
    """``param * (1 - lr * weight_decay) - lr * update``; no decay if ``weight_decay`` is None."""
    decay = 1 if weight_decay is None else rules.decoupled_decay_factor(lr, weight_decay)
    return rules.apply_update(param, update, lr, decay)


def _qhm_step(grad, lr, momentum_buffer, param, *, momentum, nu, weight_decay):
    """One QHM step of one variable, from :mod:`qhoptim.rules`: ``(buffer, param)``."""
    lr = ops.cast(lr, param.dtype)
    momentum_buffer, direction = rules.qhm_update(grad, momentum_buffer, momentum=momentum, nu=nu)
    return momentum_buffer, _new_value(param, direction, lr, weight_decay)


def _step_number(iterations, dtype):
    """The number of the step being taken, ``iterations + 1``, as a float of ``dtype``.

    Keras's ``iterations`` is an int32 on the torch backend and on JAX without
    x64; after ``2**31 - 1`` steps it wraps around to ``-2**31``. A negative
    count would make ``beta**t`` overflow and the bias corrections ``-inf``, and
    the step enormous; the wrapped count is read as the step it stands for
    (``+ 2**32``), where the bias corrections are 1.
    """
    t = ops.cast(iterations, dtype) + 1
    return ops.where(t < 1, t + 2.0**32, t)


def _bias_corrections(iterations, dtype, bias_dtype, hparams):
    """Both bias corrections of the step after ``iterations``, cast to ``dtype``.

    Computed in ``bias_dtype``, with :func:`qhoptim.rules.bias_correction`'s
    float32 policy (``expm1``) in float32.
    """
    t = _step_number(iterations, bias_dtype)
    expm1 = ops.expm1 if bias_dtype == "float32" else None
    bc1 = rules.bias_correction(hparams["beta1"], t, expm1=expm1)
    bc2 = rules.bias_correction(hparams["beta2"], t, expm1=expm1)
    return {"bias_correction1": ops.cast(bc1, dtype), "bias_correction2": ops.cast(bc2, dtype)}


def _qhadam_step(grad, lr, iterations, exp_avg, exp_avg_sq, param, *, bias_dtype, **hparams):
    """One QHAdam step of one variable, from :mod:`qhoptim.rules`: ``(exp_avg, exp_avg_sq, param)``.

    ``iterations`` counts the steps already taken (see :func:`_bias_corrections`).
    """
    dtype = param.dtype
    lr = ops.cast(lr, dtype)
    weight_decay = hparams.pop("weight_decay")
    exp_avg, exp_avg_sq, update = rules.qhadam_update(
        grad,
        exp_avg,
        exp_avg_sq,
        sqrt=ops.sqrt,
        **_bias_corrections(iterations, dtype, bias_dtype, hparams),
        **hparams,
    )
    return exp_avg, exp_avg_sq, _new_value(param, update, lr, weight_decay)


def _maximum(x, y):
    """The element-wise maximum of AMSGrad (NaN if either is NaN), in the inputs' dtype.

    ``keras.ops.maximum`` on the torch backend computes float64 tensors in
    float32 (seen with Keras 3.15), so there the step takes ``torch.maximum``
    itself.
    """
    if _BACKEND == "torch":
        import torch

        return torch.maximum(x, y)
    return ops.maximum(x, y)


def _qhadam_amsgrad_step(
    grad, lr, iterations, exp_avg, exp_avg_sq, max_exp_avg_sq, param, *, bias_dtype, **hparams
):
    """One step of QHAdam's AMSGrad variant (:func:`qhoptim.rules.qhadam_amsgrad_update`).

    Returns ``(exp_avg, exp_avg_sq, max_exp_avg_sq, param)``; as :func:`_qhadam_step`.
    """
    dtype = param.dtype
    lr = ops.cast(lr, dtype)
    weight_decay = hparams.pop("weight_decay")
    exp_avg, exp_avg_sq, max_exp_avg_sq, update = rules.qhadam_amsgrad_update(
        grad,
        exp_avg,
        exp_avg_sq,
        max_exp_avg_sq,
        sqrt=ops.sqrt,
        maximum=_maximum,
        **_bias_corrections(iterations, dtype, bias_dtype, hparams),
        **hparams,
    )
    return exp_avg, exp_avg_sq, max_exp_avg_sq, _new_value(param, update, lr, weight_decay)


# ------------------------------------------------------------- narrow state
# Unsigned 32-bit arithmetic of the TensorFlow and JAX backends (their uint32
# tensors wrap); constants are made as uint32 tensors, which JAX requires above
# 2**31 - 1. On torch, the rounding is qhoptim.torch's (Python-int seeds).
_BITS = rounding.Bits(
    const=lambda c: ops.convert_to_tensor(c, "uint32"),
    shift=lambda x, n: ops.right_shift(x, ops.convert_to_tensor(n, "uint32")),
)


def _state_dtype_name(state_dtype: Any) -> str | None:
    """Keras's name of ``state_dtype`` (``"bfloat16"``, ...), None if it names no dtype."""
    try:
        return str(keras.backend.standardize_dtype(state_dtype))
    except (ValueError, TypeError):
        return None


def _itemsize(name: str) -> int:
    """Bytes per value of the dtype Keras names ``name`` (``"bfloat16"``: 2)."""
    digits = "".join(c for c in name if c.isdigit())
    return int(digits) // 8 if digits else 1


def _state_seed(iterations: Any, first: Any, k: int) -> Any:
    """The rounding seed (:func:`qhoptim.rounding.rounding_seed`) of state
    ``first + k`` in the step after ``iterations`` -- a Python int on torch
    (eager), a uint32 tensor on TensorFlow and JAX (traced)."""
    if _BACKEND == "torch":
        return rounding.rounding_seed((int(iterations) + 1) & rounding.MASK32, int(first) + k)
    step = ops.cast(iterations, "uint32") + _BITS.const(1)
    return rounding.rounding_seed(step, first + _BITS.const(k), _BITS)


def _bitcast(x: Any, dtype: str) -> Any:
    """``x``'s bits as ``dtype`` (of the same width); ``keras.ops.view`` is newer
    than Keras 3.10."""
    if _BACKEND == "jax":
        import jax

        return jax.lax.bitcast_convert_type(x, dtype)
    return ops.view(x, dtype)


def _store(value: Any, dtype: str, seed: Any) -> Any:
    """A step's new state in the slot's ``dtype``: with a ``seed``, rounded to
    bfloat16 stochastically (:mod:`qhoptim.rounding`), else cast (to nearest)."""
    if seed is None:
        return ops.cast(value, dtype)
    if _BACKEND == "torch":
        import torch

        from qhoptim.torch import _state_dtype

        out = torch.empty(value.shape, dtype=torch.bfloat16, device=value.device)
        _state_dtype.stochastic_round_(out, value, seed)
        return out
    x = ops.cast(value, "float32")
    if _BACKEND == "tensorflow":
        import tensorflow as tf

        # Its step is traced for shapes unknown until XLA compiles it (Keras's
        # ops want a known rank), and XLA has no uint32 range.
        positions = tf.reshape(tf.cast(tf.range(tf.size(x)), tf.uint32), tf.shape(x))
        bitcast = tf.bitcast
    else:
        positions = ops.reshape(ops.arange(ops.size(x), dtype="uint32"), ops.shape(x))
        bitcast = _bitcast
    noise = rounding.noise16(positions, seed, _BITS)
    bits = rounding.round_bits(bitcast(x, "uint32"), noise, _BITS)
    return ops.cast(bitcast(bits, "float32"), "bfloat16")


@functools.cache
def _with_narrow_state(step: Any) -> Any:
    """``step`` for slots stored narrower than their variable: the slots are
    read in the variable's dtype, the rule runs there, and the new slots are
    stored back (:func:`_store`). Its inputs gain the optimizer's
    ``iterations`` and the variable's first state index (``4 * position``);
    one function per rule, so that compiled steps are reused."""

    def narrow_step(
        *args: Any, state_dtype: str, stochastic: bool, slots: int, **hparams: Any
    ) -> tuple[Any, ...]:
        *inputs, iterations, first = args[: -(slots + 1)]
        stored, param = args[-(slots + 1) : -1], args[-1]
        working = [ops.cast(s, param.dtype) for s in stored]
        *new_slots, new_param = step(*inputs, *working, param, **hparams)
        out = []
        for k, value in enumerate(new_slots):
            seed = _state_seed(iterations, first, k) if stochastic else None
            out.append(_store(value, state_dtype, seed))
        return (*out, new_param)

    return narrow_step


# ---------------------------------------------------------------------- plumbing
def _float(value: Any) -> Any:
    """Concrete real numbers as Python floats (JSON-serializable config); others as given.

    Concrete scalars -- 0-d or one-element arrays and tensors of any framework
    whose value is known -- included: a float64 ``tf.constant`` would otherwise
    meet the float32 step count in ``Pow``, and a JAX array would be checked
    only when the step fails. Variables (meant to change) stay variables.
    """
    x = validation.concrete_float(value)
    return value if x is None else x


def _learning_rate(value: Any) -> Any:
    # Keras accepts only Python floats (plus schedules and callables); an int
    # learning rate (``learning_rate=1``) is taken as the float it means --
    # after the check, so that an error shows the value as it was typed.
    # A concrete scalar (a one-element NumPy/JAX/TF/torch array) is read as the
    # float it holds, as every other hyperparameter is (:func:`_float`).
    validation.check_lr(value, "learning_rate")
    if callable(value):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return validation.as_float(value)


def _doc(cls: type) -> type:
    if cls.__doc__ is not None:
        cls.__doc__ = cls.__doc__.replace("{{base_optimizer_keyword_args}}", _BASE_ARGS)
    return cls


class _PerVariableStep(keras.optimizers.Optimizer):  # type: ignore[misc]
    """Backend-neutral plumbing: running one variable's step, decoupled weight decay.

    The backend's mixin (``_BackendStep``) comes before this class in the MRO
    of :class:`_QHOptimizer`: it may override the step hooks ``_dense``,
    ``_read`` and ``_step_variable`` (falling back here through ``super()``)
    and Keras's ``_backend_update_step``.
    """

    #: Which rule ``update_step`` runs, for backends with whole-list kernels.
    _RULE: str

    #: The slots' dtype (Keras's name) and rounding; see :meth:`_set_state_dtype`.
    state_dtype: str | None = None
    stochastic_rounding: bool | None = None
    _building_slots = False

    def _set_state_dtype(self, state_dtype: Any, stochastic_rounding: Any) -> None:
        """Check and keep ``state_dtype`` and ``stochastic_rounding``."""
        name = None if state_dtype is None else _state_dtype_name(state_dtype)
        rounding.check_state_dtype(name, state_dtype, allowed=rounding.STATE_DTYPES)
        rounding.check_stochastic_rounding(stochastic_rounding)
        self.state_dtype, self.stochastic_rounding = name, stochastic_rounding

    def _add_slots(self, var_list: Any, names: Any) -> Any:
        """``add_optimizer_variables``, the slots in ``state_dtype`` if one is set."""
        self._building_slots = True
        try:
            return self.add_optimizer_variables(var_list, names)
        finally:
            self._building_slots = False

    def add_variable(
        self,
        shape: Any,
        initializer: Any = "zeros",
        dtype: Any = None,
        aggregation: str = "none",
        **kwargs: Any,
    ) -> Any:
        """Keras's ``add_variable``; a slot being built takes ``state_dtype``."""
        if self._building_slots and self.state_dtype is not None and dtype is not None:
            param = _state_dtype_name(dtype) or str(dtype)
            rounding.check_real(param.startswith("complex"))
            rounding.check_narrower(
                self.state_dtype, _itemsize(self.state_dtype), param, _itemsize(param)
            )
            dtype = self.state_dtype
        return super().add_variable(shape, initializer, dtype, aggregation, **kwargs)

    def _state_config(self) -> dict[str, Any]:
        """The config entries of a narrow state (none without one: configs stay
        loadable by versions before ``state_dtype``)."""
        if self.state_dtype is None and self.stochastic_rounding is None:
            return {}
        return {"state_dtype": self.state_dtype, "stochastic_rounding": self.stochastic_rounding}

    def _narrow(self, variable: Any) -> bool:
        """Whether ``variable``'s slots are stored narrower than it."""
        return self.state_dtype is not None and self.state_dtype != _state_dtype_name(
            variable.dtype
        )

    def _apply_weight_decay(self, variables: Any) -> None:
        # Decoupled decay is part of each variable's step (``_new_value``, i.e.
        # ``rules.apply_update``): same math as Keras's separate pass, one pass less.
        return

    #: The store key under which :meth:`save_own_variables` records which slots
    #: the optimizer keeps (:meth:`_layout`), so that a store of another QH
    #: optimizer whose shapes happen to fit is not loaded.
    _LAYOUT_KEY = "qhoptim_layout"

    def _layout(self) -> int:
        """The slots kept per model variable: 1 (QHM), 2 (QHAdam), 3 (QHAdam with amsgrad)."""
        raise NotImplementedError

    def save_own_variables(self, store: Any) -> None:
        """Save the optimizer's variables (Keras's), and which slots they are."""
        super().save_own_variables(store)
        import numpy as np

        store[self._LAYOUT_KEY] = np.array([self._layout()], dtype="int64")

    def load_own_variables(self, store: Any) -> None:
        """Load the optimizer's variables (``.keras`` files), all or none.

        The whole store is checked before any variable is assigned: the
        optimizer it was saved from (stores saved by this version record their
        slots), the number of variables, and each value's shape and numeric
        type. A store saved from another model or optimizer raises
        ``ValueError`` and leaves the state as it was (Keras alone warns on a
        count mismatch and loads nothing, and assigns until the first mismatch).
        """
        import numpy as np

        name = type(self).__name__
        keys = {str(k) for k in store.keys()}
        if self._LAYOUT_KEY in keys:
            saved = np.asarray(store[self._LAYOUT_KEY]).ravel()
            kinds = {
                1: "QHM's (momentum)",
                2: "QHAdam's (momentum, velocity)",
                3: ("QHAdam's with amsgrad (momentum, velocity, velocity_hat)"),
            }
            if saved.tolist() != [self._layout()]:
                got = kinds.get(saved.tolist()[0], repr(saved.tolist())) if saved.size else saved
                raise ValueError(
                    f"{name} cannot load these variables: they are {got} slots, "
                    f"this optimizer keeps {kinds[self._layout()]}"
                )
            keys.discard(self._LAYOUT_KEY)
        if len(keys) != len(self.variables):
            hint = (
                " (is the optimizer built? it builds on its first step, or with "
                "optimizer.build(model.trainable_variables))"
                if not self.built
                else ""
            )
            raise ValueError(
                f"{name} cannot load a store of {len(keys)} variables: it has "
                f"{len(self.variables)}{hint}; was it saved from another model or optimizer?"
            )
        values = []
        for i, variable in enumerate(self.variables):
            if str(i) not in keys:
                raise ValueError(f"{name} cannot load its variable {i}: the store has no entry {i}")
            try:
                value = np.asarray(store[str(i)])
            except (TypeError, ValueError) as error:
                raise ValueError(
                    f"{name} cannot load its variable {i} ({variable.path}): {error}"
                ) from error
            if value.dtype.kind not in "biuf" and value.dtype.name != "bfloat16":
                raise ValueError(
                    f"{name} cannot load its variable {i} ({variable.path}): saved with "
                    f"dtype {value.dtype}, not a number"
                )
            if tuple(value.shape) != tuple(variable.shape):
                raise ValueError(
                    f"{name} cannot load its variable {i} ({variable.path}): "
                    f"saved with shape {tuple(value.shape)}, it has {tuple(variable.shape)}"
                )
            values.append(value)
        for variable, value in zip(self.variables, values, strict=True):
            variable.assign(value)

    def _weight_decay_for(self, variable: Any) -> Any:
        """The decoupled weight decay of ``variable``: a float, or None for none."""
        wd = self.weight_decay
        if wd is None or validation.concrete_float(wd) == 0.0:
            return None
        return wd if self._use_weight_decay(variable) else None

    def _hyperparameters(self) -> dict[str, Any]:
        """The rule's hyperparameters, under :mod:`qhoptim.rules`'s names."""
        raise NotImplementedError

    def _slots(self, index: int) -> list[Any]:
        """The slot variables of model variable ``index``, in the order the step takes them."""
        raise NotImplementedError

    def _run_step(
        self, step: Any, inputs: list[Any], state: list[Any], position: int, **hparams: Any
    ) -> None:
        """``state <- step(*inputs, *state, **hparams)`` for one model variable (``state[-1]``),
        the ``position``-th of the optimizer.

        ``inputs[0]`` is the gradient; the other inputs are scalars (learning
        rate, step count). ``hparams`` are Python values. Slots stored
        narrower than the variable (``state_dtype``) step through
        :func:`_with_narrow_state`, seeded by ``iterations`` and ``position``.
        """
        dtype = state[-1].dtype
        gradient = self._dense(ops.cast(inputs[0], dtype))
        inputs = [gradient, *(_scalar_input(x, dtype) for x in inputs[1:])]
        if self._narrow(state[-1]):
            step = _with_narrow_state(step)
            first = ops.convert_to_tensor(4 * position, "uint32")
            inputs = [*inputs, self.iterations, first]
            hparams = dict(
                hparams,
                state_dtype=self.state_dtype,
                stochastic=rounding.stochastic(self.state_dtype, self.stochastic_rounding),
                slots=len(state) - 1,
            )
        self._step_variable(step, inputs, state, hparams)

    # The step hooks (see the class docstring).
    def _dense(self, gradient: Any) -> Any:
        """A sparse gradient (JAX's ``BCOO``) as a dense tensor; dense ones as they are.

        QHM and QHAdam decay their buffers at *every* row on every step, so a
        sparse gradient is the dense gradient with zero rows, as for Keras's
        own ``SGD`` and ``Adam`` (which densify it too, mixing it with a buffer).
        """
        return ops.convert_to_tensor(gradient, sparse=False)

    def _read(self, x: Any) -> Any:
        """The value of a variable (or a tensor as is); on JAX it honours ``stateless_apply``."""
        return x.value if isinstance(x, keras.Variable) else x

    def _step_variable(
        self, step: Any, inputs: list[Any], state: list[Any], hparams: dict[str, Any]
    ) -> None:
        """Evaluate ``step`` with the backend's ops; write the state through ``self.assign``."""
        values = step(*map(self._read, inputs), *map(self._read, state), **hparams)
        for variable, value in zip(state, values, strict=True):
            self.assign(variable, value)


# The active backend's step (see the module's docstring); its module is imported
# only when that backend is active.
_BackendStep: Any
if _BACKEND == "tensorflow":
    from qhoptim.keras._tensorflow import TensorFlowStep as _BackendStep
elif _BACKEND == "torch":
    from qhoptim.keras._torch import TorchStep as _BackendStep
else:

    class _BackendStep:  # type: ignore[no-redef]
        """JAX and Keras's other backends: ``update_step`` as written (``jax.jit`` fuses it)."""


class _QHOptimizer(_BackendStep, _PerVariableStep):  # type: ignore[misc]
    """The shared base class: the backend-neutral plumbing, under the active backend's step."""


# ------------------------------------------------------------------------- QHM
@keras.saving.register_keras_serializable(package="qhoptim")
@_doc
class QHM(_QHOptimizer):
    r"""Optimizer that implements quasi-hyperbolic momentum (QHM).

    QHM averages a plain SGD step and a momentum step, with a *normalized*
    momentum buffer :math:`g` (an average of past gradients):

    .. math::

        g_{t+1} &= \beta g_t + (1 - \beta) \nabla_t \\
        \theta_{t+1} &= \theta_t - \alpha \left[(1 - \nu) \nabla_t + \nu g_{t+1}\right]

    with :math:`\alpha` = ``learning_rate``, :math:`\beta` = ``momentum`` and
    :math:`\nu` = ``nu``. ``nu=0`` is SGD, ``nu=1`` is momentum and
    ``nu=momentum`` is Nesterov's accelerated gradient; the paper's rule of
    thumb is ``nu=0.7, momentum=0.999``.

    Because the buffer is normalized, Keras's ``SGD(learning_rate=lr,
    momentum=beta)`` (an unnormalized velocity, like torch's) corresponds to
    ``QHM(learning_rate=lr / (1 - beta), momentum=beta, nu=1.0)``, and
    ``nesterov=True`` to ``nu=beta``; ``QHM.from_params(
    qhoptim.convert.from_nesterov(lr, beta))`` does the conversion. For that
    reason ``learning_rate`` has no default; by name (``"qhm"``), where none
    can be passed, it is 0.01 (:attr:`NAMED_LEARNING_RATE`).

    Args:
        learning_rate: A float, a
            `keras.optimizers.schedules.LearningRateSchedule` instance, or
            a callable that takes no arguments and returns the actual value to
            use. The learning rate :math:`\alpha`. Required.
        momentum: Float in ``[0, 1)``. :math:`\beta`, the discount factor of
            the normalized momentum buffer. Defaults to `0.999`.
        nu: Float. :math:`\nu`, the immediate discount factor (any finite
            real; conversions from other algorithms may give values outside
            ``[0, 1]``). Defaults to `0.7`.
        {{base_optimizer_keyword_args}}
        state_dtype: String (keyword only). Store the momentum slot in this
            dtype, e.g. ``"bfloat16"`` (half a float32 model's slot memory);
            the step runs in the variable's dtype and writes the slot back
            with ``qhoptim.rounding``'s stochastic rounding. Defaults to
            `None` (the variable's dtype).
        stochastic_rounding: Boolean or `None` (keyword only). With
            ``state_dtype``: `None` rounds bfloat16 stochastically, `False`
            to nearest. Defaults to `None`.

    Note: ``weight_decay`` is Keras's decoupled weight decay
    (:math:`\theta \leftarrow \theta (1 - \alpha\lambda)` before the step), as
    for every Keras optimizer; ``qhoptim.torch.QHM`` defaults to coupled (L2)
    decay instead, which Keras expresses with
    ``kernel_regularizer=keras.regularizers.L2(weight_decay / 2)``.

    Reference:
        - [Ma & Yarats, 2019](https://arxiv.org/abs/1810.06801), section 3.
    """

    _RULE = "qhm"

    def __init__(
        self,
        learning_rate,
        momentum=0.999,
        nu=0.7,
        weight_decay=None,
        clipnorm=None,
        clipvalue=None,
        global_clipnorm=None,
        use_ema=False,
        ema_momentum=0.99,
        ema_overwrite_frequency=None,
        loss_scale_factor=None,
        gradient_accumulation_steps=None,
        name=None,
        *,
        state_dtype=None,
        stochastic_rounding=None,
        **kwargs,
    ):
        learning_rate = _learning_rate(learning_rate)
        validation.check_qhm(
            lr=learning_rate,
            momentum=momentum,
            nu=nu,
            weight_decay=0.0 if weight_decay is None else weight_decay,
            names={"lr": "learning_rate"},
        )
        super().__init__(
            learning_rate=learning_rate,
            name=name,
            weight_decay=_float(weight_decay),
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
            use_ema=use_ema,
            ema_momentum=ema_momentum,
            ema_overwrite_frequency=ema_overwrite_frequency,
            loss_scale_factor=loss_scale_factor,
            gradient_accumulation_steps=gradient_accumulation_steps,
            **kwargs,
        )
        self.momentum = _float(momentum)
        self.nu = _float(nu)
        self._set_state_dtype(state_dtype, stochastic_rounding)

    @classmethod
    def from_params(cls, params, **kwargs):
        """Build from :class:`qhoptim.convert.QHMParams`, e.g. a conversion's result.

        ``QHM.from_params(qhoptim.convert.from_nesterov(lr=0.01, momentum=0.9))``
        is Keras's ``SGD(0.01, momentum=0.9, nesterov=True)``. Keyword
        arguments (``weight_decay``, ``clipnorm``, ...) are passed to the
        constructor.
        """
        if not isinstance(params, convert.QHMParams):
            raise TypeError(
                f"{cls.__name__}.from_params expects qhoptim.convert.QHMParams; "
                f"received {type(params).__name__}"
            )
        return cls(learning_rate=params.lr, momentum=params.momentum, nu=params.nu, **kwargs)

    def build(self, var_list):
        """Initialize optimizer variables: one normalized momentum buffer per variable.

        Args:
            var_list: list of model variables to build QHM variables on.
        """
        if self.built:
            return
        super().build(var_list)
        self._momentums = self._add_slots(var_list, "momentum")

    def _layout(self):
        return 1

    def _hyperparameters(self):
        return {"momentum": self.momentum, "nu": self.nu}

    def _slots(self, index):
        return [self._momentums[index]]

    def update_step(self, gradient, variable, learning_rate):
        """Update step given gradient and the associated model variable."""
        index = self._get_variable_index(variable)
        self._run_step(
            _qhm_step,
            [gradient, learning_rate],
            [*self._slots(index), variable],
            index,
            weight_decay=self._weight_decay_for(variable),
            **self._hyperparameters(),
        )

    def get_config(self):
        config = super().get_config()
        config.update({"momentum": self.momentum, "nu": self.nu, **self._state_config()})
        return config

    #: The learning rate of ``QHM`` built by name (``"qhm"``), where there is no
    #: argument to pass it: Keras's ``"sgd"`` default, ``SGD(0.01)`` without
    #: momentum, whose step on a constant gradient QHM's normalized buffer
    #: reaches with the same number.
    NAMED_LEARNING_RATE = 0.01

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """The optimizer of ``config``; a config without ``learning_rate`` -- what
        ``keras.optimizers.get("qhm")`` and ``compile(optimizer="qhm")`` pass --
        takes :attr:`NAMED_LEARNING_RATE`. Saved configs always hold one."""
        if "learning_rate" not in config:
            config = {**config, "learning_rate": cls.NAMED_LEARNING_RATE}
        return super().from_config(config, custom_objects=custom_objects)


# ---------------------------------------------------------------------- QHAdam
_QHADAM_NAMES = {
    "lr": "learning_rate",
    "beta1": "beta_1",
    "beta2": "beta_2",
    "nu1": "nu_1",
    "nu2": "nu_2",
    "eps": "epsilon",
}


@keras.saving.register_keras_serializable(package="qhoptim")
@_doc
class QHAdam(_QHOptimizer):
    r"""Optimizer that implements QHAdam (quasi-hyperbolic Adam).

    QHAdam replaces both of Adam's moment estimates by quasi-hyperbolic
    averages of the estimate and the current gradient:

    .. math::

        g_{t+1} &= \beta_1 g_t + (1 - \beta_1) \nabla_t, \quad
        g'_{t+1} = g_{t+1} / (1 - \beta_1^{t+1}) \\
        s_{t+1} &= \beta_2 s_t + (1 - \beta_2) \nabla_t^2, \quad
        s'_{t+1} = s_{t+1} / (1 - \beta_2^{t+1}) \\
        \theta_{t+1} &= \theta_t - \alpha \,
          \frac{(1 - \nu_1) \nabla_t + \nu_1 g'_{t+1}}
               {\sqrt{(1 - \nu_2) \nabla_t^2 + \nu_2 s'_{t+1}} + \epsilon}

    with :math:`\alpha` = ``learning_rate``, :math:`\beta_{1,2}` =
    ``beta_1, beta_2``, :math:`\nu_{1,2}` = ``nu_1, nu_2`` and :math:`\epsilon`
    = ``epsilon``. ``nu_1 = nu_2 = 1`` is Adam (the paper's suggestion is
    ``nu_1=0.7, nu_2=1.0, beta_1=0.995, beta_2=0.999``).

    Note on ``epsilon``: as in the paper and in Kingma & Ba's Algorithm 1,
    :math:`\epsilon` is added *after* bias correction. Keras's ``Adam`` adds
    its ``epsilon`` ("epsilon hat") to the *uncorrected* :math:`\sqrt{s}`,
    which equals this rule with :math:`\epsilon_t = \hat\epsilon /
    \sqrt{1 - \beta_2^t}`; the two agree as :math:`\epsilon \to 0`.

    Args:
        learning_rate: A float, a
            `keras.optimizers.schedules.LearningRateSchedule` instance, or
            a callable that takes no arguments and returns the actual value to
            use. The learning rate. Defaults to `0.001`.
        beta_1: Float in ``[0, 1)``. The exponential decay rate of the first
            moment estimate. Defaults to `0.9`.
        beta_2: Float in ``[0, 1)``. The exponential decay rate of the second
            moment estimate. Defaults to `0.999`.
        nu_1: Float. Immediate discount factor of the first moment (any finite
            real). Defaults to `1.0`.
        nu_2: Float in ``[0, 1]``. Immediate discount factor of the second
            moment; values below 1 mix the current squared gradient into the
            denominator, which lowers the worst-case step only near the optimum
            of ``qhoptim.analysis.qhadam_bound_optimal_nu2`` (mostly together with
            ``nu_1 < 1``). Defaults to `1.0`.
        epsilon: Float ``>= 0`` added to the denominator after the square root
            and bias correction. Defaults to `1e-8`.
        {{base_optimizer_keyword_args}}
        amsgrad: Boolean (keyword only). Whether to apply the AMSGrad variant
            (the paper's "analogously modified" QHAdam), as Keras's ``Adam``:
            the running maximum of the second moment (slot ``velocity_hat``)
            takes its place in the denominator, bias-corrected by the current
            step. Defaults to `False`.
        state_dtype: String (keyword only). Store the slots in this dtype,
            e.g. ``"bfloat16"``: 4 bytes per float32 parameter instead of 8,
            rounded stochastically as :class:`QHM`'s. Defaults to `None`.
        stochastic_rounding: Boolean or `None` (keyword only), as
            :class:`QHM`'s. Defaults to `None`.

    Reference:
        - [Ma & Yarats, 2019](https://arxiv.org/abs/1810.06801), section 5.
    """

    _RULE = "qhadam"

    def __init__(
        self,
        learning_rate=0.001,
        beta_1=0.9,
        beta_2=0.999,
        nu_1=1.0,
        nu_2=1.0,
        epsilon=1e-8,
        weight_decay=None,
        clipnorm=None,
        clipvalue=None,
        global_clipnorm=None,
        use_ema=False,
        ema_momentum=0.99,
        ema_overwrite_frequency=None,
        loss_scale_factor=None,
        gradient_accumulation_steps=None,
        name=None,
        *,
        amsgrad=False,
        state_dtype=None,
        stochastic_rounding=None,
        **kwargs,
    ):
        learning_rate = _learning_rate(learning_rate)
        validation.check_bool(amsgrad, "amsgrad")
        validation.check_qhadam(
            lr=learning_rate,
            beta1=beta_1,
            beta2=beta_2,
            nu1=nu_1,
            nu2=nu_2,
            eps=epsilon,
            weight_decay=0.0 if weight_decay is None else weight_decay,
            names=_QHADAM_NAMES,
        )
        super().__init__(
            learning_rate=learning_rate,
            name=name,
            weight_decay=_float(weight_decay),
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
            use_ema=use_ema,
            ema_momentum=ema_momentum,
            ema_overwrite_frequency=ema_overwrite_frequency,
            loss_scale_factor=loss_scale_factor,
            gradient_accumulation_steps=gradient_accumulation_steps,
            **kwargs,
        )
        self.beta_1 = _float(beta_1)
        self.beta_2 = _float(beta_2)
        self.nu_1 = _float(nu_1)
        self.nu_2 = _float(nu_2)
        self.epsilon = _float(epsilon)
        self.amsgrad = amsgrad
        self._set_state_dtype(state_dtype, stochastic_rounding)

    @classmethod
    def from_params(cls, params, **kwargs):
        """Build from :class:`qhoptim.convert.QHAdamParams`, e.g. a conversion's result.

        ``QHAdam.from_params(qhoptim.convert.from_nadam(1e-3, (0.9, 0.999), 1e-8))``
        is NAdam modulo bias correction. Keyword arguments (``weight_decay``,
        ``clipnorm``, ...) are passed to the constructor.
        """
        if not isinstance(params, convert.QHAdamParams):
            raise TypeError(
                f"{cls.__name__}.from_params expects qhoptim.convert.QHAdamParams; "
                f"received {type(params).__name__}"
            )
        (beta_1, beta_2), (nu_1, nu_2) = params.betas, params.nus
        return cls(
            learning_rate=params.lr,
            beta_1=beta_1,
            beta_2=beta_2,
            nu_1=nu_1,
            nu_2=nu_2,
            epsilon=params.eps,
            **kwargs,
        )

    def build(self, var_list):
        """Initialize optimizer variables: the two moment estimates per variable,
        and with ``amsgrad`` the running maximum of the second (``velocity_hat``,
        as Keras's ``Adam``).

        Args:
            var_list: list of model variables to build QHAdam variables on.
        """
        if self.built:
            return
        super().build(var_list)
        self._momentums, self._velocities = self._add_slots(var_list, ["momentum", "velocity"])
        if self.amsgrad:
            self._velocity_hats = self._add_slots(var_list, "velocity_hat")

    def _layout(self):
        return 3 if self.amsgrad else 2

    def _hyperparameters(self):
        return {
            "beta1": self.beta_1,
            "beta2": self.beta_2,
            "nu1": self.nu_1,
            "nu2": self.nu_2,
            "eps": self.epsilon,
        }

    def _slots(self, index):
        slots = [self._momentums[index], self._velocities[index]]
        return [*slots, self._velocity_hats[index]] if self.amsgrad else slots

    def update_step(self, gradient, variable, learning_rate):
        """Update step given gradient and the associated model variable."""
        index = self._get_variable_index(variable)
        self._run_step(
            _qhadam_amsgrad_step if self.amsgrad else _qhadam_step,
            [gradient, learning_rate, self.iterations],
            [*self._slots(index), variable],
            index,
            weight_decay=self._weight_decay_for(variable),
            bias_dtype=_bias_correction_dtype(),
            **self._hyperparameters(),
        )

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "beta_1": self.beta_1,
                "beta_2": self.beta_2,
                "nu_1": self.nu_1,
                "nu_2": self.nu_2,
                "epsilon": self.epsilon,
                "amsgrad": self.amsgrad,
                **self._state_config(),
            }
        )
        return config


# --------------------------------------------------------------------- QHAdamW
@keras.saving.register_keras_serializable(package="qhoptim")
@_doc
class QHAdamW(QHAdam):
    r"""QHAdam with decoupled weight decay, as Keras's ``AdamW`` is Adam with it.

    Before each step the variable is multiplied by :math:`1 - \alpha\lambda`
    (:math:`\lambda` = ``weight_decay``), in the same pass as the QHAdam
    update. ``QHAdamW(weight_decay=wd, ...)`` is ``QHAdam(weight_decay=wd, ...)``
    with a non-zero default, ``0.004`` -- Keras's ``AdamW`` default (torch's
    ``AdamW`` and ``qhoptim.torch.QHAdamW`` default to ``0.01``).

    Args:
        learning_rate: A float, a
            `keras.optimizers.schedules.LearningRateSchedule` instance, or
            a callable that takes no arguments and returns the actual value to
            use. The learning rate. Defaults to `0.001`.
        weight_decay: Float ``>= 0``. The decoupled weight decay
            :math:`\lambda`. Defaults to `0.004`.
        beta_1: Float in ``[0, 1)``. Defaults to `0.9`.
        beta_2: Float in ``[0, 1)``. Defaults to `0.999`.
        nu_1: Float. Immediate discount factor of the first moment. Defaults to `1.0`.
        nu_2: Float in ``[0, 1]``. Immediate discount factor of the second
            moment. Defaults to `1.0`.
        epsilon: Float ``>= 0`` added to the denominator after the square root
            and bias correction. Defaults to `1e-8`.
        {{base_optimizer_keyword_args}}
        amsgrad: Boolean (keyword only). The AMSGrad variant, as in
            :class:`QHAdam`. Defaults to `False`.
        state_dtype, stochastic_rounding: keyword only, as in :class:`QHAdam`.

    References:
        - [Ma & Yarats, 2019](https://arxiv.org/abs/1810.06801), section 5.
        - [Loshchilov & Hutter, 2019](https://arxiv.org/abs/1711.05101).
    """

    def __init__(
        self,
        learning_rate=0.001,
        weight_decay=0.004,
        beta_1=0.9,
        beta_2=0.999,
        nu_1=1.0,
        nu_2=1.0,
        epsilon=1e-8,
        clipnorm=None,
        clipvalue=None,
        global_clipnorm=None,
        use_ema=False,
        ema_momentum=0.99,
        ema_overwrite_frequency=None,
        loss_scale_factor=None,
        gradient_accumulation_steps=None,
        name=None,
        *,
        amsgrad=False,
        state_dtype=None,
        stochastic_rounding=None,
        **kwargs,
    ):
        # None means "no decay" for QHAdam (Keras's convention); QHAdamW is the
        # decay, so None is not a number here, in the sentence of every backend.
        validation.check_weight_decay(weight_decay, "weight_decay")
        super().__init__(
            learning_rate=learning_rate,
            beta_1=beta_1,
            beta_2=beta_2,
            nu_1=nu_1,
            nu_2=nu_2,
            epsilon=epsilon,
            weight_decay=weight_decay,
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
            use_ema=use_ema,
            ema_momentum=ema_momentum,
            ema_overwrite_frequency=ema_overwrite_frequency,
            loss_scale_factor=loss_scale_factor,
            gradient_accumulation_steps=gradient_accumulation_steps,
            name=name,
            amsgrad=amsgrad,
            state_dtype=state_dtype,
            stochastic_rounding=stochastic_rounding,
            **kwargs,
        )


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
}


def _register_names(custom_objects: dict[str, Any]) -> None:
    """Add :data:`NAMES` to Keras's global custom objects, where ``keras.optimizers.get``
    looks a string up; a name the user registered first is left as it is."""
    for name, cls in NAMES.items():
        custom_objects.setdefault(name, cls)


_register_names(keras.saving.get_custom_objects())
