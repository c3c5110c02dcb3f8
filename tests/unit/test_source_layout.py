"""The source tree keeps docs/design.md's layout rules: every module states its role in a docstring; no import cycles
among `src/corolla` modules; no private name (`_x`) imported across modules; `corolla` imported at module level (a
function-local import of a `corolla` module only where that module needs an optional dependency at its top); the
folders' import directions (`engine` never imports `server`, `client` never imports `server`, nothing in `src/`
imports the benchmarks or the tests, the engine's folders in layers, ...); and no benchmark imports test code. A change
that breaks one fails here, not in a later review."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
BENCHMARKS = SRC.parent / "benchmarks"
TEST_PACKAGES = ("tests", "helpers")  # how test code is imported (`tests.helpers.x`, or `helpers.x` from tests/)

# Folders still being cleaned by the server/engine/client redesign (issue 31): their modules may still import
# `corolla` inside functions or take private names from other modules, and cycles wholly inside them are tolerated.
# Every other folder is held to every rule now; the coordinator empties this set as their cleaning lands.
BEING_CLEANED: frozenset[str] = frozenset()

# Modules that may share their folder's name: `server.server` holds `Server`, the lifecycle of the whole folder
# (issue 31's server part is reshaping server/). Anywhere else a file named like its folder says nothing.
NAMED_LIKE_FOLDER: frozenset[str] = frozenset({"corolla.server.server"})

# Third-party packages that are optional (extras or platform-dependent): a `corolla` module importing one of them at
# its top may itself be imported inside a function, so that the rest of the package loads without it.
OPTIONAL_DEPENDENCIES = frozenset({"triton", "bitsandbytes", "playwright", "matplotlib", "peft", "speedtest"})

# (importing folder, imported package): directions the design forbids (docs/design.md, "Import rules"); "*" is any
# folder. Checked for every import, at any level, in every folder (the folders being cleaned included).
FORBIDDEN_IMPORTS: tuple[tuple[str, str], ...] = (
    ("engine", "corolla.server"),
    ("engine", "corolla.client"),
    ("client", "corolla.server"),
    ("protocol", "corolla.server"),
    ("protocol", "corolla.client"),
    ("swarm", "corolla.server"),
    ("swarm", "corolla.client"),
    ("models", "corolla.server"),
    ("models", "corolla.client"),
    ("models", "corolla.swarm"),
    ("*", "benchmarks"),
    *(("*", package) for package in TEST_PACKAGES),
)

# The engine's folders stand in layers (docs/design.md, "Layout"): the KV store at the bottom; kernels; quantized
# weights; routed experts and the decode step's ops (dispatching to kernels and quantized weights); span models; CUDA
# graphs; the engine's API at its top. A folder never imports one above it, nor one beside it.
_ENGINE_TOP = tuple(
    f"corolla.engine.{m}" for m in ("config", "serving", "span_engine", "step_request", "batcher", "graph_decode")
)
_ENGINE_LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("engine/kv", ("kernels", "quant", "moe", "ops", "spans", "graphs")),
    ("engine/kernels", ("kv", "quant", "moe", "ops", "spans", "graphs")),
    ("engine/quant", ("kv", "moe", "ops", "spans", "graphs")),
    ("engine/moe", ("kv", "ops", "spans", "graphs")),
    ("engine/ops", ("kv", "moe", "spans", "graphs")),
    ("engine/spans", ("graphs",)),
)
FORBIDDEN_IMPORTS += tuple(
    (folder, target)
    for folder, above in _ENGINE_LAYERS
    for target in (*(f"corolla.engine.{a}" for a in above), *_ENGINE_TOP)
) + tuple(("engine/graphs", target) for target in _ENGINE_TOP)

# The client's folders stand in layers too (corolla/client/__init__.py), from the streams to a server up to the
# distributed models; each imports only folders before it in this list (and `client.config`, `client.background_loop`).
_CLIENT_LAYERS = (
    "transport",
    "prefix",
    "routing",
    "calls",
    "verification",
    "session",
    "training",
    "speculative",
    "models",
)
FORBIDDEN_IMPORTS += tuple(
    (f"client/{folder}", f"corolla.client.{above}")
    for i, folder in enumerate(_CLIENT_LAYERS)
    for above in _CLIENT_LAYERS[i + 1 :]
)


@dataclass
class Import:
    target: str  # the dotted module (or package) named
    names: tuple[str, ...]  # names taken from it (`from target import a, b`); () for `import target`
    line: int
    module_level: bool  # at the module's top (not in a function or class body); TYPE_CHECKING blocks count as top
    type_checking: bool  # under `if TYPE_CHECKING:` (never executed at run time)


@dataclass
class Module:
    name: str  # dotted, e.g. corolla.server.core.runtime
    path: Path
    folder: str  # the first folder under corolla/ ("" for modules directly in it)
    folders: str  # every folder under corolla/, e.g. "engine/kv" ("" for modules directly in it)
    is_package: bool
    has_docstring: bool
    imports: list[Import] = field(default_factory=list)
    top_level_packages: set[str] = field(default_factory=set)  # first names of what it imports at its top, at run time


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _absolute(module: Module, level: int, target: str | None) -> str:
    base = module.name.split(".")
    base = base if module.is_package else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, target] if target else base)


def _collect(module: Module, tree: ast.Module) -> None:
    def visit(nodes: list[ast.stmt], module_level: bool, type_checking: bool) -> None:
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                if isinstance(node, ast.Import):
                    found = [(alias.name, ()) for alias in node.names]
                else:
                    target = _absolute(module, node.level, node.module) if node.level else node.module or ""
                    found = [(target, tuple(alias.name for alias in node.names))]
                for target, names in found:
                    module.imports.append(Import(target, names, node.lineno, module_level, type_checking))
                    if module_level and not type_checking:
                        module.top_level_packages.add(target.split(".")[0])
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(node.body, False, type_checking)
            elif isinstance(node, ast.If):
                visit(node.body, module_level, type_checking or _is_type_checking(node.test))
                visit(node.orelse, module_level, type_checking)
            else:  # with, try, for, while, match: their bodies run where the statement does
                for name in ("body", "orelse", "finalbody", "handlers", "cases"):
                    for child in getattr(node, name, None) or []:
                        body = child.body if isinstance(child, (ast.ExceptHandler, ast.match_case)) else [child]
                        visit([s for s in body if isinstance(s, ast.stmt)], module_level, type_checking)

    visit(tree.body, True, False)


def read_tree(src: Path) -> dict[str, Module]:
    """Every module of the `corolla` package under `src`, by dotted name."""
    modules = {}
    for path in sorted((src / "corolla").rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
        folder = parts[1] if len(parts) > 2 else ""
        folders = "/".join(parts[1:-1])
        has_docstring = not text.strip() or ast.get_docstring(tree) is not None
        module = Module(name, path, folder, folders, is_package, has_docstring)
        _collect(module, tree)
        modules[name] = module
    return modules


def _targets(imp: Import, modules: dict[str, Module]) -> list[str]:
    """The corolla modules an import names: `from pkg import sub` names the submodule, `from mod import x` the
    module (a package's `__init__` for a name it defines)."""
    found = [f"{imp.target}.{n}" for n in imp.names if f"{imp.target}.{n}" in modules]
    if (len(found) < len(imp.names) or not imp.names) and imp.target in modules:
        found.append(imp.target)
    return found


def cycles(modules: dict[str, Module]) -> list[list[str]]:
    """Groups of modules that import each other in a loop (strongly connected, or a module importing itself) in the
    graph of module-level imports; TYPE_CHECKING imports count: a type-only loop still ties two modules together."""
    graph = {
        name: sorted({t for imp in m.imports if imp.module_level for t in _targets(imp, modules)})
        for name, m in modules.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph[v]:
                groups.append(sorted(group))

    for v in graph:
        if v not in index:
            connect(v)
    return sorted(groups)


def violations(src: Path = SRC, being_cleaned: frozenset[str] = BEING_CLEANED) -> list[str]:
    """Every broken rule in the tree under `src`, one line each."""
    modules = read_tree(src)
    found = []
    for name, m in modules.items():
        where = str(m.path.relative_to(src))
        if not m.has_docstring:
            found.append(f"{where}: no module docstring stating its role")
        named_like_folder = m.folders and name.rsplit(".", 1)[-1] == m.folders.rsplit("/", 1)[-1]
        if named_like_folder and not m.is_package and name not in NAMED_LIKE_FOLDER:
            found.append(f"{where}: named like its folder: name the concept it holds")
        for imp in m.imports:
            for folder, forbidden in FORBIDDEN_IMPORTS:
                inside = folder in ("*", m.folder) or f"{m.folders}/".startswith(f"{folder}/")
                named = [imp.target, *(f"{imp.target}.{n}" for n in imp.names)]  # `from pkg import module` too
                if inside and any(t == forbidden or t.startswith(forbidden + ".") for t in named):
                    label = m.folder if folder == "*" else folder
                    found.append(f"{where}:{imp.line}: {label or 'corolla'}/ must not import {imp.target}")
            if imp.target.split(".")[0] != "corolla" or m.folder in being_cleaned:
                continue
            private = [n for n in imp.names if n.startswith("_") and not n.startswith("__")]
            private = [n for n in private if f"{imp.target}.{n}" not in modules]  # a module named _x is no secret
            if private and imp.target != name:
                found.append(f"{where}:{imp.line}: imports private {', '.join(private)} from {imp.target}")
            if not imp.module_level:
                targets = _targets(imp, modules)
                if not any(modules[t].top_level_packages & OPTIONAL_DEPENDENCIES for t in targets):
                    found.append(f"{where}:{imp.line}: function-local import of {imp.target}: import it at the top")
    for group in cycles(modules):
        if not all(modules[n].folder in being_cleaned for n in group):
            found.append("import cycle: " + " -> ".join(group))
    return found


def test_the_source_tree_keeps_the_layout_rules() -> None:
    assert len(list((SRC / "corolla").rglob("*.py"))) > 100, f"expected the corolla package under {SRC}"
    problems = violations()
    assert not problems, "\n".join(problems)


def test_the_benchmarks_import_no_test_code() -> None:
    """A benchmark drives the product's own surfaces and `benchmarks/common`: what benchmarks and tests both need
    (e.g. `benchmarks.common.quantize`) lives there, where tests may import it; never a benchmark on tests/helpers."""
    found = []
    for path in sorted(BENCHMARKS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                targets = [node.module or ""]
            else:
                continue
            where = f"{path.relative_to(SRC.parent)}:{node.lineno}"
            found += [f"{where}: imports {t}" for t in targets if t.split(".")[0] in TEST_PACKAGES]
    assert len(list(BENCHMARKS.rglob("*.py"))) > 50, f"expected the benchmarks under {BENCHMARKS}"
    assert not found, "\n".join(found)


def test_every_folder_being_cleaned_exists() -> None:
    """An entry of BEING_CLEANED that names no folder is stale: drop it."""
    assert {p.name for p in (SRC / "corolla").iterdir() if p.is_dir()} >= BEING_CLEANED


# ---- the checker catches each kind of violation (trees written under tmp_path)

DOC = '"""Role."""\n'


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / "corolla" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for folder in {p.parent for p in (root / "corolla").rglob("*.py")}:
        if not (folder / "__init__.py").exists():
            (folder / "__init__.py").write_text(DOC)
    return root


def test_a_clean_tree_passes(tmp_path: Path) -> None:
    src = _tree(tmp_path, {"utils/a.py": DOC + "x = 1\n", "wan/b.py": DOC + "from corolla.utils.a import x\n"})
    assert violations(src, frozenset()) == []


def test_catches_a_module_without_docstring(tmp_path: Path) -> None:
    src = _tree(tmp_path, {"utils/a.py": "x = 1\n"})
    assert violations(src, frozenset()) == ["corolla/utils/a.py: no module docstring stating its role"]


def test_catches_an_import_cycle(tmp_path: Path) -> None:
    a = DOC + "from corolla.utils.b import y\nx = 1\n"
    src = _tree(tmp_path, {"utils/a.py": a, "utils/b.py": DOC + "from corolla.utils import a\ny = 2\n"})
    assert violations(src, frozenset()) == ["import cycle: corolla.utils.a -> corolla.utils.b"]


def test_a_type_only_cycle_counts_and_one_inside_folders_being_cleaned_is_tolerated(tmp_path: Path) -> None:
    type_only = DOC + "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from corolla.utils.b import y\n"
    src = _tree(tmp_path / "t", {"utils/a.py": type_only, "utils/b.py": DOC + "from corolla.utils import a\ny = 2\n"})
    assert violations(src, frozenset()) == ["import cycle: corolla.utils.a -> corolla.utils.b"]
    c, d = DOC + "from corolla.server.d import y\nx = 1\n", DOC + "from corolla.server.c import x\ny = 2\n"
    src = _tree(tmp_path / "s", {"server/c.py": c, "server/d.py": d})
    assert violations(src, frozenset({"server"})) == []
    assert violations(src, frozenset()) == ["import cycle: corolla.server.c -> corolla.server.d"]


def test_catches_a_private_name_imported_across_modules(tmp_path: Path) -> None:
    files = {"utils/a.py": DOC + "_secret = 1\n", "wan/b.py": DOC + "from corolla.utils.a import _secret\n"}
    src = _tree(tmp_path, files)
    assert violations(src, frozenset()) == ["corolla/wan/b.py:2: imports private _secret from corolla.utils.a"]
    assert violations(src, frozenset({"wan"})) == []


@pytest.mark.parametrize("optional", [False, True])
def test_catches_a_function_local_corolla_import_unless_it_needs_an_optional_dependency(
    tmp_path: Path, optional: bool
) -> None:
    kernels = DOC + ("import triton\n" if optional else "import math\n")
    local = DOC + "def f():\n    from corolla.utils import kernels\n    return kernels\n"
    src = _tree(tmp_path, {"utils/kernels.py": kernels, "api/b.py": local})
    expected = [] if optional else ["corolla/api/b.py:3: function-local import of corolla.utils: import it at the top"]
    assert violations(src, frozenset()) == expected
    assert violations(src, frozenset({"api"})) == []


@pytest.mark.parametrize(
    ("importer", "imported"),
    [
        ("engine/a.py", "corolla.server.x"),
        ("client/a.py", "corolla.server.x"),
        ("protocol/a.py", "corolla.client.x"),
        ("swarm/a.py", "corolla.server.x"),
        ("models/a.py", "corolla.swarm.x"),
        ("utils/a.py", "benchmarks.x"),
        ("api/a.py", "tests.helpers.x"),
    ],
)
def test_catches_a_forbidden_direction_even_in_a_folder_being_cleaned(
    tmp_path: Path, importer: str, imported: str
) -> None:
    src = _tree(tmp_path, {importer: DOC + f"def f():\n    import {imported}\n"})
    folder = importer.split("/")[0]
    assert f"corolla/{importer}:3: {folder}/ must not import {imported}" in violations(src, frozenset({folder}))


def test_catches_a_module_named_like_its_folder(tmp_path: Path) -> None:
    src = _tree(tmp_path, {"engine/quant/quant.py": DOC, "engine/quant/quant_gemv.py": DOC, "utils.py": DOC})
    assert violations(src, frozenset()) == [
        "corolla/engine/quant/quant.py: named like its folder: name the concept it holds"
    ]


@pytest.mark.parametrize(
    ("importer", "imported", "layer"),
    [
        ("engine/kv/a.py", "corolla.engine.spans.x", "engine/kv"),
        ("engine/kernels/a.py", "corolla.engine.quant.x", "engine/kernels"),
        ("engine/quant/a.py", "corolla.engine.ops.x", "engine/quant"),
        ("engine/quant/a.py", "corolla.engine.moe.x", "engine/quant"),
        ("client/routing/a.py", "corolla.client.calls.x", "client/routing"),
        ("client/session/a.py", "corolla.client.models.x", "client/session"),
        ("engine/spans/a.py", "corolla.engine.span_engine", "engine/spans"),
        ("engine/graphs/a.py", "corolla.engine.batcher", "engine/graphs"),
    ],
)
def test_catches_a_folder_importing_a_layer_above_it(tmp_path: Path, importer: str, imported: str, layer: str) -> None:
    src = _tree(tmp_path, {importer: DOC + f"import {imported}\n"})
    assert violations(src, frozenset()) == [f"corolla/{importer}:2: {layer}/ must not import {imported}"]
    below = _tree(tmp_path / "ok", {"engine/spans/a.py": DOC + "import corolla.engine.kv.x\n"})
    assert violations(below, frozenset()) == []
