"""qhoptim.torch uses torch's public API, and only the few private names it lists.

The sources of ``qhoptim.torch`` (and ``qhoptim.pyt``) are scanned: a private
torch name -- imported (``from torch.optim.optimizer import _get_value``,
``import torch._dynamo``), reached through a torch object
(``torch._C._get_privateuse1_backend_name``,
``Optimizer._group_tensors_by_device_and_dtype``), or a private attribute that
torch's optimizers and tensors have (``self._optimizer_step_pre_hooks``) -- must
be in :data:`ALLOWED`, which mirrors the comment block in
``qhoptim/torch/_tensors.py``; and each allowed name must still be used, so
that the list stays short and true. The second half checks that qhoptim's own
equivalents of torch's private helpers agree with them, where torch has them.
"""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.optim.optimizer as torch_optimizer

import qhoptim
import qhoptim.torch
from qhoptim.torch import _tensors

# Every private torch name qhoptim.torch may use, and why (see _tensors.py).
_FOREACH = "torch's multi-tensor ops: documented (beta) under this spelling only"
ALLOWED: dict[str, str] = {
    "torch.optim.optimizer.Optimizer._group_tensors_by_device_and_dtype": (
        "C++ grouping by device and dtype; a Python one with its checks slows the step"
    ),
    "torch._C": (
        "its _group_tensors_by_device_and_dtype alone: the same grouping outside "
        "torch.compile, without a no_grad context per step"
    ),
    "._optimizer_load_state_dict_pre_hooks": (
        "the load pre-hooks run before qhoptim's checks; torch has no public accessor"
    ),
    "._step_supports_amp_scaling": "GradScaler's protocol for fused steps",
    **{
        f"torch._foreach_{op}": _FOREACH
        for op in (
            "abs",
            "add",
            "add_",
            "addcdiv_",
            "addcmul",
            "addcmul_",
            "div_",
            "lerp_",
            "maximum_",
            "mul",
            "mul_",
            "neg",
            "sqrt",
            "sqrt_",
            "sub_",
        )
    },
}

# Where the private names other than the foreach ops may appear: the two modules
# that wrap torch.optim, the bottom layer (tensor lists; the allowlist's comment
# is there) and the optimizer base class (attributes of torch's Optimizer).
_LIST_PLACE = "_tensors.py"
_PLACES = frozenset({_LIST_PLACE, "_optimizer.py"})

_PACKAGE = Path(qhoptim.torch.__file__).parent
SOURCES = [
    *sorted(_PACKAGE.glob("*.py")),
    *sorted((Path(qhoptim.__file__).parent / "pyt").glob("*.py")),
]

# (major, minor) of the installed torch: some comparisons differ on old releases.
_TORCH_VERSION = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _torch_private_attributes() -> frozenset[str]:
    """The private attributes of torch's optimizers and tensors: any use of one of
    these names as an attribute counts as a private torch name, whatever the object."""
    param = torch.nn.Parameter(torch.zeros(2))
    names = set(dir(torch.optim.Optimizer)) | set(dir(torch.Tensor)) | set(dir(param))
    names |= set(vars(torch.optim.SGD([param], lr=0.1)))
    # The flag torch's fused optimizers set for torch.amp.GradScaler.
    names.add("_step_supports_amp_scaling")
    return frozenset(n for n in names if _private(n))


TORCH_PRIVATE_ATTRIBUTES = _torch_private_attributes()


