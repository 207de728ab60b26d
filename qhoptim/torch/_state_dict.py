"""Checks of the state dicts a QH optimizer loads, and casts of loaded state.

``QHOptimizer.load_state_dict`` refuses a state dict that does not fit the
optimizer -- another optimizer's, wrong shapes, missing keys -- before anything
is loaded (:func:`check_state_dict`); :func:`cast_complex_state` gives a complex
parameter's loaded state its precision. Imports the narrow-state layer (an
8-bit state's packed size) and nothing above it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from qhoptim.torch import _state_dtype

#: The param-group keys whose values are torch dtypes (QHMuon's ``ns_dtype``,
#: every optimizer's ``state_dtype``).
DTYPE_KEYS = ("state_dtype", "ns_dtype")
_TORCH_PREFIX = "torch."


def groups_with_dtype_names(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``groups`` (a state dict's) with the dtypes of :data:`DTYPE_KEYS` written
    as their names, ``"torch.bfloat16"``: a state dict holds numbers, bools,
    strings, None and tensors, as torch's optimizers' do, which is what
    ``torch.distributed.checkpoint`` flattens and offloads (a dtype it refuses).
    Other keys' values, a user's own among them, are left as they are, as
    :func:`groups_with_dtypes` reads only these back."""
    return [
        {
            k: str(v) if k in DTYPE_KEYS and isinstance(v, torch.dtype) else v
            for k, v in group.items()
        }
        if any(isinstance(group.get(k), torch.dtype) for k in DTYPE_KEYS)
        else group
        for group in groups
    ]


def groups_with_dtypes(state_dict: Any) -> Any:
    """``state_dict`` with the dtype names :func:`groups_with_dtype_names` wrote
    read back as torch dtypes (checkpoints that hold the dtypes themselves, as
    earlier versions wrote them, load as they are); anything else unchanged,
    for :func:`check_state_dict` to judge."""
    if not isinstance(state_dict, dict) or not isinstance(
        state_dict.get("param_groups"), (list, tuple)
    ):
        return state_dict

    def read(key: str, value: Any) -> Any:
        if key in DTYPE_KEYS and isinstance(value, str) and value.startswith(_TORCH_PREFIX):
            dtype = getattr(torch, value.removeprefix(_TORCH_PREFIX), None)
            if isinstance(dtype, torch.dtype):
                return dtype
        return value

    groups = [
        {k: read(k, v) for k, v in group.items()} if isinstance(group, dict) else group
        for group in state_dict["param_groups"]
    ]
    return {**state_dict, "param_groups": groups}


def cast_complex_state(param: Tensor, state: dict[str, Any]) -> None:
    """Cast a complex parameter's loaded state to its precision.

    torch's ``load_state_dict`` casts state only for floating-point parameters;
    for a complex one it would keep, e.g., complex128 moments for a complex64
    parameter (and the foreach kernels would then refuse the mix).
    """
    if not param.is_complex():
        return
    for key, value in state.items():
        if key != "step" and torch.is_tensor(value):
            state[key] = value.to(param.dtype if value.is_complex() else param.real.dtype)


def _check_param_state(
    what: str,
    key: Any,
    param: Tensor,
    p_state: Any,
    allowed: tuple[frozenset[str], ...],
    *,
    packed: bool = False,
) -> None:
    """One parameter's saved state: the optimizer's keys, tensors that fit the parameter.

    Keys that are none of the optimizer's are another component's and pass
    unchecked, as ``torch.optim`` keeps them: timm's ``Lookahead`` and
    similar wrappers store their own buffers in the wrapped optimizer's state.
    They are accepted only beside a complete layout of the optimizer's own keys,
    so that another optimizer's state (SGD's ``momentum_buffer`` in QHAdam) is
    still refused. ``packed``: the state is 8-bit, one flat tensor of
    :func:`qhoptim.torch._state_dtype.packed_numel` values per state.
    """
    if not isinstance(p_state, dict):
        raise TypeError(
            f"{what}: the state of parameter {key!r} is a {type(p_state).__name__}, not a dict"
        )
    record = p_state.get(_state_dtype.PARAM_SHAPE) if packed else None
    if torch.is_tensor(record) and tuple(int(v) for v in record.tolist()) != tuple(param.shape):
        raise ValueError(
            f"{what}: the 8-bit state of parameter {key!r} is a parameter's of shape "
            f"{tuple(int(v) for v in record.tolist())}, the parameter {tuple(param.shape)}"
        )
    own = frozenset().union(*allowed)
    keys = frozenset(p_state) & own
    if keys not in allowed or (not keys and p_state):
        want = " or ".join(str(sorted(a)) for a in allowed if a)
        raise ValueError(
            f"{what}: the state of parameter {key!r} has keys {sorted(p_state)}, expected "
            f"{want}; is this the state dict of another optimizer?"
        )
    for name in sorted(keys):
        value = p_state[name]
        if name in ("step", "beta1_weight", "beta2_weight"):
            number = value
            if torch.is_tensor(value):
                if value.numel() != 1 or value.is_complex():
                    raise ValueError(
                        f"{what}: {name} of parameter {key!r} must be a real number or a "
                        f"1-element tensor; received a tensor of shape {tuple(value.shape)}"
                    )
                number = value.item()
            if isinstance(number, bool) or not isinstance(number, (int, float)):
                raise TypeError(
                    f"{what}: {name} of parameter {key!r} must be a number; received {value!r}"
                )
            if not (math.isfinite(number) and number >= 0):
                raise ValueError(
                    f"{what}: {name} of parameter {key!r} must be in [0, inf); received {number!r}"
                )
            continue
        if not torch.is_tensor(value):
            raise TypeError(
                f"{what}: {name} of parameter {key!r} must be a tensor; "
                f"received {type(value).__name__}"
            )
        if packed:
            packed_shape = (_state_dtype.packed_numel(param.numel()),)
            if tuple(value.shape) != packed_shape or value.is_complex():
                raise ValueError(
                    f"{what}: {name} of parameter {key!r} has shape {tuple(value.shape)}; "
                    f"the 8-bit state of a parameter of {param.numel()} values has "
                    f"{packed_shape}"
                )
            continue
        if value.shape != param.shape:
            raise ValueError(
                f"{what}: {name} of parameter {key!r} has shape {tuple(value.shape)}, "
                f"the parameter {tuple(param.shape)}"
            )
        # |g|^2 is real, and so are the second moment and its running maximum.
        complex_ok = param.is_complex() and name not in ("exp_avg_sq", "max_exp_avg_sq")
        if not (value.is_floating_point() or (value.is_complex() and complex_ok)) or (
            complex_ok and not value.is_complex()
        ):
            raise ValueError(
                f"{what}: {name} of parameter {key!r} has dtype {value.dtype}, which cannot "
                f"hold the state of a {param.dtype} parameter"
            )


