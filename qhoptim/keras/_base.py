"""The base class of :mod:`qhoptim.keras`'s optimizers.

Backend-neutral plumbing (``_PerVariableStep``): running one variable's step
(:mod:`qhoptim.keras._step`), narrow slots (:mod:`qhoptim.keras._narrow`),
decoupled weight decay, the checks of ``save_own_variables`` /
``load_own_variables``; under it, in the MRO of :class:`QHOptimizer`, the
active backend's step (``_tensorflow.py``, ``_torch.py``), imported only on
that backend.
"""

from __future__ import annotations

import warnings
from typing import Any

import keras
from keras import ops

from qhoptim import rounding, validation
from qhoptim.keras import _narrow
from qhoptim.keras._settings import BACKEND
from qhoptim.keras._step import (
    TENSOR_HYPERPARAMETER,
    apply_step,
    scalar_input,
    with_tensor_hyperparameters,
)

try:  # the text Keras's own optimizers substitute for {{base_optimizer_keyword_args}}
    from keras.src.optimizers.optimizer import base_optimizer_keyword_args as _BASE_ARGS
except ImportError:  # pragma: no cover - keras moved its private module
    _BASE_ARGS = "name, weight_decay, clipnorm, clipvalue, global_clipnorm, use_ema, ..."


def _is_tensor(value: Any) -> bool:
    """A hyperparameter held as a ``keras.Variable`` or a backend tensor, not a number."""
    return isinstance(value, keras.Variable) or ops.is_tensor(value)


def as_float(value: Any) -> Any:
    """Concrete real numbers as Python floats (JSON-serializable config); others as given.

    Concrete scalars -- 0-d or one-element arrays and tensors of any framework
    whose value is known -- included: a float64 ``tf.constant`` would otherwise
    meet the float32 step count in ``Pow``, and a JAX array would be checked
    only when the step fails. Variables (meant to change) stay variables.
    """
    x = validation.concrete_float(value)
    return value if x is None else x


def hyperparameter_value(value: Any) -> Any:
    """A hyperparameter as a step reads it: a zero-argument callable's value
    (Keras's optimizers take ``beta_1=lambda: 0.9``, called at each step), any
    other as it is."""
    return value() if callable(value) else value


def learning_rate_value(value: Any) -> Any:
    # Keras accepts only Python floats (plus schedules and callables); an int
    # learning rate (``learning_rate=1``) is taken as the float it means --
    # after the check, so that an error shows the value as it was typed.
    # A concrete scalar (a one-element NumPy/JAX/TF/torch array) is read as the
    # float it holds, as every other hyperparameter is (:func:`as_float`).
    validation.check_lr(value, "learning_rate")
    if callable(value):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return validation.as_float(value)


def documented(cls: type) -> type:
    """``cls`` with Keras's base keyword arguments in its docstring."""
    if cls.__doc__ is not None:
        cls.__doc__ = cls.__doc__.replace("{{base_optimizer_keyword_args}}", _BASE_ARGS)
    return cls


class CheckedLearningRate:
    """``learning_rate`` set after construction -- by a callback such as
    ``LearningRateScheduler`` or ``ReduceLROnPlateau``, or by hand -- checked
    as the constructor checks it: Keras's optimizers take a negative value and
    step uphill. Schedules, callables and variables pass as Keras takes them."""

    @property
    def learning_rate(self) -> Any:
        return keras.optimizers.Optimizer.learning_rate.fget(self)

    @learning_rate.setter
    def learning_rate(self, value: Any) -> None:
        if isinstance(value, keras.Variable):
            # Keras's setter copies a variable's value into its own learning
            # rate: that value is the one the steps take.
            validation.check_lr(validation.as_float(value.numpy()), "learning_rate")
        keras.optimizers.Optimizer.learning_rate.fset(self, learning_rate_value(value))


