"""The base classes of qhoptim.torch's optimizers: narrow state and checked
checkpoints, which every one has (QHMuon too); and what QHM and QHAdam share:
validation of param groups, gathering the parameters with gradients, the
upgrade of older state dicts (qhoptim 1.1.0's included), ``fused=True``'s
set-up, ``step``; and the docstring fragments of torch's flags.

It stands on the layers below (``_tensors``, ``_state_dtype``, ``_fused``,
``_state_dict``) and holds no tensor arithmetic; each optimizer module
(``_qhm.py``, ``_qhadam.py``) adds its hyperparameters and state.
"""

from __future__ import annotations

import functools
import itertools
import operator
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypedDict, TypeVar, cast

import torch
from torch import Tensor
from torch.optim.optimizer import Optimizer
from torch.optim.optimizer import (
    required as required,  # torch's sentinel (add_param_group checks it); for qhoptim.pyt
)

from qhoptim import validation
from qhoptim.torch import _extension, _fused, _state_dtype
from qhoptim.torch._state_dict import (
    check_state_dict,
    groups_with_dtype_names,
    groups_with_dtypes,
)
from qhoptim.torch._tensors import (
    copy_count,
    local_shard,
    runs_triton,
    scalar_dtype,
    values_of,
)

_DTYPE = operator.attrgetter("dtype")
# The key of a pickled optimizer's state dtypes (NarrowStateOptimizer.__getstate__).
_STORED_AS = "_qhoptim_stored_as"
_CHANGED = "_qhoptim_changed"
_STORAGE = "_qhoptim_storage"
_GRAD = operator.attrgetter("grad")
_IS_SPARSE = operator.attrgetter("is_sparse")
_TORCH_FLAGS = {
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
}

_F = TypeVar("_F", bound=Callable[..., Any])


state_dtype_doc = r"""state_dtype (torch.dtype, optional): store the state in this
            dtype, e.g. ``torch.bfloat16`` for half a float32 model's state
            memory, or ``torch.uint8`` for 8-bit blockwise state (a byte per
            value and a float32 scale per 256 values); the arithmetic stays in
            the parameters' dtype, float32 for an 8-bit state of 16-bit ones
            (default: None, the parameters' own; see docs/torch.md)
        stochastic_rounding (bool, optional): write a bfloat16 or 8-bit state
            back with unbiased, counter-based stochastic rounding (default:
            None, i.e. True for bfloat16 and 8-bit; False rounds to nearest)"""


def use_grad_for_differentiable(step: _F) -> _F:
    """Run ``step`` with autograd on only for ``differentiable=True`` optimizers.

    As torch's ``_use_grad_for_differentiable``: under ``torch.compile`` the step
    is also split off from the code around it (a graph break before and after),
    so that it is traced as the inference graph it is and updates its tensors in
    place rather than allocating new ones (pytorch/pytorch#104053). A step that
    reads its counts on the host (:func:`reads_counts_on_the_host`) runs outside
    any graph, wherever it is called from: ``torch.compile`` may run this
    wrapper itself eagerly (once a graph break in it could not be resumed, for
    any optimizer of the class) and still compile the frames it calls, so the
    step is called through ``torch.compiler.disable`` wherever Dynamo's frame
    evaluation is on (:func:`_under_dynamo`).
    """

    def with_grad_mode(self: Any, *args: Any, **kwargs: Any) -> Any:
        prev_grad = torch.is_grad_enabled()
        try:
            torch.set_grad_enabled(self.defaults["differentiable"])
            return step(self, *args, **kwargs)
        finally:
            torch.set_grad_enabled(prev_grad)

    outside_graphs: list[Callable[..., Any]] = []  # made on first need (imports Dynamo)

    @functools.wraps(step)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _under_dynamo() and reads_counts_on_the_host(self):
            if not outside_graphs:
                outside_graphs.append(torch.compiler.disable(with_grad_mode))  # type: ignore[no-untyped-call]
            return outside_graphs[0](self, *args, **kwargs)
        prev_grad = torch.is_grad_enabled()
        try:
            torch.set_grad_enabled(self.defaults["differentiable"])
            if torch.compiler.is_compiling():
                _graph_break()
            result = step(self, *args, **kwargs)
        finally:
            if torch.compiler.is_compiling():
                _graph_break()
            torch.set_grad_enabled(prev_grad)
        return result

    return cast(_F, wrapper)


def _under_dynamo() -> bool:
    """Whether ``torch.compile`` traces this call or evaluates the frames it
    makes: tracing, or a frame Dynamo runs eagerly inside a compiled function
    (its frame callback is set). Where torch does not say, whenever Dynamo is
    loaded. A C call on the eager step's path, where ``torch.compiler.disable``
    cost about 3 us a step."""
    if torch.compiler.is_compiling():
        return True
    if "torch._dynamo" not in sys.modules:
        return False
    callback = getattr(torch._C._dynamo.eval_frame, "get_eval_frame_callback", None)
    return callback is None or callback() not in (None, False)


def reads_counts_on_the_host(optimizer: Any) -> bool:
    """Whether a step of ``optimizer`` reads its step counts on the host: the
    fused kernels fold their coefficients from them (QHAdam's bias
    corrections), a narrow state's rounding its seeds. Traced by
    ``torch.compile``, those numbers would stay the traced step's (fused
    QHAdam 0.2% off by its third step), so there such a step runs as it does
    eagerly, a call the graph breaks around."""
    return any(
        group.get("fused") or group.get("state_dtype") is not None
        for group in optimizer.param_groups
    )