def _other_optimizers_keys(optimizer: Any) -> set[str]:
    """The group keys of qhoptim's other torch optimizers that ``optimizer``'s
    lack: every qhoptim class under the one that first declares ``_GROUP_KEYS``
    (not a user's subclass, whose extra keys are its own business)."""
    classes = type(optimizer).__mro__
    root = next(c for c in reversed(classes) if "_GROUP_KEYS" in vars(c))
    found: set[str] = set()
    todo: list[Any] = [root]
    while todo:
        cls = todo.pop()
        if cls.__module__.split(".")[0] == "qhoptim":
            found.update(cls._GROUP_KEYS)
        todo.extend(cls.__subclasses__())
    return found - set(optimizer._GROUP_KEYS)


def check_state_dict(optimizer: Any, state_dict: Any) -> None:
    """Refuse a state dict that does not fit ``optimizer`` (a ``QHOptimizer``):
    ``TypeError`` or ``ValueError`` naming what is wrong, before anything is loaded.

    Its param groups must match the optimizer's in number and size and hold
    valid hyperparameters (the optimizer's ``_check_group``), and each
    parameter's state must have the optimizer's keys (``_STATE_KEYS``), with
    tensors of the parameter's shape (8-bit state: its packed size) and a
    floating-point dtype.
    """
    name = type(optimizer).__name__
    what = f"{name}.load_state_dict"
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= state_dict.keys():
        keys = sorted(map(str, state_dict)) if isinstance(state_dict, dict) else None
        raise TypeError(
            f"{what} expects a dict with 'state' and 'param_groups' (from state_dict()); "
            f"received {type(state_dict).__name__}" + (f" with keys {keys}" if keys else "")
        )
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"{what}: the state dict has {len(saved_groups)} param groups, "
            f"this optimizer {len(optimizer.param_groups)}"
        )
    params: dict[Any, Tensor] = {}
    packed: set[Any] = set()  # the ids of parameters whose state is 8-bit
    for i, (saved, group) in enumerate(zip(saved_groups, optimizer.param_groups, strict=True)):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(
                f"{what}: param group {i} of the state dict has {len(saved['params'])} "
                f"parameters, this optimizer's {len(group['params'])}"
            )
        missing = [k for k in optimizer._GROUP_KEYS if k not in saved]
        if missing:
            raise ValueError(
                f"{what}: param group {i} lacks {missing}; is this the state dict "
                f"of another optimizer? {name} needs {list(optimizer._GROUP_KEYS)}"
            )
        # A QHMuon group holds all of QHM's keys: what marks it is its own --
        # unless this optimizer's group holds the key too (a user's extra key
        # that happens to be another optimizer's: its own state dict loads).
        foreign = sorted(
            k for k in _other_optimizers_keys(optimizer) if k in saved and k not in group
        )
        if foreign:
            raise ValueError(
                f"{what}: param group {i} holds {foreign}, which {name} does not take; "
                "is this the state dict of another optimizer?"
            )
        # A 1.1.0 group's weight-decay key read first: it is the group's own
        # setting, not one given beside the optimizer's defaults.
        renamed = {**optimizer.defaults, **optimizer._renamed(saved, warn=False)}
        optimizer._check_group(renamed)
        if group.get("state_dtype") != renamed.get("state_dtype"):
            # Loaded, the group keeps this optimizer's storage (load_state_dict
            # converts the state): checked too as it will then be, with the
            # saved flags (capturable=True beside a narrow state is refused).
            storage = {k: group.get(k) for k in ("state_dtype", "stochastic_rounding")}
            optimizer._check_group({**renamed, **storage})
        params.update(zip(saved["params"], group["params"], strict=True))
        if _state_dtype.eight_bit(saved.get("state_dtype")):
            packed.update(saved["params"])
    for key, p_state in state_dict["state"].items():
        if key not in params:
            raise ValueError(
                f"{what}: the state dict has state for parameter {key!r}, "
                "which none of its param groups lists"
            )
        _check_param_state(
            what, key, params[key], p_state, optimizer._STATE_KEYS, packed=key in packed
        )