class _Scanner(ast.NodeVisitor):
    """Collects the private torch names a module's source uses."""

    def __init__(self) -> None:
        self.bound: dict[str, str] = {}  # local name -> the torch path it is bound to
        self.found: set[str] = set()

    def _path(self, node: ast.expr) -> str | None:
        """The dotted torch path of ``torch.a.b`` / ``alias.b`` (None if not torch's)."""
        if isinstance(node, ast.Name):
            return self.bound.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self._path(node.value)
            return None if base is None else f"{base}.{node.attr}"
        return None

    def _note_path(self, path: str) -> None:
        """Record ``path`` up to and including its first private component."""
        parts = path.split(".")
        for i, part in enumerate(parts):
            if _private(part):
                self.found.add(".".join(parts[: i + 1]))
                return

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] != "torch":
                continue
            self._note_path(alias.name)
            if alias.asname:
                self.bound[alias.asname] = alias.name
            else:
                self.bound["torch"] = "torch"

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if node.level or module.split(".")[0] != "torch":
            return
        for alias in node.names:
            path = f"{module}.{alias.name}"
            self._note_path(path)
            self.bound[alias.asname or alias.name] = path

    def visit_Assign(self, node: ast.Assign) -> None:
        self.generic_visit(node)
        path = self._path(node.value)
        if path is not None:  # an alias: ``o = torch.optim``
            for target in node.targets:
                if isinstance(target, ast.Name):
                    self.bound[target.id] = path

    def visit_Attribute(self, node: ast.Attribute) -> None:
        path = self._path(node)
        if path is not None:
            self._note_path(path)
        elif node.attr in TORCH_PRIVATE_ATTRIBUTES:
            self.found.add(f".{node.attr}")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        # getattr(x, "_name"), hasattr, setattr, delattr with a literal name.
        func = node.func
        if (
            isinstance(func, ast.Name)
            and func.id in {"getattr", "hasattr", "setattr", "delattr"}
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            name = node.args[1].value
            path = self._path(node.args[0])
            if path is not None:
                self._note_path(f"{path}.{name}")
            elif name in TORCH_PRIVATE_ATTRIBUTES:
                self.found.add(f".{name}")
        self.generic_visit(node)


def private_torch_names(source: str) -> set[str]:
    tree = ast.parse(source)
    scanner = _Scanner()
    # Imports first (wherever they are), so that uses before a local import count.
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            scanner.visit(node)
    scanner.visit(tree)
    return scanner.found


def _uses() -> dict[str, set[str]]:
    """Each private torch name qhoptim.torch uses -> the files that use it."""
    uses: dict[str, set[str]] = {}
    for path in SOURCES:
        for name in private_torch_names(path.read_text(encoding="utf-8")):
            uses.setdefault(name, set()).add(path.name)
    return uses


def test_the_sources_are_found() -> None:
    names = {p.name for p in SOURCES}
    assert {"_tensors.py", "_optimizer.py", "_qhm.py", "_qhadam.py", "_kernels.py"} <= names
    assert {"qhm.py", "qhadam.py"} <= names  # qhoptim/pyt/, 1.1.0's modules


def test_only_listed_private_torch_names_are_used() -> None:
    uses = _uses()
    unlisted = {name: sorted(files) for name, files in uses.items() if name not in ALLOWED}
    assert not unlisted, (
        "qhoptim.torch uses private torch names that are not listed; use public API, or "
        f"write qhoptim's own equivalent in _tensors.py: {unlisted}"
    )


def test_every_listed_private_name_is_still_used() -> None:
    unused = sorted(set(ALLOWED) - set(_uses()))
    assert not unused, f"no longer used; drop them from ALLOWED and _tensors.py: {unused}"


def test_private_names_other_than_foreach_ops_are_reached_in_their_two_places() -> None:
    elsewhere = {
        name: sorted(files - _PLACES)
        for name, files in _uses().items()
        if not name.startswith("torch._foreach_") and files - _PLACES
    }
    assert not elsewhere, f"reach these through {sorted(_PLACES)}: {elsewhere}"


def test_the_allowlist_is_the_one_in_the_bottom_layers_comment() -> None:
    text = (_PACKAGE / _LIST_PLACE).read_text(encoding="utf-8")
    for name in ALLOWED:
        if name.startswith("torch._foreach_"):
            name = "torch._foreach_*"
        elif name.startswith("torch.optim.optimizer."):
            name = name.removeprefix("torch.optim.optimizer.")
        else:
            name = name.lstrip(".")
        assert f"``{name}``" in text or f"``Optimizer.{name}``" in text, name


# The scanner itself: each way of reaching a private torch name is caught.
_OPT = "torch.optim.optimizer"
_OPTIMIZER = "torch.optim.Optimizer"
_CAUGHT = [
    (f"from {_OPT} import _get_value", f"{_OPT}._get_value"),
    (f"from {_OPT} import Optimizer, _to_scalar as s", f"{_OPT}._to_scalar"),
    ("import torch._dynamo", "torch._dynamo"),
    ("import torch\ntorch._dynamo.graph_break()", "torch._dynamo"),
    ("import torch as t\nt._C._get_privateuse1_backend_name()", "torch._C"),
    ("from torch import _C", "torch._C"),
    ("from torch.utils._foreach_utils import Indices", "torch.utils._foreach_utils"),
    (f"import {_OPT} as o\no._default_to_fused_or_foreach", f"{_OPT}._default_to_fused_or_foreach"),
    (f"import torch\no = {_OPT}\no._get_scalar_dtype()", f"{_OPT}._get_scalar_dtype"),
    (f"import torch\n{_OPTIMIZER}._patch_step_function", f"{_OPTIMIZER}._patch_step_function"),
    ("def f(self):\n    return self._optimizer_step_pre_hooks", "._optimizer_step_pre_hooks"),
    ("def f(t):\n    return t._version", "._version"),
    ("def f(opt):\n    return getattr(opt, '_zero_grad_profile_name')", "._zero_grad_profile_name"),
    ("import torch\ngetattr(torch, '_foreach_exp_')", "torch._foreach_exp_"),
    (f"def f():\n    from {_OPT} import _params_doc\n    return 1", f"{_OPT}._params_doc"),
]  # fmt: skip


@pytest.mark.parametrize(("source", "expected"), _CAUGHT, ids=[e for _, e in _CAUGHT])
def test_the_scanner_catches_private_names(source: str, expected: str) -> None:
    assert expected in private_torch_names(textwrap.dedent(source))


def test_the_scanner_lets_public_and_own_names_pass() -> None:
    source = """
        import torch
        from torch import Tensor
        from torch.optim.optimizer import Optimizer, ParamsT, required
        from qhoptim.torch import _kernels

        class QH(Optimizer):
            def _own(self):
                return self._renamed, torch.__version__, torch.compiler.is_compiling()
    """
    assert private_torch_names(textwrap.dedent(source)) == set()


# ------------------------------------------- qhoptim's equivalents agree with torch's
def _torch_helper(name: str) -> object:
    helper = getattr(torch_optimizer, name, None)
    if helper is None:
        pytest.skip(f"this torch has no torch.optim.optimizer.{name}")
    return helper


@pytest.mark.parametrize(
    "lr",
    [0.1, 3, torch.tensor(0.5), torch.tensor([0.5]), torch.tensor([[0.25]]), torch.ones(1, 1, 1)],
    ids=str,
)
def test_scalar_lr_is_torchs_to_scalar(lr: object) -> None:
    to_scalar = _torch_helper("_to_scalar")
    got, want = _tensors.scalar_lr(lr), to_scalar(lr)  # type: ignore[operator]
    assert type(got) is type(want)
    if isinstance(want, torch.Tensor):
        assert got.shape == want.shape and torch.equal(got, want)
        assert got.data_ptr() == want.data_ptr()  # a view, as torch's
    else:
        assert got == want


@pytest.mark.parametrize("x", [torch.tensor(3.0), torch.tensor(7, dtype=torch.int64), 2.0, 5])
def test_value_of_is_torchs_get_value(x: object) -> None:
    get_value = _torch_helper("_get_value")
    if not isinstance(x, torch.Tensor) and _TORCH_VERSION < (2, 4):
        pytest.skip("torch < 2.4's _get_value calls .item() on Python numbers too")
    got, want = _tensors.value_of(x), get_value(x)  # type: ignore[operator]
    assert type(got) is type(want) and got == want


@pytest.mark.parametrize("default", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_scalar_dtype_is_torchs_get_scalar_dtype(default: torch.dtype) -> None:
    get_scalar_dtype = _torch_helper("_get_scalar_dtype")
    before = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        assert _tensors.scalar_dtype() == get_scalar_dtype()  # type: ignore[operator]
    finally:
        torch.set_default_dtype(before)


def _torch_default(params: list[torch.Tensor], differentiable: bool) -> bool:
    """The default foreach as qhoptim took it from torch's helper before: torch's
    rule, and foreach for plain tensors all on CPU too."""
    default_to_fused_or_foreach = _torch_helper("_default_to_fused_or_foreach")
    _, foreach = default_to_fused_or_foreach(params, differentiable, use_fused=False)  # type: ignore[operator]
    if foreach or differentiable:
        return bool(foreach)
    supported = torch_optimizer._foreach_supported_types
    return all(type(p) in supported and p.device.type == "cpu" for p in params)


class _Subclass(torch.Tensor):
    pass


def _cases() -> list[tuple[str, list[torch.Tensor]]]:
    cpu = [torch.zeros(2), torch.nn.Parameter(torch.zeros(3))]
    meta = [torch.empty(2, device="meta")]
    sub = torch.zeros(2).as_subclass(_Subclass)
    return [
        ("empty", []),
        ("cpu", cpu),
        ("meta", meta),
        ("cpu+meta", cpu + meta),
        ("subclass", [sub]),
        ("cpu+subclass", [*cpu, sub]),
        ("complex", [torch.zeros(2, dtype=torch.complex64)]),
    ]


@pytest.mark.parametrize("differentiable", [False, True])
@pytest.mark.parametrize(("name", "params"), _cases(), ids=[n for n, _ in _cases()])
def test_default_foreach_is_unchanged(
    name: str, params: list[torch.Tensor], differentiable: bool
) -> None:
    assert _tensors.default_foreach(params, differentiable) is _torch_default(
        params, differentiable
    )


@pytest.mark.parametrize(
    "device_type", ["cuda", "xpu", "mtia", "cpu", "meta", "mps", "hpu", "xla", "privateuseone"]
)
def test_foreach_devices_are_torchs(device_type: str) -> None:
    from torch.utils import _foreach_utils

    supported = getattr(_foreach_utils, "_get_foreach_kernels_supported_devices", None)
    if supported is None:
        pytest.skip("this torch has no _get_foreach_kernels_supported_devices")
    if device_type == "mtia" and "mtia" not in supported():
        pytest.skip("this torch predates multi-tensor kernels on MTIA (qhoptim follows 2.13)")
    assert _tensors._is_foreach_device(device_type) is (device_type in supported())


def test_foreach_types_are_torchs() -> None:
    if torch.distributed.is_available():
        importlib.import_module("torch.distributed.tensor")  # adds DTensor to torch's list

    supported = getattr(torch_optimizer, "_foreach_supported_types", None)
    if supported is None:
        pytest.skip("this torch has no torch.optim.optimizer._foreach_supported_types")
    assert all(_tensors._is_foreach_type(cls) for cls in supported)
    assert {cls.__name__ for cls in supported} >= {"Tensor", "Parameter"}
    impostor = type("DTensor", (torch.Tensor,), {"__module__": "elsewhere"})
    for cls in (_Subclass, impostor, torch.nn.parameter.UninitializedParameter, int):
        assert cls not in supported
        assert not _tensors._is_foreach_type(cls)


def test_a_renamed_privateuse1_backend_is_a_foreach_device() -> None:
    # Renaming is once per process, so in a fresh one.
    code = """
        import torch
        from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices
        from qhoptim.torch import _tensors

        torch.utils.rename_privateuse1_backend("qhtestdev")
        assert "qhtestdev" in _get_foreach_kernels_supported_devices()
        assert _tensors._is_foreach_device("qhtestdev")
        assert not _tensors._is_foreach_device("privateuseone")
    """
    root = str(Path(qhoptim.__file__).parent.parent)
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": root},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr


def test_step_runs_with_grad_only_when_differentiable() -> None:
    seen = []

    class Probe(qhoptim.torch.QHM):
        def _step_group(self, group: dict[str, object], *lists: object) -> None:
            seen.append(torch.is_grad_enabled())

    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.ones(2)  # a group without gradients is not stepped
    for differentiable in (False, True):
        opt = Probe([p], lr=0.1, differentiable=differentiable)
        with torch.enable_grad():
            opt.step()
        with torch.no_grad():
            opt.step()
        assert torch.is_grad_enabled()
    assert seen == [False, False, True, True]
    assert qhoptim.torch.QHM.step.__name__ == "step"
    assert "closure" in (qhoptim.torch.QHM.step.__doc__ or "")
