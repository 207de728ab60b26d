"""The torch backend's step of :mod:`qhoptim.keras`: all variables at once, multi-tensor.

Imported by ``qhoptim.keras`` only when Keras runs on torch. :class:`TorchStep`
is the mixin of the optimizers' base class there. The arithmetic is
:mod:`qhoptim.torch`'s kernel layer (``qhoptim.torch._kernels``), the kernels
``qhoptim.torch``'s own optimizers run.
"""

from __future__ import annotations

from typing import Any

import torch

from qhoptim import validation
from qhoptim.keras import _settings
from qhoptim.keras._step import step_number
from qhoptim.torch import _fused, _kernels, _state_dtype, _tensors
from qhoptim.torch._tensors import unalias_grads


def _fused_here(params: list[Any]) -> bool:
    """Whether these variables (of one device) step through the fused kernel
    (``TORCH_FUSED``): the C++ one on CPU, Triton's on CUDA, where it can be had."""
    return (
        bool(_settings.TORCH_FUSED)
        and len({p.device for p in params}) == 1
        and params[0].device.type in ("cpu", "cuda")
        and _fused.kernel_available(params[0].device)
    )


class TorchStep:
    """Mixin of ``qhoptim.keras``'s base class on the torch backend."""

    def _dense(self: Any, gradient: Any) -> Any:
        return gradient  # Keras has no sparse tensors on torch

    def _step_variable(
        self: Any,
        step: Any,
        inputs: dict[str, Any],
        slots: dict[str, Any],
        variable: Any,
        hparams: dict[str, Any],
    ) -> None:
        with torch.no_grad():  # Keras's generic path does not turn autograd off
            super()._step_variable(step, inputs, slots, variable, hparams)  # type: ignore[misc]

    def _backend_update_step(
        self: Any, grads: list[Any], trainable_variables: list[Any], learning_rate: Any
    ) -> None:
        """Every variable's step at once, with :mod:`qhoptim.torch`'s fused or multi-tensor kernels.

        Keras runs its own ``SGD`` and ``Adam`` this way on the torch backend
        (``torch._foreach`` versions); the per-variable ``update_step`` would
        launch every operation of the rule once per variable. The variables
        are grouped by their decoupled weight decay (the kernels group by
        device and dtype); the generic path remains for what the kernels do not
        take (hyperparameters that are tensors, complex variables,
        ``torch.compile``). Slots in a narrower ``state_dtype`` step as
        ``qhoptim.torch``'s narrow state does (:func:`_narrow_step`).
        """
        generic = super()._backend_update_step  # type: ignore[misc]
        # A subclass's own update_step is what it asked for: the kernels
        # step the library's rule, so only the library's update_step runs
        # them (Keras takes its torch fast path for its exact classes alone).
        if not type(self).update_step.__module__.startswith("qhoptim.keras"):
            return generic(grads, trainable_variables, learning_rate)  # type: ignore[no-any-return]
        hparams = self._hyperparameters()
        wd = 0.0 if self.weight_decay is None else validation.concrete_float(self.weight_decay)
        numbers = all(isinstance(x, float) for x in hparams.values())
        if not numbers or wd is None or torch.compiler.is_compiling():
            return generic(grads, trainable_variables, learning_rate)  # type: ignore[no-any-return]
        # Eager torch: the learning rate (Keras's variable, a schedule's
        # tensor, a callable's number) is concrete; read once per step.
        lr = float(self._read(learning_rate))
        groups: dict[tuple[float, bool], tuple[list[int], list[Any], list[Any]]] = {}
        for grad, variable in zip(grads, trainable_variables, strict=True):
            param = variable.value  # Keras's ``value`` is not free: read once
            if param.is_complex():
                return generic(grads, trainable_variables, learning_rate)  # type: ignore[no-any-return]
            decay = 0.0 if self._weight_decay_for(variable) is None else wd
            # Narrowness read from the tensor's dtype: Keras's ``variable.dtype``
            # costs microseconds a variable, which many small variables add up.
            key = (decay, self._narrower_than(str(param.dtype).removeprefix("torch.")))
            indices, params, param_grads = groups.setdefault(key, ([], [], []))
            indices.append(self._get_variable_index(variable))
            params.append(param)
            param_grads.append(grad if grad.dtype == param.dtype else grad.to(param.dtype))
        # The step number: QHAdam's bias corrections and a narrow state's rounding
        # seeds need it; QHM with full-precision slots reads no count.
        needs_step = self._RULE == "qhadam" or any(narrow for _, narrow in groups)
        step = step_number(int(self._read(self.iterations))) if needs_step else 0.0
        with torch.no_grad():
            for (decay, narrow), (indices, params, param_grads) in groups.items():
                # One list per slot (buffer; or moments and, with amsgrad, maxima).
                per_variable = [[s.value for s in self._slots(i).values()] for i in indices]
                slots = [list(s) for s in zip(*per_variable, strict=True)]
                kwargs = dict(
                    hparams,
                    lr=lr,
                    weight_decay=decay,
                    decoupled_weight_decay=True,  # Keras's weight decay
                    maximize=False,
                )
                if self._RULE == "qhadam":
                    kwargs["amsgrad"] = bool(self.amsgrad)
                if not narrow:
                    _step_lists(self._RULE, params, param_grads, slots, step, kwargs)
                    continue

                # Rounded with the seeds of the step's number and the variable's
                # index, as on the per-variable path (qhoptim.keras._narrow).
                def run(
                    at: Any, ps: Any, gs: Any, work: Any, seeds: Any, kwargs: Any = kwargs
                ) -> None:
                    _step_lists(self._RULE, ps, gs, work, step, kwargs, seeds)

                _state_dtype.step_narrow_state(
                    params,
                    param_grads,
                    slots,
                    run,
                    steps=[step] * len(params),
                    positions=indices,
                    fused=_fused_here(params),
                    state_dtype=getattr(torch, self.state_dtype),
                    stochastic_rounding=self.stochastic_rounding,
                )
        return None