class WholeStoreLoading:
    """Keras's ``save_own_variables`` / ``load_own_variables`` for the QH
    optimizers: the store records which slots it holds, and a load checks the
    whole store before it assigns anything. A mixin, before Keras's class."""

    # Keras's, through the class this one is mixed into.
    variables: Any
    built: bool
    _iterations: Any

    #: The store key under which :meth:`save_own_variables` records which slots
    #: the optimizer keeps (:meth:`_layout`), so that a store of another QH
    #: optimizer whose shapes happen to fit is not loaded.
    _LAYOUT_KEY = "qhoptim_layout"

    def _layout(self) -> int:
        """The tag of the slots kept: 1 (QHM's momentum), 2 (QHAdam's momentum
        and velocity), 3 (and amsgrad's velocity_hat), 4 (QHMuon's: Muon's
        momentum or AdamW's two, by variable)."""
        raise NotImplementedError

    def save_own_variables(self, store: Any) -> None:
        """Save the optimizer's variables (Keras's), and which slots they are."""
        super().save_own_variables(store)  # type: ignore[misc]
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
        Where one side has no slots yet -- saved, or loaded into, before the
        first step (``model.save`` before ``fit``; ``load_weights`` into a model
        just compiled) -- there is no state to carry: as Keras's optimizers,
        this warns and loads nothing.
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
                4: "QHMuon's (Muon's momentum, AdamW's momentum and velocity)",
            }
            if saved.tolist() != [self._layout()]:
                got = kinds.get(saved.tolist()[0], repr(saved.tolist())) if saved.size else saved
                raise ValueError(
                    f"{name} cannot load these variables: they are {got} slots, "
                    f"this optimizer keeps {kinds[self._layout()]}"
                )
            keys.discard(self._LAYOUT_KEY)
        # The variables an optimizer has before it builds: its step count and
        # (unless a schedule) its learning rate.
        unbuilt = sum(
            isinstance(v, keras.Variable)
            for v in (self._iterations, getattr(self, "_learning_rate", None))
        )
        if len(keys) != len(self.variables) and (not self.built or len(keys) == unbuilt):
            warnings.warn(
                f"{name} loads no variables: the store has {len(keys)}, the optimizer "
                f"{len(self.variables)}, and "
                + ("the optimizer" if not self.built else "the store's optimizer")
                + " had not stepped yet (it builds on its first step, or with "
                "optimizer.build(model.trainable_variables))",
                stacklevel=2,
            )
            return
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


