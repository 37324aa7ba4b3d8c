"""The house's folders import in layers (docs/overview.md, "Layers"): a folder of
`moetrain/` imports only the folders below its own (`LAYERS`), at the top of a file or
inside a function alike (a lazy import is no way around the order); no import cycle and
no private name (`_x`) imported across files anywhere in `moetrain/`; and the planner's
files import only the layers below their own. Static: read with `ast`, nothing imported,
so it takes a second.

A private name crosses a file when it is imported from another file or read as an
attribute of another file's module. Every import counts, at the top of a file, inside a function (a lazy import closes a
cycle all the same, once both run) or under `TYPE_CHECKING`. An import of `a.b.c` is an
edge to the file of `a.b.c` (its `__init__.py` for a package); `from a.b import c` is an
edge to `a.b.c` where that is a module of the repository, else to `a.b`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("moetrain",)

# The folders of moetrain/, bottom to top: a module imports modules of its own layer or
# below, never above (a prefix names a folder or a file).
LAYERS = {
    "models": ["moetrain.models"],
    "parallelisms": ["moetrain.parallelisms"],
    "config": ["moetrain.config"],
    "base": ["moetrain.errors", "moetrain.fileio", "moetrain"],
    "data": ["moetrain.data"],
    "metrics": ["moetrain.metrics"],
    "hf": ["moetrain.hf"],
    "build": ["moetrain.build"],
    "checkpoint": ["moetrain.checkpoint"],
    "loop": ["moetrain.loop", "moetrain.train"],
    "tools": [
        "moetrain.prepare",
        "moetrain.planner",
        "moetrain.evaluate",
        "moetrain.generate",
        "moetrain.export",
    ],
}

# The planner room, bottom to top (docs/overview.md): a file imports files of its own
# layer or below, never above.
PLANNER_LAYERS = {
    "hardware": ["hardware"],
    "costs": [
        "a2a_cost",
        "objective_cost",
        "pipeline_schedule",
        "pipeline_cost",
        "recompute_cost",
        "step_cost",
    ],
    "measurement": [
        "meta_trace",
        "footprint",
        "activation_trace",
        "model_counts",
        "shards",
        "traces",
        "pipeline_stages",
        "workers",
    ],
    "layout": ["layout_cost"],
    "search": ["search"],
    "cli": ["flags", "report", "cli", "__main__", "__init__"],
}


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _files() -> dict[str, Path]:
    """module name -> its file, for every Python file of the rooms."""
    return {_module_of(p): p for room in ROOMS for p in sorted((ROOT / room).rglob("*.py"))}


def _in_functions(tree: ast.AST) -> set[int]:
    """The ids of the import statements inside a function (lazy imports)."""
    functions = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
    return {
        id(node)
        for f in ast.walk(tree)
        if isinstance(f, functions)
        for node in ast.walk(f)
        if isinstance(node, (ast.Import, ast.ImportFrom))
    }


def _imports(module: str, path: Path, known: set[str]) -> list[tuple[str, list[str], int]]:
    """(imported module of the repository, names taken from it, line) for every import, and
    for every attribute read off an imported module (`reader._chunks` after `from
    moetrain.data import reader`: the name `_chunks` taken from `moetrain.data.reader`)."""
    return [(target, names, line) for target, names, line, _ in _lazy_imports(module, path, known)]


def _lazy_imports(
    module: str, path: Path, known: set[str]
) -> list[tuple[str, list[str], int, bool]]:
    """`_imports`, each with whether it sits inside a function."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    lazy = _in_functions(tree)
    out = []
    bound: dict[str, str] = {}  # a local name -> the module of the repository it is
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [
                (a.name, [], node.lineno, id(node) in lazy) for a in node.names if a.name in known
            ]
            bound.update({a.asname: a.name for a in node.names if a.asname and a.name in known})
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, `level - 1` packages up
                up = package.split(".")
                base = ".".join(up[: len(up) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in known:  # `from package import module`
                    out.append((sub, [], node.lineno, id(node) in lazy))
                    bound[a.asname or a.name] = sub
                elif base in known:
                    out.append((base, [a.name], node.lineno, id(node) in lazy))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in bound:
                out.append((bound[node.value.id], [node.attr], node.lineno, False))
    return out


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    """(module -> the modules it imports, the private names imported across files)."""
    files = _files()
    known = set(files)
    edges: dict[str, set[str]] = {m: set() for m in files}
    private = []
    for module, path in files.items():
        for target, names, line in _imports(module, path, known):
            if target != module:
                edges[module].add(target)
            for name in names:
                if name.startswith("_") and not name.startswith("__") and target != module:
                    private.append(f"{path.relative_to(ROOT)}:{line} imports {target}.{name}")
    return edges, private


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
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

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_nor_private_import_across_files():
    edges, private = _graph()
    cycles = [" -> ".join(c) for c in _cycles(edges)]
    listed = "\n".join(cycles)
    assert not cycles, f"import cycles (each a set of modules that import each other):\n{listed}"
    assert not private, "private names imported across files:\n" + "\n".join(private)


def _layer_of(module: str) -> str | None:
    """The layer of `module`: the one whose prefix names it most closely."""
    best, length = None, -1
    for layer, prefixes in LAYERS.items():
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > length:
                best, length = layer, len(prefix)
    return best


def _upward_imports() -> tuple[list[str], list[str]]:
    """(modules without a layer, every import of a layer above the importer's, each naming
    both files, the line, and whether it hides inside a function)."""
    files = _files()
    known = set(files)
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    unplaced = sorted(m for m in files if _layer_of(m) is None)
    upward = []
    for module, path in sorted(files.items()):
        mine = _layer_of(module)
        for target, _, line, lazy in _lazy_imports(module, path, known):
            theirs = _layer_of(target)
            if mine is None or theirs is None or rank[theirs] <= rank[mine]:
                continue
            where = " (inside a function)" if lazy else ""
            upward.append(
                f"{path.relative_to(ROOT)}:{line} ({mine}) imports "
                f"{files[target].relative_to(ROOT)} ({theirs}){where}"
            )
    return unplaced, upward


def test_folders_import_only_the_layers_below_their_own():
    unplaced, upward = _upward_imports()
    assert not unplaced, f"modules of no layer (add them to LAYERS): {unplaced}"
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


def test_the_layer_check_names_both_files_of_an_upward_import(tmp_path, monkeypatch):
    """The check itself: a checkpoint module importing the loop inside a function, and a
    data module importing the build layer at its top, are both named, file by file."""
    import tests.test_import_layers as me

    root = tmp_path / "moetrain"
    for folder in ("checkpoint", "loop", "data", "build"):
        (root / folder).mkdir(parents=True)
        (root / folder / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "loop" / "step.py").write_text("x = 1\n")
    (root / "build" / "model.py").write_text("y = 2\n")
    (root / "checkpoint" / "save.py").write_text(
        "def f():\n    from moetrain.loop.step import x\n    return x\n"
    )
    (root / "data" / "read.py").write_text("from moetrain.build import model\n")
    monkeypatch.setattr(me, "ROOT", tmp_path)
    unplaced, upward = me._upward_imports()
    assert unplaced == []
    assert upward == [
        "moetrain/checkpoint/save.py:2 (checkpoint) imports moetrain/loop/step.py (loop) "
        "(inside a function)",
        "moetrain/data/read.py:1 (data) imports moetrain/build/model.py (build)",
    ]


def test_planner_layers_import_downward():
    edges, _ = _graph()
    prefix = "moetrain.planner."
    layer_of = {prefix + f: i for i, files in enumerate(PLANNER_LAYERS.values()) for f in files}
    layer_of["moetrain.planner"] = layer_of.pop(prefix + "__init__")
    names = list(PLANNER_LAYERS)
    files = {m for m in edges if m == "moetrain.planner" or m.startswith(prefix)}
    assert files == set(layer_of), f"files without a layer: {sorted(files - set(layer_of))}"
    upward = [
        f"{m} ({names[layer_of[m]]}) imports {t} ({names[layer_of[t]]})"
        for m in sorted(files)
        for t in sorted(edges[m])
        if t in layer_of and layer_of[t] > layer_of[m]
    ]
    assert not upward, "planner imports against its layers:\n" + "\n".join(upward)


def test_the_check_finds_a_cycle_and_a_private_import(tmp_path, monkeypatch):
    """The check itself: two files importing each other, each taking a private name of the
    other's (by import, and as an attribute of the imported module)."""
    room = tmp_path / "moetrain"
    room.mkdir()
    (room / "__init__.py").write_text("")
    (room / "a.py").write_text("def f():\n    from moetrain.b import _g\n")
    (room / "b.py").write_text("from moetrain import a\n\nx = a._f\n")
    import tests.test_import_layers as me

    monkeypatch.setattr(me, "ROOT", tmp_path)
    edges, private = me._graph()
    assert me._cycles(edges) == [["moetrain.a", "moetrain.b"]]
    assert private == [
        "moetrain/a.py:2 imports moetrain.b._g",
        "moetrain/b.py:3 imports moetrain.a._f",
    ]
