"""The package's layering contract (docs/architecture.md): a module imports only from its own layer
or the layers below it, and no modules import each other in a circle.

Read from the source with ``ast`` (every import, including those inside functions; those under
``if TYPE_CHECKING:`` only name types and are left out), so it holds whatever runs first.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "entmtp_hf"

#: bottom first; a module belongs to the layer of the longest prefix that names it
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("errors", "validation", "files", "paths", "hub", "gemv", "cpu_kernels")),
    ("topology", ("trees",)),
    ("scheduling", ("scheduling",)),
    ("costs", ("costs",)),
    ("banks", ("banks",)),
    ("heads", ("heads",)),
    ("drafting", ("drafting",)),
    ("decoding", ("decoding",)),
    ("config", ("config",)),
    ("calibration", ("calibration",)),
    ("generate", ("integration", "assisted", "custom_generate", "")),
    ("tools", ("tools", "demo")),
)


def layer_of(module: str) -> int:
    name = module.removeprefix(PACKAGE).removeprefix(".")
    best, level = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (name == p or name.startswith(p + ".") or p == "") and len(p) > best:
                best, level = len(p), i
    assert level is not None, module
    return level


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules ``module`` imports (a ``from package import name`` that names a
    submodule counts as that submodule)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == PACKAGE)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == PACKAGE:
                subs = {f"{target}.{a.name}" for a in node.names} & known
                found.update(subs or {target})
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return {m for m in found if m in known and m != module}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: imports(m, p, set(modules)) for m, p in modules.items()}


def test_every_module_has_a_layer(graph):
    assert {m: layer_of(m) for m in graph}


def test_no_module_imports_a_higher_layer(graph):
    upward = sorted(
        f"{m} ({LAYERS[layer_of(m)][0]}) -> {t} ({LAYERS[layer_of(t)][0]})"
        for m, targets in graph.items()
        for t in targets
        if layer_of(t) > layer_of(m)
    )
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_no_import_circles(graph):
    """Tarjan's strongly connected components: any with two or more modules is a circle. A
    package's ``__init__`` importing its own submodules, which import their siblings through it,
    is not a circle worth naming, so a package's edges to its own ``__init__`` are left out."""
    edges = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                connect(w)
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
                circles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    assert not circles, f"modules importing each other in a circle: {circles}"


def test_the_contract_catches_an_upward_import(tmp_path):
    """The checker itself: an upward import and a circle in a made-up package are found."""
    root = tmp_path / PACKAGE
    (root / "costs").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "costs" / "__init__.py").write_text("")
    (root / "costs" / "probe.py").write_text("from ..decoding import loop\n")
    (root / "decoding").mkdir()
    (root / "decoding" / "__init__.py").write_text("")
    (root / "decoding" / "loop.py").write_text("from ..costs import probe\n")
    known = {f"{PACKAGE}.costs.probe", f"{PACKAGE}.decoding.loop", f"{PACKAGE}.costs", f"{PACKAGE}.decoding"}
    probe = imports(f"{PACKAGE}.costs.probe", root / "costs" / "probe.py", known)
    assert probe == {f"{PACKAGE}.decoding.loop"} and layer_of(f"{PACKAGE}.decoding.loop") > layer_of(
        f"{PACKAGE}.costs.probe"
    )
    assert imports(f"{PACKAGE}.decoding.loop", root / "decoding" / "loop.py", known) == {f"{PACKAGE}.costs.probe"}


#: the layer the user's ``EntMTPConfig`` lives in: below it, code takes typed plans, never the config
CONFIG_LAYER = next(i for i, (name, _) in enumerate(LAYERS) if name == "config")


def _class_members(tree: ast.Module) -> dict[str, set[str]]:
    """Each class's public fields, properties and methods (as written in its body)."""
    out: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            names = {
                n.target.id if isinstance(n, ast.AnnAssign) else n.name
                for n in node.body
                if (isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name))
                or isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            }
            out.setdefault(node.name, set()).update(n for n in names if not n.startswith("_"))
    return out


def config_hand_downs(source: str, config_only: set[str]) -> list[str]:
    """Where ``source`` takes the config in disguise: a parameter named ``entmtp_config``, the
    name ``EntMTPConfig`` in its code (strings aside), or a parameter typed ``Any`` (or not typed)
    off which it reads a member only ``EntMTPConfig`` has (``config_only``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and node.id == "EntMTPConfig":
            found.append(f"line {node.lineno}: names EntMTPConfig")
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        args = node.args
        params = [*args.posonlyargs, *args.args, *args.kwonlyargs]
        found += [f"line {node.lineno}: parameter entmtp_config" for p in params if p.arg == "entmtp_config"]
        loose = {
            p.arg
            for p in params
            if p.arg not in ("self", "cls")
            and (p.annotation is None or ast.unparse(p.annotation) in ("Any", "typing.Any"))
        }
        found += sorted(
            {
                f"line {sub.lineno}: {sub.value.id}.{sub.attr} off an untyped parameter"
                for sub in ast.walk(node)
                if isinstance(sub, ast.Attribute)
                and isinstance(sub.value, ast.Name)
                and sub.value.id in loose
                and sub.attr in config_only
            }
        )
    return found


def test_no_config_handed_down_untyped():
    """The import test cannot see the config handed down typed ``Any`` (the plan layer once read
    14 of its fields and called its ``load_bank``): below the config layer, no module takes a
    parameter named ``entmtp_config``, names ``EntMTPConfig`` in code, or reads off an untyped
    parameter a member that only ``EntMTPConfig`` declares (no class of the lower layers has it)."""
    modules = {m: p for m, p in _modules().items() if layer_of(m) < CONFIG_LAYER}
    sources = {m: p.read_text(encoding="utf-8") for m, p in modules.items()}
    lower: set[str] = set()
    for source in sources.values():
        lower.update(*_class_members(ast.parse(source)).values())
    config_path = SRC / PACKAGE / "config.py"
    config_only = _class_members(ast.parse(config_path.read_text(encoding="utf-8")))["EntMTPConfig"] - lower
    assert {"load_bank", "resolve", "adapts"} <= config_only
    found = [f"{m} {where}" for m, source in sources.items() for where in config_hand_downs(source, config_only)]
    assert not found, "the config handed down below its layer (hand down typed plans instead):\n" + "\n".join(found)


def test_the_contract_catches_an_untyped_config():
    """The checker itself: the plan layer's old ``build_plan(config: Any)`` and a loop taking
    ``entmtp_config`` are found; a typed spec is not."""
    old = "def build_plan(config: Any, n):\n    return config.load_bank()\n"
    assert config_hand_downs(old, {"load_bank"}) == ["line 2: config.load_bank off an untyped parameter"]
    assert config_hand_downs("def f(x, *, entmtp_config):\n    pass\n", set()) == ["line 1: parameter entmtp_config"]
    assert config_hand_downs("def f(spec: PlanSpec):\n    return spec.load_bank()\n", {"load_bank"}) == []