def _graph_break() -> None:
    """Break ``torch.compile``'s graph here (torch itself calls the private
    ``torch._dynamo.graph_break``). Dynamo does not trace into
    ``torch.compiler.disable``, nor into the function it returns, so the call
    breaks the graph; it is made only while compiling, because
    ``torch.compiler.disable`` imports ``torch._dynamo`` (seconds), which a
    compilation has imported already."""
    torch.compiler.disable(_nothing)()  # type: ignore[no-untyped-call]


def _nothing() -> None:
    pass


# Docstring fragments for the flags QHM and QHAdam share with torch.optim.
params_doc = r"""params (iterable): the parameters to optimize: an iterable of tensors or
            of dicts defining parameter groups (or of ``named_parameters()``, in
            torch releases whose ``Optimizer`` takes them)"""

maximize_doc = r"""maximize (bool, optional): step along the gradient, maximizing the
            objective, instead of against it (default: False)"""

foreach_doc = r"""foreach (bool, optional): whether the multi-tensor (foreach)
            implementation runs the step instead of the per-tensor loop. ``None``
            picks foreach for non-differentiable steps of plain tensors,
            parameters or DTensors that are all on CPU (where it was measured
            faster, unlike torch's optimizers) or all on a device with multi-tensor
            kernels (CUDA, XPU, ...), and the loop otherwise. Its intermediates
            are tensor lists: up to about the parameters' size in extra peak
            memory (default: None)"""

capturable_doc = r"""capturable (bool, optional): whether the step can be captured in a
            CUDA graph (or compiled with ``torch.compile``): it then reads nothing
            back to the host (step counts live on the parameters' devices).
            Slower outside a graph, so leave it False unless you capture the step
            (default: False)"""

differentiable_doc = r"""differentiable (bool, optional): whether autograd records the
            step, so that gradients flow through it; otherwise ``step()`` runs
            under ``torch.no_grad()``. Slower, so leave it False unless you
            differentiate through the step (default: False)"""


def lr_value(lr: Any) -> Any:
    """The value of ``lr`` to validate: a 1-element tensor is read once, here, never in ``step``."""
    if isinstance(lr, Tensor):
        if lr.numel() == 0:  # the shared wording of an empty array
            validation.check_one_number(lr, "lr")
        if lr.numel() != 1:
            raise ValueError(f"Tensor lr must be 1-element; received a tensor of shape {lr.shape}")
        # Its Python number, so that a bool or complex tensor is refused as
        # True or 0.5+0j are (float() would read them as 1.0 and 0.5).
        return lr.detach().item()
    if lr is required:
        return 0.0  # torch's add_param_group reports the missing lr, after these checks
    return lr


def one_number_each(hparams: dict[str, Any]) -> None:
    """After the range checks (whose wording an array out of range takes, as
    in every backend): each hyperparameter one number, as the steps fold them
    into Python floats -- a NumPy array of several is refused."""
    for name, value in hparams.items():
        validation.check_one_number(value, name)


def numbers_only(hparams: dict[str, Any]) -> None:
    """Refuse tensors for the hyperparameters that are not ``lr``.

    The steps fold them into Python-float coefficients (the in-place kernels'
    scalars), so a tensor would fail inside ``step`` or be read once and then
    ignored when changed; only ``lr`` may be a tensor, as in ``torch.optim``.
    """
    for name, value in hparams.items():
        if isinstance(value, Tensor):
            raise TypeError(
                f"{name} must be a Python number (only lr may be a tensor); "
                f"received {name}={value!r}"
            )


# The hyperparameters a param group may hold as numbers (QHM's and QHAdam's).
_HPARAMS = ("lr", "momentum", "nu", "weight_decay", "eps")
_PAIRS = ("betas", "nus")


def _number(value: Any) -> Any:
    # A concrete scalar of another kind (a NumPy scalar or 0-d array, a JAX
    # array) as the Python float it holds; torch tensors are left to
    # lr_value / numbers_only (lr may stay a tensor, the others are refused).
    return value if isinstance(value, Tensor) else validation.as_float(value)


def as_numbers(group: dict[str, Any]) -> dict[str, Any]:
    """``group`` with its hyperparameters' concrete scalars as Python floats.

    The steps fold hyperparameters into Python-float coefficients of in-place
    kernels; a 0-d NumPy array there fails (``_foreach_add``) once the step
    count has advanced. So, as in every backend, a concrete scalar is read once,
    when the group is made (constructor, ``add_param_group``, ``load_state_dict``).
    """
    out = dict(group)
    for key in _HPARAMS:
        if key in out:
            out[key] = _number(out[key])
    for key in _PAIRS:
        pair = out.get(key)
        if isinstance(pair, (tuple, list)) and len(pair) == 2:
            values = [_number(v) for v in pair]
            out[key] = tuple(values) if isinstance(pair, tuple) else values
    return out


#: The group keys a state's storage is checked with: its dtype, its rounding,
#: and the flags a narrow state excludes (``_state_dtype.check_state_dtype``).
STORAGE_KEYS = ("state_dtype", "stochastic_rounding", "capturable", "differentiable")


