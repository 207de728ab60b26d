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
from qhoptim.torch import _fused, _kernels
from qhoptim.torch._optimizer import unalias_grads


def _fused_here(params: list[Any]) -> bool:
    """Whether these variables step through the fused CPU kernel (``TORCH_FUSED``)."""
    import qhoptim.keras

    return (
        bool(qhoptim.keras.TORCH_FUSED)
        and all(p.device.type == "cpu" for p in params)
        and _fused.cpu_kernel_available()
    )


def _step_number(iterations: Any) -> float:
    """The number of the step being taken, ``iterations + 1``, as a Python float.

    Keras's int32 ``iterations`` wraps around to ``-2**31`` after ``2**31 - 1``
    steps; the wrapped count is read as the step it stands for (``+ 2**32``), as
    ``qhoptim.keras._step_number`` does on the per-variable path.
    """
    t = int(iterations) + 1
    return float(t + 2**32 if t < 1 else t)


class TorchStep:
    """Mixin of ``qhoptim.keras``'s base class on the torch backend."""

    def _dense(self: Any, gradient: Any) -> Any:
        return gradient  # Keras has no sparse tensors on torch

    def _step_variable(
        self: Any, step: Any, inputs: list[Any], state: list[Any], hparams: dict[str, Any]
    ) -> None:
        with torch.no_grad():  # Keras's generic path does not turn autograd off
            super()._step_variable(step, inputs, state, hparams)  # type: ignore[misc]

    def _backend_update_step(
        self: Any, grads: list[Any], trainable_variables: list[Any], learning_rate: Any
    ) -> None:
        """Every variable's step at once, with :mod:`qhoptim.torch`'s fused or multi-tensor kernels.

        Keras runs its own ``SGD`` and ``Adam`` this way on the torch backend
        (``torch._foreach`` versions); the per-variable ``update_step`` would
        launch every operation of the rule once per variable. The variables
        are grouped by their decoupled weight decay (the kernels group by
        device and dtype); the generic path remains for what the kernels do not
        take (hyperparameters that are tensors, complex variables, slots in a
        narrower ``state_dtype``, ``torch.compile``).
        """
        generic = super()._backend_update_step  # type: ignore[misc]
        hparams = self._hyperparameters()
        wd = 0.0 if self.weight_decay is None else validation.concrete_float(self.weight_decay)
        numbers = all(isinstance(x, float) for x in hparams.values())
        narrow = any(self._narrow(v) for v in trainable_variables)
        if not numbers or wd is None or narrow or torch.compiler.is_compiling():
            return generic(grads, trainable_variables, learning_rate)  # type: ignore[no-any-return]
        # Eager torch: the learning rate (Keras's variable, a schedule's
        # tensor, a callable's number) is concrete; read once per step.
        lr = float(self._read(learning_rate))
        groups: dict[float, tuple[list[int], list[Any], list[Any]]] = {}
        for grad, variable in zip(grads, trainable_variables, strict=True):
            param = variable.value  # Keras's ``value`` is not free: read once
            if param.is_complex():
                return generic(grads, trainable_variables, learning_rate)  # type: ignore[no-any-return]
            decay = 0.0 if self._weight_decay_for(variable) is None else wd
            indices, params, param_grads = groups.setdefault(decay, ([], [], []))
            indices.append(self._get_variable_index(variable))
            params.append(param)
            param_grads.append(grad if grad.dtype == param.dtype else grad.to(param.dtype))
        step = _step_number(self._read(self.iterations)) if self._RULE == "qhadam" else 0.0
        with torch.no_grad():
            for decay, (indices, params, param_grads) in groups.items():
                slots = [[s.value for s in self._slots(i)] for i in indices]
                kwargs = dict(
                    hparams,
                    lr=lr,
                    weight_decay=decay,
                    decoupled_weight_decay=True,  # Keras's weight decay
                    maximize=False,
                )
                fused = _fused_here(params)
                if not fused:
                    # A gradient sharing its variable's storage is read before
                    # the multi-tensor passes write it (the fused kernel copies
                    # such a gradient itself).
                    param_grads = unalias_grads(params, param_grads)
                if self._RULE == "qhm":
                    (buffers,) = zip(*slots, strict=True)
                    if fused:
                        hp = _kernels.QHMHyperparameters(**kwargs)
                        _fused.fused_qhm(
                            params, param_grads, list(buffers), hp, grad_scale=None, found_inf=None
                        )
                    else:
                        _kernels.foreach_qhm(params, param_grads, list(buffers), **kwargs)
                    continue
                # [exp_avgs, exp_avg_sqs] and, with amsgrad, [max_exp_avg_sqs]
                exp_avgs, exp_avg_sqs, *maxes = (list(s) for s in zip(*slots, strict=True))
                max_exp_avg_sqs = maxes[0] if maxes else None
                kwargs["amsgrad"] = bool(self.amsgrad)
                steps = [step] * len(params)
                if fused:
                    hp_adam = _kernels.QHAdamHyperparameters(**kwargs)
                    _fused.fused_qhadam_cpu_(
                        params, param_grads, exp_avgs, exp_avg_sqs, steps, hp_adam, max_exp_avg_sqs
                    )
                else:
                    _kernels.foreach_qhadam(
                        params,
                        param_grads,
                        exp_avgs,
                        exp_avg_sqs,
                        steps,
                        max_exp_avg_sqs=max_exp_avg_sqs,
                        **kwargs,
                    )
        return None