def _step_lists(
    rule: str,
    params: list[Any],
    grads: list[Any],
    slots: list[list[Any]],
    step: float,
    kwargs: dict[str, Any],
    state_seeds: list[list[int]] | None = None,
) -> None:
    """One step of ``rule`` over lists of variables and their ``slots`` (one list
    per slot), fused on CPU where the kernel can be had, else multi-tensor;
    ``step`` is the number of the step being taken. ``state_seeds``: bfloat16
    slots, rounded stochastically in the fused kernel."""
    fused = _fused_here(params)
    if not fused:
        # A gradient sharing its variable's storage is read before the
        # multi-tensor passes write it (the fused kernel copies such a gradient
        # itself).
        grads = unalias_grads(params, grads)
    if rule == "qhm":
        (buffers,) = slots
        if fused:
            hp = _tensors.QHMHyperparameters(**kwargs)
            _fused.fused_qhm(
                params, grads, buffers, hp, grad_scale=None, found_inf=None, state_seeds=state_seeds
            )
        else:
            _kernels.foreach_qhm(params, grads, buffers, **kwargs)
        return
    # [exp_avgs, exp_avg_sqs] and, with amsgrad, [max_exp_avg_sqs]
    exp_avgs, exp_avg_sqs, *maxes = slots
    max_exp_avg_sqs = maxes[0] if maxes else None
    steps = [step] * len(params)
    if fused:
        hp_adam = _tensors.QHAdamHyperparameters(**kwargs)
        _fused.fused_qhadam_host_steps(
            params, grads, exp_avgs, exp_avg_sqs, steps, hp_adam, max_exp_avg_sqs, state_seeds
        )
    else:
        _kernels.foreach_qhadam(
            params, grads, exp_avgs, exp_avg_sqs, steps, max_exp_avg_sqs=max_exp_avg_sqs, **kwargs
        )