class _CheckedGroup(NamedTuple):
    """A param group as it was last checked: its values (all but ``params``),
    read back by ``values_of``, and the dtype its state is stored in."""

    group: dict[str, Any]
    size: int
    values_of: Callable[[dict[str, Any]], tuple[Any, ...]]
    values: tuple[Any, ...]
    state_dtype: torch.dtype | None
    #: The values of the keys the state's storage is checked with
    #: (:data:`STORAGE_KEYS`), as checked.
    storage: dict[str, Any]

    @classmethod
    def of(cls, group: dict[str, Any]) -> _CheckedGroup:
        keys = tuple(k for k in group if k != "params")
        values_of: Callable[[dict[str, Any]], tuple[Any, ...]]
        if len(keys) > 1:
            values_of = operator.itemgetter(*keys)  # a tuple, in C
        else:
            values_of = lambda g: tuple(g[k] for k in keys)  # noqa: E731
        storage = {k: group[k] for k in STORAGE_KEYS if k in group}
        # A list (betas=[0.9, 0.99]) as a copy: one changed in place
        # (group["betas"][0] = nan) is then a change, checked again.
        values = tuple(tuple(v) if type(v) is list else v for v in values_of(group))
        return cls(group, len(group), values_of, values, group.get("state_dtype"), storage)

    def unchanged(self) -> bool:
        """Whether the group holds the values checked: each the same object
        (the step's usual case, one pass in C), or an equal one of the same
        type. A tensor replaced by another counts as changed (comparing two
        would be an element-wise operation, on two devices perhaps), as does
        anything whose comparison is not a truth value."""
        if len(self.group) != self.size:
            return False
        try:
            values = self.values_of(self.group)
        except KeyError:  # a key replaced by another
            return False
        return all(map(operator.is_, self.values, values)) or all(
            map(_same_value, self.values, values)
        )


class _GroupChange(NamedTuple):
    """A param group whose values changed since they were checked, and the
    dtype its state is stored in (:data:`_UNKNOWN` for a group never checked)."""

    group: dict[str, Any]
    stored_as: Any


#: The stored dtype of a group never checked: its state is what it holds.
_UNKNOWN = object()


def _same_value(a: Any, b: Any) -> bool:
    """Whether ``b`` is the checked value ``a``: the same object, or equal and
    of the same type -- a pair element by element, so that ``(0.9, 0.99)``
    replaced by ``(0.9, np.array(0.99))`` or ``(0.9, True)`` is checked again
    (``a``: a list as checked is held as a tuple, see :meth:`_CheckedGroup.of`)."""
    if a is b:
        return True
    if type(a) is tuple and type(b) in (tuple, list):
        return len(a) == len(b) and all(map(_same_value, a, b))
    if type(a) is not type(b) or isinstance(a, Tensor):
        return False
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):  # an array's comparison, say
        return False


def sparse_error(optimizer: str) -> RuntimeError:
    return RuntimeError(f"{optimizer} does not support sparse gradients")


class Gathered(NamedTuple):
    """A param group's parameters with a gradient, their grads and their states
    (None where a state is still to be made): what ``step`` checks in every
    group before any steps (:meth:`QHOptimizer._gather`)."""

    params: list[Tensor]
    grads: list[Tensor]
    states: list[dict[str, Any] | None]


class AmpTensors(TypedDict):
    """``torch.amp.GradScaler``'s tensors for a fused step, as the functional steps take them."""

    grad_scale: Tensor | None
    found_inf: Tensor | None


