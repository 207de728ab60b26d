"""The package's layers: imports run one way, downwards, and never in a circle.

Read from the sources (no framework is imported): every ``import`` and
``from ... import`` inside ``qhoptim/``, at the top of a file or inside a
function alike. ``docs/design.md`` draws the same layers; :data:`LAYERS` is
their definition, held against the code here:

* no module of ``qhoptim`` reaches itself through imports (no circle);
* inside a backend package each module imports only modules on lower floors;
* the core imports no backend, and a backend takes from another backend only
  that backend's lower layers (:data:`SHARED`);
* every module of a layered package has its floor, so a new one must be placed.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "qhoptim"

#: Each layered package's modules by floor (1: the ground). A module imports
#: only modules on lower floors of its own package.
LAYERS: dict[str, dict[str, int]] = {
    "qhoptim.torch": {
        "_tensors": 1,  # tensor lists, flags, hyperparameter tuples
        "_extension": 1,  # building and loading csrc/fused_cpu.cpp
        "_kernels": 2,  # all tensor arithmetic (foreach, per-tensor, formulas)
        "_state_dtype": 2,  # narrow state: rounding, 8-bit, the narrow step loop
        "_triton": 3,  # CUDA kernels
        "_fused": 4,  # fused=True: C++ on CPU, Triton on CUDA
        "_state_dict": 3,  # state-dict checks
        "_optimizer": 5,  # the QHOptimizer base class
        "_qhm": 6,
        "_qhadam": 6,
        "_qhmuon": 6,
        "_timm": 7,
        "__init__": 8,
    },
    "qhoptim.keras": {
        "_settings": 1,  # TF_JIT_COMPILE, TORCH_FUSED, the backend
        "_step": 2,  # one variable's step in keras.ops
        "_narrow": 3,  # narrow slots
        "_tensorflow": 3,  # the XLA step
        "_torch": 3,  # every variable at once on qhoptim.torch's kernels
        "_base": 4,  # the shared base class and its backend mixin
        "_qhm": 5,
        "_qhadam": 5,
        "_qhmuon": 5,  # keras.optimizers.Muon's subclass
        "__init__": 6,
    },
    "qhoptim.mlx": {
        "_extension": 1,  # building and loading csrc/fused_cpu.cpp
        "_base": 2,  # narrow state, checked learning rate and state, the C++ step's call
        "_qhm": 3,
        "_qhadam": 3,
        "_qhmuon": 3,
        "__init__": 4,  # the public API
    },
    "qhoptim.optax": {
        "_extension": 1,  # building and registering csrc/state_cpu.cpp
        "_tree": 1,  # pytrees, dtypes, hyperparameters, bias corrections
        "_narrow": 2,  # narrow state in XLA's operations, EightBitArray
        "_state_step": 3,  # the C++ state step on the CPU, XLA's elsewhere
        "_qhm": 4,
        "_qhadam": 4,
        "_qhmuon": 4,
        "__init__": 5,  # the public API, from_params
    },
}

#: The backends: each is a module or package of ``qhoptim``; the rest is the core.
BACKENDS = ("qhoptim.torch", "qhoptim.pyt", "qhoptim.keras", "qhoptim.optax", "qhoptim.mlx")

#: What a backend may take from another: ``{importer: {backend: modules}}``.
#: Keras on torch steps on qhoptim.torch's lower layers, never on its optimizers;
#: ``qhoptim.pyt`` is qhoptim 1.1.0's path to qhoptim.torch's public classes.
SHARED: dict[str, dict[str, frozenset[str]]] = {
    "qhoptim.keras": {
        "qhoptim.torch": frozenset(
            f"qhoptim.torch.{m}"
            for m in ("_tensors", "_extension", "_kernels", "_state_dtype", "_fused")
        ),
    },
    "qhoptim.pyt": {"qhoptim.torch": frozenset({"qhoptim.torch"})},
}


def module_names(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package: dotted name -> file (a package by its ``__init__``)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def imports_of(source: str, module: str, package: bool, known: frozenset[str]) -> set[str]:
    """The ``qhoptim`` modules that ``source`` (of ``module``) imports, anywhere in it.

    ``from a import b`` is module ``a.b`` where that is a module, else ``a``
    (a name ``a`` defines). The implicit import of a module's parent packages
    is not an edge (every import system runs it; it is no dependency).
    Imports under ``if TYPE_CHECKING:`` are not run, and not counted.
    """
    tree = ast.parse(source)
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    here = module if package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.rsplit(".", node.level - 1)[0] if node.level > 1 else here
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in known else base)
    return {name for name in found if name == "qhoptim" or name.startswith("qhoptim.")}


def import_graph(modules: Mapping[str, Path]) -> dict[str, set[str]]:
    """``{module: the qhoptim modules it imports}`` (other than itself)."""
    known = frozenset(modules)
    graph = {}
    for name, path in modules.items():
        source = path.read_text(encoding="utf-8")
        found = imports_of(source, name, path.name == "__init__.py", known)
        graph[name] = {m for m in found if m in known and m != name}
    return graph


def circles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The import circles: the strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _backend(module: str) -> str | None:
    return next((b for b in BACKENDS if module == b or module.startswith(b + ".")), None)


def upward_imports(graph: Mapping[str, set[str]]) -> Iterator[str]:
    """Imports inside a layered package that do not go to a lower floor."""
    for package, floors in LAYERS.items():
        for name, floor in floors.items():
            module = package if name == "__init__" else f"{package}.{name}"
            for target in sorted(graph.get(module, ())):
                if target != package and not target.startswith(package + "."):
                    continue
                target_floor = floors.get(target.removeprefix(package).lstrip(".") or "__init__")
                if target_floor is None or target_floor >= floor:
                    yield f"{module} (floor {floor}) -> {target} (floor {target_floor})"


def crossings(graph: Mapping[str, set[str]]) -> Iterator[str]:
    """Imports of a backend by the core, or of another backend's modules beyond
    what :data:`SHARED` allows."""
    for module, targets in sorted(graph.items()):
        source = _backend(module)
        for target in sorted(targets):
            target_backend = _backend(target)
            if target_backend is None or target_backend == source:
                continue
            if source is None:
                yield f"the core's {module} -> {target}"
            elif target not in SHARED.get(source, {}).get(target_backend, frozenset()):
                yield f"{module} -> {target}, beyond {target_backend}'s shared layers"


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(module_names())


def test_no_module_of_qhoptim_imports_itself_in_a_circle(graph: dict[str, set[str]]) -> None:
    assert circles(graph) == []


def test_layered_packages_import_downwards_only(graph: dict[str, set[str]]) -> None:
    assert list(upward_imports(graph)) == []


def test_every_module_of_a_layered_package_has_its_floor() -> None:
    for package, floors in LAYERS.items():
        path = ROOT.joinpath(*package.split(".")[1:])
        names = {p.stem for p in path.glob("*.py")}
        assert names == set(floors), f"{package}: place {names - set(floors)} in LAYERS"


def test_the_core_imports_no_backend_and_backends_share_only_lower_layers(
    graph: dict[str, set[str]],
) -> None:
    assert list(crossings(graph)) == []


def test_keras_on_torch_steps_on_qhoptim_torch_lower_layers(graph: dict[str, set[str]]) -> None:
    # The one crossing there is, so that the check above has something to hold.
    assert "qhoptim.torch._state_dtype" in graph["qhoptim.keras._torch"]


# The checks themselves, on small packages written here: each fails as it should.
def _package(tmp_path: Path, files: dict[str, str]) -> dict[str, set[str]]:
    for relative, source in files.items():
        path = tmp_path / "qhoptim" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source), encoding="utf-8")
    return import_graph(module_names(tmp_path / "qhoptim"))


def test_a_circle_through_a_function_level_import_is_found(tmp_path: Path) -> None:
    graph = _package(
        tmp_path,
        {
            "__init__.py": "",
            "torch/__init__.py": "",
            "torch/_kernels.py": "from qhoptim.torch._optimizer import group\n",
            "torch/_optimizer.py": "def f():\n    from qhoptim.torch import _kernels\n",
        },
    )
    assert circles(graph) == [["qhoptim.torch._kernels", "qhoptim.torch._optimizer"]]


def test_an_import_of_a_higher_floor_is_found(tmp_path: Path) -> None:
    graph = _package(
        tmp_path,
        {
            "__init__.py": "",
            "torch/__init__.py": "",
            "torch/_tensors.py": "def f():\n    from qhoptim.torch import _qhm\n",
            "torch/_qhm.py": "",
        },
    )
    assert list(upward_imports(graph)) == [
        "qhoptim.torch._tensors (floor 1) -> qhoptim.torch._qhm (floor 6)"
    ]


def test_a_reach_into_another_backends_upper_layers_is_found(tmp_path: Path) -> None:
    graph = _package(
        tmp_path,
        {
            "__init__.py": "",
            "rules.py": "import qhoptim.optax\n",
            "optax.py": "",
            "torch/__init__.py": "",
            "torch/_optimizer.py": "",
            "torch/_kernels.py": "",
            "keras/__init__.py": "",
            "keras/_torch.py": (
                "from qhoptim.torch import _kernels\nfrom qhoptim.torch._optimizer import X\n"
            ),
        },
    )
    assert list(crossings(graph)) == [
        "qhoptim.keras._torch -> qhoptim.torch._optimizer, beyond qhoptim.torch's shared layers",
        "the core's qhoptim.rules -> qhoptim.optax",
    ]


def test_type_checking_imports_and_strings_are_not_imports() -> None:
    source = """
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from qhoptim.torch import _qhm
        DOC = "from qhoptim.torch import _optimizer"
    """
    known = frozenset({"qhoptim.torch._qhm", "qhoptim.torch._optimizer"})
    assert imports_of(textwrap.dedent(source), "qhoptim.rules", False, known) == set()