class _PerVariableStep(
    validation.CheckedAttributes,
    CheckedLearningRate,
    WholeStoreLoading,
    keras.optimizers.Optimizer,  # type: ignore[misc]
):
    """Backend-neutral plumbing: running one variable's step, decoupled weight decay.

    The backend's mixin (``_BackendStep``) comes before this class in the MRO
    of :class:`QHOptimizer`: it may override the step hooks ``_dense``,
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
        name = _narrow.checked_state_dtype(state_dtype, stochastic_rounding)
        self.state_dtype, self.stochastic_rounding = name, stochastic_rounding

    def build(self, var_list: Any) -> None:
        if not self.built and self.state_dtype is not None:
            # Every slot's dtype checked before Keras marks the optimizer built
            # and any slot exists: a refused build leaves nothing half-made,
            # and the next step raises the same error.
            for variable in var_list:
                _narrow.slot_dtype(self.state_dtype, variable.dtype)
        super().build(var_list)

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
            dtype = _narrow.slot_dtype(self.state_dtype, dtype)
        return super().add_variable(shape, initializer, dtype, aggregation, **kwargs)

    def _state_config(self) -> dict[str, Any]:
        """The config entries of a narrow state (:func:`_narrow.state_config`)."""
        return _narrow.state_config(self.state_dtype, self.stochastic_rounding)

    def _narrow(self, variable: Any) -> bool:
        """Whether ``variable``'s slots are stored narrower than it."""
        return self._narrower_than(_narrow.state_dtype_name(variable.dtype))

    def _narrower_than(self, dtype_name: str | None) -> bool:
        """Whether slots of a variable of the dtype Keras names ``dtype_name``
        are stored narrower than it (in ``state_dtype``)."""
        return self.state_dtype is not None and self.state_dtype != dtype_name

    def _apply_weight_decay(self, variables: Any) -> None:
        # Decoupled decay is part of each variable's step (``rules.apply_update``, i.e.
        # ``rules.apply_update``): same math as Keras's separate pass, one pass less.
        return

    def _weight_decay_for(self, variable: Any) -> Any:
        """The decoupled weight decay of ``variable``: a float, or None for none."""
        wd = self.weight_decay
        if wd is None or validation.concrete_float(wd) == 0.0:
            return None
        return wd if self._use_weight_decay(variable) else None

    def _hyperparameters(self) -> dict[str, Any]:
        """The rule's hyperparameters, under :mod:`qhoptim.rules`'s names."""
        raise NotImplementedError

    def _slots(self, index: int) -> dict[str, Any]:
        """The slot variables of model variable ``index`` by name, in the order built."""
        raise NotImplementedError

    def _run_step(
        self,
        step: Any,
        inputs: dict[str, Any],
        slots: dict[str, Any],
        variable: Any,
        position: int,
        **hparams: Any,
    ) -> None:
        """``slots, variable <- step(inputs, slots, variable, **hparams)`` for one model
        variable, the ``position``-th of the optimizer (:mod:`qhoptim.keras._step`).

        ``inputs["gradient"]`` is the gradient; the other inputs are scalars
        (``learning_rate``, ``iterations``). ``hparams`` are Python values.
        Slots stored narrower than the variable (``state_dtype``) step through
        :func:`qhoptim.keras._narrow.with_narrow_state`, seeded by
        ``iterations`` and ``position``.
        """
        dtype = variable.dtype
        inputs = {
            name: self._dense(ops.cast(x, dtype)) if name == "gradient" else scalar_input(x, dtype)
            for name, x in inputs.items()
        }
        tensors = tuple(sorted(k for k, v in hparams.items() if _is_tensor(v)))
        if tensors:
            step = with_tensor_hyperparameters(step, tensors)
            for name in tensors:
                inputs[TENSOR_HYPERPARAMETER + name] = hparams[name]
            hparams = {k: v for k, v in hparams.items() if k not in tensors}
        if self._narrow(variable):
            step = _narrow.with_narrow_state(step)
            inputs["iterations"] = self.iterations
            inputs["state_index"] = ops.convert_to_tensor(rounding.state_index(position), "uint32")
            hparams = dict(
                hparams,
                state_dtype=self.state_dtype,
                stochastic=rounding.stochastic(self.state_dtype, self.stochastic_rounding),
            )
        self._step_variable(step, inputs, slots, variable, hparams)

    # The step hooks (see the class docstring).
    def _dense(self, gradient: Any) -> Any:
        """A sparse gradient as a dense tensor (:func:`dense_gradient`).

        QHM and QHAdam decay their buffers at *every* row on every step, so a
        sparse gradient is the dense gradient with zero rows, as for Keras's
        own ``SGD`` and ``Adam`` (which densify it too, mixing it with a buffer).
        """
        return dense_gradient(gradient)

    def _read(self, x: Any) -> Any:
        """The value of a variable (or a tensor as is); on JAX it honours ``stateless_apply``."""
        return x.value if isinstance(x, keras.Variable) else x

    def _step_variable(
        self,
        step: Any,
        inputs: dict[str, Any],
        slots: dict[str, Any],
        variable: Any,
        hparams: dict[str, Any],
    ) -> None:
        """Evaluate ``step`` with the backend's ops; write the slots and the variable
        through ``self.assign``."""
        apply_step(step, inputs, slots, variable, hparams, read=self._read, assign=self.assign)


# The active backend's step (see the module's docstring); its module is imported
# only when that backend is active.
_BackendStep: Any
if BACKEND == "tensorflow":
    from qhoptim.keras._tensorflow import TensorFlowStep as _BackendStep
elif BACKEND == "torch":
    from qhoptim.keras._torch import TorchStep as _BackendStep
else:

    class _BackendStep:  # type: ignore[no-redef]
        """JAX and Keras's other backends: ``update_step`` as written (``jax.jit`` fuses it)."""


def dense_gradient(gradient: Any) -> Any:
    """A sparse gradient (TensorFlow's ``IndexedSlices``, JAX's ``BCOO``) as a
    dense tensor; a dense one as it is."""
    if BACKEND == "tensorflow":
        from qhoptim.keras import _tensorflow

        if isinstance(gradient, _tensorflow.SPARSE_TYPES):
            return _tensorflow.dense(gradient)
    return ops.convert_to_tensor(gradient, sparse=False)


class QHOptimizer(_BackendStep, _PerVariableStep):  # type: ignore[misc]
    """The shared base class: the backend-neutral plumbing, under the active backend's step."""