class NarrowStateOptimizer(Optimizer):
    """What every ``qhoptim.torch`` optimizer shares: state stored in a narrower
    ``state_dtype`` (stepped on working copies or in the fused kernel, converted
    when a checkpoint of another dtype is loaded, read back by
    :meth:`decoded_state`) and a ``load_state_dict`` that checks the checkpoint
    fits first. Subclasses name their groups' keys and their state lists."""

    # What a state dict of this optimizer holds: the hyperparameters every param
    # group must have, and the sets of keys a parameter's state may have (the
    # empty set: not stepped yet).
    _GROUP_KEYS: tuple[str, ...] = ()
    _STATE_KEYS: tuple[frozenset[str], ...] = ()
    # Whether each state list the step takes holds negative values (an 8-bit
    # state encodes a sign only where it does).
    _SIGNED: tuple[bool, ...] = ()

    def _check_group(self, group: dict[str, Any]) -> None:
        """Validate a param group's hyperparameters (``validation``'s checks)."""
        raise NotImplementedError

    def _step_lists(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        state_lists: list[list[Tensor]],
        steps: list[Any],
        run: Callable[..., None],
        *,
        count_steps: bool,
        whole_tensors: bool = False,
    ) -> None:
        """``run(params, grads, state_lists, steps, state_seeds)``, the functional step,
        for a group whose state may be stored narrower than its parameters
        (``state_dtype``).

        Parameters whose state has their own dtype step as usual; the others
        step through :func:`qhoptim.torch._state_dtype.step_narrow_state`, in
        the fused kernel (which rounds the state with the seeds it is given) or
        on working copies. The seeds are made of the number of the step being
        taken (the count in ``steps`` plus one; the count is advanced here,
        except by QHAdam's fused step, which advances its own) and the
        parameter's position in the optimizer. ``count_steps``: the counts are
        only for the seeds (QHM's). ``whole_tensors``: ``run`` takes each tensor
        whole, never a slice of a large one (QHMuon's orthogonalization).
        """
        if group.get("state_dtype") is None:
            run(params, grads, state_lists, steps, None)
            return
        if group["state_dtype"] not in set(map(_DTYPE, params)):
            # Every parameter's state narrower (the usual case), found at C speed.
            ps, gs, lists, counts = params, grads, state_lists, steps
        else:
            narrow = [_state_dtype.narrow(group, p) for p in params]
            keep = [i for i, n in enumerate(narrow) if not n]
            if keep:
                run(*_take(keep, params, grads, state_lists, steps), None)
            at = [i for i, n in enumerate(narrow) if n]
            if not at:
                return
            ps, gs, lists, counts = _take(at, params, grads, state_lists, steps)
        # Each parameter's place in the optimizer, by id: built and read at C
        # speed (a tensor's hash is a Python call).
        everything = itertools.chain.from_iterable(g["params"] for g in self.param_groups)
        position = dict(zip(map(id, everything), itertools.count()))
        # On working copies each run steps from copies of its tensors' counts (a
        # large tensor's slices each step once); a count then takes the value
        # its copies reached. QHM's counts are advanced here.
        reached: dict[int, Any] = {}

        def step(
            at: Sequence[int], ps: Any, gs: Any, lists: Any, seeds: list[list[int]] | None
        ) -> None:
            if seeds is not None:  # the fused kernel, once: QHAdam's step counts itself
                run(ps, gs, lists, counts, seeds)
                return
            copies = [copy_count(counts[i]) for i in at]
            run(ps, gs, lists, copies, seeds)
            reached.update(zip(at, copies, strict=True))

        _state_dtype.step_narrow_state(
            ps,
            gs,
            lists,
            step,
            steps=[value + 1 for value in values_of(counts)],
            positions=list(map(position.__getitem__, map(id, ps))),
            fused=bool(group.get("fused")) or self._narrow_state_in_kernel(ps, whole_tensors),
            state_dtype=group["state_dtype"],
            stochastic_rounding=group.get("stochastic_rounding"),
            signed=self._SIGNED,
            whole_tensors=whole_tensors,
        )
        # A step GradScaler skipped (an inf or NaN gradient) leaves QHM's counts.
        if count_steps and not _fused.skipped(self._amp_tensors()["found_inf"]):
            _fused.counted(counts)
        else:
            for i, copy in reached.items():
                counts[i].copy_(copy)

    @staticmethod
    def _narrow_state_in_kernel(params: list[Tensor], whole_tensors: bool) -> bool:
        """Whether a narrow state of CPU parameters steps in the fused C++ kernel
        on every path, not only ``fused=True``'s: its one pass reads and writes
        the narrow state itself, where the other paths would make float32 working
        copies and round them back (1.6-1.9x the float32 state's step). Where
        the kernel cannot be built, or the step is not element-wise (QHMuon's),
        the working copies remain."""
        return (
            not whole_tensors
            and all(p.device.type == "cpu" for p in params)
            and not runs_triton(torch.device("cpu"))  # Triton's interpreter: fused=True's only
            and _extension.cpu_kernel_available()
        )

    def _narrow_state(self, group: dict[str, Any], keys: tuple[str, ...]) -> None:
        """Store ``keys`` of the group's state in its ``state_dtype`` (torch's
        ``load_state_dict`` casts loaded state to the parameter's dtype)."""
        dtype = group.get("state_dtype")
        if dtype is None:
            return
        for p in group["params"]:
            state = self.state.get(p, {})
            for key in keys:
                if key in state and state[key].dtype != dtype and not p.is_complex():
                    state[key] = state[key].to(dtype)
            if _state_dtype.PARAM_SHAPE in state:
                # Loaded, and cast like the rest to the parameter's dtype, where
                # a bfloat16 (257,) reads (256,): made again from the parameter,
                # whose shape check_state_dict matched the saved record to.
                state[_state_dtype.PARAM_SHAPE] = _state_dtype.shape_record(p)

    def __getstate__(self) -> dict[str, Any]:
        # A copy or a pickle carries the dtype each group's state is stored in
        # (its record's, which a group's state_dtype changed since the last
        # step does not yet match), by position: the records are by identity.
        # It carries too which groups changed since they were checked: the
        # copy's next step checks them, as the original's would.
        # And the storage values a group's state is in where its state_dtype
        # changed (what its state dict writes: _stored_storage).
        stored_as = [self._stored_dtype(group) for group in self.param_groups]
        records = [self._record_of(group) for group in self.param_groups]
        changed = [record is None or not record.unchanged() for record in records]
        storage = [self._stored_storage(group) for group in self.param_groups]
        return {
            **super().__getstate__(),
            _STORED_AS: stored_as,
            _CHANGED: changed,
            _STORAGE: storage,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        # torch's load_state_dict comes here too, with the state and groups alone.
        state = dict(state)
        stored_as = state.pop(_STORED_AS, None)
        # (A pickle without the record, of an earlier version: every group.)
        changed = state.pop(_CHANGED, None) or [True] * len(state.get("param_groups", []))
        storage = state.pop(_STORAGE, None) or [{}] * len(changed)
        super().__setstate__(state)
        wanted = [group.get("state_dtype") for group in self.param_groups]
        if stored_as is not None:  # a state_dtype changed before the copy, not yet converted:
            for group, dtype in zip(self.param_groups, stored_as, strict=True):
                group["state_dtype"] = dtype  # what the state is stored in, for the upgrade
        self._upgrade_groups()
        self._checked_groups: dict[int, _CheckedGroup] = {}
        for group, dtype, was_changed, stored in zip(
            self.param_groups, wanted, changed, storage, strict=True
        ):
            record = _CheckedGroup.of(group)
            if stored:  # the storage the state is in, not the group's new flags
                record = record._replace(storage=stored)
            # A group the original had yet to check again: a record that
            # never reads as unchanged, so that the next step checks it.
            self._checked_groups[id(group)] = record._replace(size=-1) if was_changed else record
            group["state_dtype"] = dtype  # ... converted by the next step, as the original's

    def _upgrade_groups(self) -> None:
        """Fill in what the groups of an older pickle or state dict lack."""

    def _renamed(self, group: dict[str, Any], *, warn: bool) -> dict[str, Any]:
        """``group`` with a legacy spelling read into its current one (none here)."""
        return group

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state, as torch's ``state_dict``: each param group's
        ``state_dtype`` (and QHMuon's ``ns_dtype``) written as its name,
        ``"torch.bfloat16"``, so that the state dict holds only numbers, bools,
        strings, None and tensors, as torch's own optimizers' do
        (``torch.distributed.checkpoint`` flattens and offloads such state
        dicts). :meth:`load_state_dict` reads the names back, and takes the
        dtypes themselves too. A group whose ``state_dtype`` changed since the
        last step (its state is converted at the next) is written with the
        storage its state is in -- the dtype, rounding and flags it was last
        checked with (:data:`STORAGE_KEYS`) -- a group that loads; an optimizer
        that loads it converts the state to its own ``state_dtype``, as it
        would a checkpoint saved in another. Nothing is changed here."""
        state_dict = super().state_dict()
        if not isinstance(state_dict, dict) or not isinstance(
            state_dict.get("param_groups"), (list, tuple)
        ):
            return state_dict  # a post-hook's own layout
        groups = list(state_dict["param_groups"])
        if len(groups) == len(self.param_groups):  # else a post-hook's: not matched
            groups = [
                {**saved, **self._stored_storage(group)} if isinstance(saved, dict) else saved
                for saved, group in zip(groups, self.param_groups, strict=True)
            ]
        return {**state_dict, "param_groups": groups_with_dtype_names(groups)}

    def _stored_storage(self, group: dict[str, Any]) -> dict[str, Any]:
        """The storage values (:data:`STORAGE_KEYS`) ``group``'s state is in,
        where its ``state_dtype`` changed since its last check; else none."""
        record = self._record_of(group)
        if record is None:
            return {}
        return {} if _same_value(record.state_dtype, group.get("state_dtype")) else record.storage

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the optimizer state, after checking it fits this optimizer.

        The state dict must come from this optimizer class (or qhoptim 1.1.0's
        class of the same name): its param groups must match this optimizer's in
        number and size and hold valid hyperparameters, and each parameter's
        state must have this optimizer's keys, with tensors of the parameter's
        shape and a floating-point dtype (torch casts them to the parameter's
        dtype, as for its own optimizers). Anything else -- a state dict of
        ``torch.optim.Adam`` or of another QH optimizer, wrong shapes, missing
        keys -- raises ``ValueError`` or ``TypeError`` and leaves the optimizer
        unchanged. Load-state-dict pre-hooks run first, once, as in torch.
        """
        hooks = self._optimizer_load_state_dict_pre_hooks
        state_dict = state_dict.copy() if isinstance(state_dict, dict) else state_dict
        for hook in hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        state_dict = groups_with_dtypes(state_dict)
        check_state_dict(self, state_dict)
        # Concrete scalars in the saved groups as floats, as in add_param_group.
        state_dict = {
            **state_dict,
            "param_groups": [as_numbers(g) for g in state_dict["param_groups"]],
        }
        self._optimizer_load_state_dict_pre_hooks = type(hooks)()  # already run
        # state_dtype is how this optimizer stores its state, not a
        # hyperparameter of the run: each group keeps its own, and loaded state
        # saved in another is converted to it (a float32 checkpoint loaded into
        # an 8-bit optimizer takes a byte per value, not four).
        storage = [
            (group.get("state_dtype"), group.get("stochastic_rounding"))
            for group in self.param_groups
        ]
        try:
            super().load_state_dict(state_dict)
        finally:
            self._optimizer_load_state_dict_pre_hooks = hooks
        for group, (dtype, stochastic) in zip(self.param_groups, storage, strict=True):
            if group.get("state_dtype") != dtype:
                self._convert_state(group, dtype)
                group["stochastic_rounding"] = stochastic
        self._checked_groups = {}
        for group in self.param_groups:  # checked by check_state_dict
            self._remember_checked(group)

    #: The names of the state lists ``_SIGNED`` describes, in its order.
    _STATE_LISTS: tuple[str, ...] = ()

    def _remember_checked(self, group: dict[str, Any]) -> None:
        """Record ``group``'s values as checked, and the dtype its state is stored in."""
        checked = self.__dict__.setdefault("_checked_groups", {})
        checked[id(group)] = _CheckedGroup.of(group)

    def _check_changed_groups(self) -> list[_GroupChange]:
        """Check again, before any group moves, each param group whose values
        changed since they were checked (made, loaded or last stepped): a
        scheduler's (a ``LambdaLR`` run past its end gives a negative lr) or a
        hand's. torch's optimizers step by such values; here, as where a group
        is made, they raise ``ValueError`` (the step would otherwise write a
        checkpoint ``load_state_dict`` refuses, or fail in a later group after
        earlier ones moved). Returns the changes, which :meth:`_take_changes`
        makes once the rest of the step's checks have passed: a failing step
        changes nothing. A tensor ``lr`` is a value as an object: one written
        in place is not read again, nor a new one on an accelerator (reading it
        there would synchronize, and fail under CUDA graph capture); nothing is
        under ``torch.compile``, whose guards see the values.
        """
        if torch.compiler.is_compiling():
            return []
        changed: list[_GroupChange] = []
        for group in self.param_groups:
            record = self._record_of(group)
            if record is not None and record.unchanged():
                continue
            lr = group["lr"]
            on_device = isinstance(lr, Tensor) and lr.device.type != "cpu"
            self._check_group({**group, "lr": 0.0} if on_device else group)
            if group.get("fused"):  # set on a group whose parameters have state
                for p in group["params"]:
                    _fused.check_fused_device(p)
            changed.append(_GroupChange(group, _UNKNOWN if record is None else record.state_dtype))
        return changed

    def _take_changes(self, changes: list[_GroupChange]) -> None:
        """Make the checked ``changes``: a 1.1.0 weight-decay key read into
        ``decoupled_weight_decay``, a concrete scalar read as its Python float
        (as where a group is made), and a changed ``state_dtype``'s state
        converted, as ``load_state_dict`` converts a checkpoint's."""
        checked = self.__dict__.setdefault("_checked_groups", {})
        for group, stored_as in changes:
            renamed = self._renamed(group, warn=True)
            if renamed is not group:
                params = group["params"]
                group.clear()
                group.update(renamed, params=params)
            group.update(as_numbers(group))
            wanted = group.get("state_dtype")
            if stored_as is not _UNKNOWN and wanted != stored_as:
                group["state_dtype"] = stored_as  # what _convert_state converts from
                try:
                    self._convert_state(group, wanted)
                except BaseException:
                    group["state_dtype"] = wanted  # still to be made: the next step tries again
                    raise
            self._remember_checked(group)
        if len(checked) > len(self.param_groups):  # groups replaced: their records go
            current = {id(group) for group in self.param_groups}
            for key in [key for key in checked if key not in current]:
                del checked[key]

    def _record_of(self, group: dict[str, Any]) -> _CheckedGroup | None:
        """``group``'s record as last checked (None: never checked, or the
        record of another group that had its ``id``)."""
        record = self.__dict__.get("_checked_groups", {}).get(id(group))
        return record if record is not None and record.group is group else None

    def _stored_dtype(self, group: dict[str, Any]) -> torch.dtype | None:
        """The dtype ``group``'s state is stored in: its record's, which a
        ``state_dtype`` changed since the last step does not yet match."""
        record = self._record_of(group)
        return group.get("state_dtype") if record is None else record.state_dtype

    def _convert_state(self, group: dict[str, Any], dtype: torch.dtype | None) -> None:
        """Store ``group``'s state in ``dtype`` (None: the parameters' own)."""
        stored_as = group.get("state_dtype")
        for p in group["params"]:
            p_state = self.state.get(p, {})
            for key, signed in zip(self._STATE_LISTS, self._SIGNED, strict=True):
                if key in p_state and not p.is_complex():
                    was = stored_as if _state_dtype.narrow(group, p) else None
                    want = dtype if dtype is not None and dtype != p.dtype else None
                    p_state[key] = _state_dtype.converted(p_state[key], p, was, want, signed)
            if dtype is not None and dtype != p.dtype and p_state and "step" not in p_state:
                p_state["step"] = torch.zeros((), dtype=torch.float64)  # QHM's seeds' count
            p_state.pop(_state_dtype.PARAM_SHAPE, None)
            if _state_dtype.eight_bit(dtype) and p_state:
                p_state[_state_dtype.PARAM_SHAPE] = _state_dtype.shape_record(p)
        group["state_dtype"] = dtype

    def decoded_state(self, param: Tensor) -> dict[str, Tensor]:
        """``param``'s moments as ordinary tensors of its shape, whatever ``state_dtype``
        stores them in: for logging, debugging, or reading an 8-bit checkpoint.

        An 8-bit state is decoded and a bfloat16 or float16 one widened, to float32
        (to the parameter's dtype where that is wider); the stored state is left
        as it is (the tensors are new). QHM's ``momentum_buffer``;
        QHAdam's ``exp_avg``, ``exp_avg_sq`` and, with AMSGrad, ``max_exp_avg_sq``.
        Empty before the parameter's first step; a ``KeyError`` for a tensor this
        optimizer does not hold.
        """
        group = next((g for g in self.param_groups if any(p is param for p in g["params"])), None)
        if group is None:
            raise KeyError("decoded_state: the tensor is not a parameter of this optimizer")
        p_state = self.state.get(param, {})
        stored = {"state_dtype": self._stored_dtype(group)}  # not a change the step has yet to make
        stored_as = stored["state_dtype"] if _state_dtype.narrow(stored, param) else None
        wide = (
            param.dtype if param.is_complex() else torch.promote_types(param.dtype, torch.float32)
        )
        return {
            key: _state_dtype.converted(p_state[key], param, stored_as, wide, signed).clone()
            for key, signed in zip(self._STATE_LISTS, self._SIGNED, strict=True)
            if key in p_state
        }

    def _amp_tensors(self) -> AmpTensors:
        """What ``torch.amp.GradScaler`` set on a fused optimizer for this step."""
        return {
            "grad_scale": getattr(self, "grad_scale", None),
            "found_inf": getattr(self, "found_inf", None),
        }


def fresh_step(step: Any, **where: Any) -> Tensor:
    """A loaded step count as a fresh state holds it: a 0-d tensor of
    ``where``'s dtype (and device). A saved Python number, int64 or float16
    count (or one of shape ``(1,)``) would make a multi-tensor step fail on the
    mix, or a float16 one stop counting at 2048 and repeat the rounding's seeds."""
    if not torch.is_tensor(step):
        return torch.tensor(float(step), **where)
    if (
        step.dtype != where["dtype"]
        or step.dim() != 0
        or ("device" in where and step.device != where["device"])
    ):
        return step.detach().reshape(()).to(**where)
    return step


class MomentumBufferState:
    """The state of an optimizer with one momentum buffer per parameter (QHM,
    QHMuon): the buffer, and with a narrow ``state_dtype`` a step count (the
    rounding's seed). A mixin, placed before the base class."""

    _STATE_KEYS: tuple[frozenset[str], ...] = (
        frozenset(),
        frozenset({"momentum_buffer"}),
        frozenset({"momentum_buffer", "step"}),
    )
    _SIGNED: tuple[bool, ...] = (True,)
    _STATE_LISTS: tuple[str, ...] = ("momentum_buffer",)

    @staticmethod
    def _momentum_buffer(group: dict[str, Any], param: Tensor, state: dict[str, Any]) -> Tensor:
        """``param``'s buffer, made at its first step: zeros, in the group's
        ``state_dtype`` where that is narrower (8-bit: the parameter's shape
        recorded beside it), and then a step count for the rounding's seed."""
        narrow = _state_dtype.narrow(group, param)
        if "momentum_buffer" not in state:
            dtype = group["state_dtype"] if narrow else None
            state["momentum_buffer"] = _state_dtype.zeros_state(param, dtype)
            if _state_dtype.eight_bit(dtype):
                state[_state_dtype.PARAM_SHAPE] = _state_dtype.shape_record(param)
        if narrow and "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float64)
        buffer: Tensor = state["momentum_buffer"]
        return buffer

    def _upgrade_step(self, group: dict[str, Any]) -> None:
        """A loaded step count (the rounding's seed) as :meth:`_momentum_buffer` makes it."""
        for p in group["params"]:
            p_state = self.state.get(p, {})  # type: ignore[attr-defined]
            if "step" in p_state:
                p_state["step"] = fresh_step(p_state["step"], dtype=torch.float64)


class QHOptimizer(NarrowStateOptimizer):
    """Plumbing shared by QHM and QHAdam: flags of older state dicts, gathering
    the parameters that have a gradient, and ``step`` over the param groups."""

    # The spelling of decoupled weight decay in qhoptim 1.1.0 and before: QHM's
    # ``weight_decay_type`` ("grad" | "direct"), QHAdam's ``decouple_weight_decay``.
    # qhoptim.torch reads it with a DeprecationWarning, qhoptim.pyt silently.
    _LEGACY_DECAY_KEY = ""
    _WARN_LEGACY = True

    @staticmethod
    def _decoupled_from_legacy(value: Any) -> bool:
        """The ``decoupled_weight_decay`` that the legacy setting ``value`` means."""
        raise NotImplementedError

    def _renamed(self, group: dict[str, Any], *, warn: bool) -> dict[str, Any]:
        """``group`` with its legacy weight-decay key read into ``decoupled_weight_decay``."""
        key = self._LEGACY_DECAY_KEY
        if key not in group:
            return group
        group = dict(group)
        value = group.pop(key)
        decoupled = self._decoupled_from_legacy(value)
        given = group.get("decoupled_weight_decay")
        if given is not None and given is not decoupled:
            # Both spellings, disagreeing: neither is silently dropped.
            raise ValueError(
                f"{key}={value!r} means decoupled_weight_decay={decoupled}, and "
                f"decoupled_weight_decay={given!r} was given too; give one"
            )
        if warn and self._WARN_LEGACY:
            warnings.warn(
                f"{type(self).__name__}: {key}={value!r} is deprecated; "
                f"use decoupled_weight_decay={decoupled}",
                DeprecationWarning,
                stacklevel=3,
            )
        group["decoupled_weight_decay"] = decoupled
        return group

    def _defaults_read(self, defaults: dict[str, Any], legacy: dict[str, Any]) -> dict[str, Any]:
        """A constructor's ``defaults`` with its 1.1.0 weight-decay keyword
        (``legacy``) read in; ``decoupled_weight_decay`` not given (None) is
        False. (The default is None, not False, so that a False given beside a
        legacy spelling that says otherwise is refused, not overridden.)"""
        defaults = self._renamed({**defaults, **legacy}, warn=True)
        if defaults["decoupled_weight_decay"] is None:
            defaults["decoupled_weight_decay"] = False
        return defaults

    def _upgrade_groups(self) -> None:
        for i, group in enumerate(self.param_groups):
            # Older state dicts (qhoptim 1.1.0's included) lack torch's flags.
            for flag, default in _TORCH_FLAGS.items():
                group.setdefault(flag, default)
            if "decoupled_weight_decay" not in group:  # a 1.1.0 group: its legacy key read
                group = self.param_groups[i] = self._renamed(group, warn=False)
            group.setdefault("decoupled_weight_decay", False)
            self._upgrade_group(group)

    def _upgrade_group(self, group: dict[str, Any]) -> None:
        """Fill in what an older state dict lacks in ``group`` and its state."""
        raise NotImplementedError

    @classmethod
    def _from_conversion(cls, params: Any, converted: Any, expected: type, **kwargs: Any) -> Any:
        validation.check_conversion(f"{cls.__name__}.from_params", converted, expected)
        return cls(params, **converted.as_kwargs(), **kwargs)

    def _check_switches(self, group: dict[str, Any]) -> None:
        """The group's switches: bools, or None where None picks a default (as
        torch leaves them unchecked, "False" would maximize and fused="no" fuse)."""
        decoupled = self._renamed(group, warn=False).get("decoupled_weight_decay", False)
        validation.check_bool(decoupled, "decoupled_weight_decay")
        for name in ("maximize", "capturable", "differentiable"):
            validation.check_bool(group.get(name, False), name)
        for name in ("foreach", "fused"):
            validation.check_optional_bool(group.get(name), name)
        if group.get("fused"):  # a group's own, as the defaults' (torch's wording)
            _fused.check_fused(
                [], foreach=group.get("foreach"), differentiable=group.get("differentiable", False)
            )

    def __init__(self, params: Any, defaults: dict[str, Any]) -> None:
        super().__init__(params, as_numbers(defaults))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if isinstance(param_group, dict):
            param_group = self._renamed(param_group, warn=True)
        self._check_group({**self.defaults, **param_group})
        if isinstance(param_group, dict):
            param_group = as_numbers(param_group)
        super().add_param_group(param_group)
        self._remember_checked(self.param_groups[-1])

    def _gather(self, group: dict[str, Any]) -> Gathered:
        """The group's params with a gradient, their grads and their states,
        checked: a sparse gradient, or a parameter a fused step cannot take,
        raises here, before any group has moved (``step`` gathers every group
        first, so that a failing step changes nothing). Nothing is made: a new
        parameter's state is made where its group steps."""
        # The step's host work is per parameter: each attribute read once, in
        # C where a map can (no bytecode per tensor), and nothing read that no
        # step uses (complex tensors are recognised per tensor where they
        # step, so the group's has_complex is not gathered).
        params: list[Tensor] = list(group["params"])  # the step's own list
        grads: list[Tensor] = list(map(_GRAD, params))
        if not all(map(operator.is_not, grads, itertools.repeat(None))):  # some have none
            params = [p for p, g in zip(params, grads, strict=True) if g is not None]
            grads = [g for g in grads if g is not None]
        if any(map(_IS_SPARSE, grads)):
            raise sparse_error(type(self).__name__)
        states: list[dict[str, Any] | None] = list(map(self.state.get, params))
        if not all(states):  # first steps: checked as where a group is made
            new = [p for p, p_state in zip(params, states, strict=True) if not p_state]
            if group["fused"]:  # as torch checks them
                for p in new:
                    _fused.check_fused_device(p)
            if group.get("state_dtype") is not None:  # one appended to the group's params
                _state_dtype.check_params(group["state_dtype"], new)
                dtensors = [p for p in new if local_shard(p) is not p]
                if dtensors:
                    self._check_narrow_dtensors(group, dtensors)
        return Gathered(params, grads, states)

    def _check_narrow_dtensors(self, group: dict[str, Any], params: list[Tensor]) -> None:
        """A narrow state of DTensor parameters (FSDP2, tensor parallelism)
        steps on their local shards in the fused kernel only; the working
        copies and the 8-bit state's blocks are made for whole tensors, and
        failed inside the step."""
        dtype, stochastic = group["state_dtype"], group.get("stochastic_rounding")
        fused = bool(group.get("fused")) or self._narrow_state_in_kernel(params, False)
        if dtype is torch.bfloat16 and _state_dtype.in_fused_kernel(
            fused, dtype, stochastic, params
        ):
            return
        raise ValueError(
            "a narrow state of DTensor parameters (FSDP2, tensor parallelism) steps in the "
            "fused kernel only: float32 parameters, state_dtype=torch.bfloat16 with stochastic "
            "rounding, on the CPU or with fused=True on CUDA; received "
            f"state_dtype={dtype}, stochastic_rounding={stochastic}, "
            f"a {params[0].dtype} parameter on {params[0].device}"
        )

    def _step_group(self, group: dict[str, Any], gathered: Gathered) -> None:
        """Step the group's ``gathered`` parameters (at least one) by their grads."""
        raise NotImplementedError

    def _setup_fused(self) -> None:
        """Check a ``fused=True`` optimizer's params; take GradScaler's scale and infs."""
        if self.defaults.get("fused"):
            _fused.check_fused(
                [p for g in self.param_groups for p in g["params"]],
                foreach=self.defaults["foreach"],
                differentiable=self.defaults["differentiable"],
            )
            # torch.amp.GradScaler then sets grad_scale and found_inf instead
            # of unscaling the gradients itself; the fused kernels read them.
            self._step_supports_amp_scaling = True

    def _step_dtype_and_device(self, group: dict[str, Any], p: Tensor) -> dict[str, Any]:
        """Where a new step count lives: on the parameter's device for capturable
        steps, else on the CPU, where the host reads it without a synchronization
        (fused steps compute their coefficients there); float32 for fused steps,
        as torch's."""
        dtype = torch.float32 if group["fused"] else scalar_dtype()
        if group["capturable"]:
            return {"dtype": dtype, "device": p.device}
        if group["fused"]:
            return {"dtype": dtype, "device": torch.device("cpu")}
        return {"dtype": dtype}

    @use_grad_for_differentiable
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Perform a single optimization step.

        Args:
            closure (Callable, optional): A closure that reevaluates the model
                and returns the loss.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        changes = self._check_changed_groups()
        self._check_amp_scaling()
        gathered = [self._gather(group) for group in self.param_groups]
        self._take_changes(changes)  # every check passed
        for group, group_gathered in zip(self.param_groups, gathered, strict=True):
            if group_gathered.params:  # else a frozen group: no gradient, nothing to step
                self._step_group(group, group_gathered)
        return loss

    def _check_amp_scaling(self) -> None:
        """Refuse GradScaler's ``grad_scale`` and ``found_inf`` where a group is not fused.

        An optimizer built ``fused=True`` tells ``torch.amp.GradScaler`` that its
        step unscales the gradients and skips a step with an inf itself, so
        GradScaler does neither and hands it ``grad_scale`` and ``found_inf``.
        Only the fused kernels read them: a group that is not fused (set so, or
        loaded from a checkpoint of a non-fused optimizer) would step by the
        scaled gradients and through infs. As torch's Adam, such a step is
        refused, before any group has moved.
        """
        if getattr(self, "grad_scale", None) is None and getattr(self, "found_inf", None) is None:
            return
        unfused = [i for i, group in enumerate(self.param_groups) if not group["fused"]]
        if unfused:
            raise RuntimeError(
                f"{type(self).__name__}: torch.amp.GradScaler handed this optimizer grad_scale "
                "and found_inf, which only its fused steps read, but param groups "
                f"{unfused} are not fused (fused=False or None); set fused=True on every "
                "group, or build the optimizer without fused=True so that GradScaler "
                "unscales the gradients itself"
            )


def _take(
    at: list[int],
    params: list[Tensor],
    grads: list[Tensor],
    state_lists: list[list[Tensor]],
    steps: list[Any],
) -> tuple[list[Tensor], list[Tensor], list[list[Tensor]], list[Any]]:
    """The entries ``at`` of a step's lists."""
    return (
        [params[i] for i in at],
        [grads[i] for i in at],
        [[lst[i] for i in at] for lst in state_lists],
        [steps[i] for i in at],
    )
