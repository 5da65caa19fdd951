"""The shape of the package, read from its source with :mod:`ast` (nothing is imported).

* No import cycle between modules. Every import counts: module-level, inside a function and under
  ``if TYPE_CHECKING:``. ``from mixprec.a import b`` is an import of the module ``mixprec.a.b`` when
  that module exists, else of the package ``mixprec.a`` (its ``__init__``); ``import mixprec.a.b``
  is an import of ``mixprec.a.b`` alone (the parents it runs first are not edges, so a package
  ``__init__`` that imports its submodules is no cycle with them).
* No private name (``_name``) used outside the unit that defines it: a subpackage
  (``mixprec.numerics``, with everything under it) or a top-level module (``mixprec.checkpoint.local``
  is one file). Both ``from mixprec.x import _name`` and ``x._name`` on an imported mixprec module
  count.
* The engine's step stays readable: ``MixedPrecision`` at most 300 lines, its ``step`` at most 45; ``PrecisionOptimizer``
  at most 150 (a shell over its state codec and write-back).
* Imports point down the layers of docs/architecture.md; a program (``mixprec.programs.<name>``) imports
  the library, ``programs.session`` and nothing of another program (``cli`` dispatches to all).
* The root package holds only the public entry points; no function over 50 lines, no module over 400.
* tests/ mirrors src/mixprec (a folder per subpackage); no issue numbers in the source or the README.
* The engine's state is the engine's: outside ``MixedPrecision`` no function takes an untyped engine
  (``mp`` unannotated or ``Any``) or assigns ``mp.<attribute>``; its base classes (the public methods that
  assign nothing: views, the frozen set's, the gradient-penalty pair) assign no ``self.<attribute>``.

"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path


SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = "mixprec"

# The class holds the methods that assign the engine's state, in their side-effect order (a collaborator returns
# typed values and the engine assigns them); the public methods that assign nothing live in its base classes by
# concept (engine/views.py, engine/frozen_control.py, engine/penalty.py), checked below to assign nothing.
CLASS_LINES_LIMIT = 300
STEP_LINES_LIMIT = 45


# ---------------------------------------------------------------------- reading the source
@functools.cache
def _modules() -> dict[str, Path]:
    """Module name -> file, for every ``.py`` under ``src/mixprec`` (``__init__`` names the package)."""
    out = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


@functools.cache
def _tree(module: str) -> ast.Module:
    path = _modules()[module]
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _is_package(module: str) -> bool:
    return _modules()[module].name == "__init__.py"


def _absolute(module: str, node: ast.ImportFrom) -> str:
    """The absolute module name a ``from ... import`` reads from (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not _is_package(module):
        base.pop()
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str) -> list[tuple[str, str | None, int]]:
    """(target module, imported name or None, line) for each mixprec import anywhere in ``module``.

    ``name`` is the attribute taken from the target (``from target import name``), None when the
    target module itself is what is imported.
    """
    known = _modules()
    out: list[tuple[str, str | None, int]] = []
    for node in ast.walk(_tree(module)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    out.append((alias.name, None, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            if source != PACKAGE and not source.startswith(PACKAGE + "."):
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in known:
                    out.append((sub, None, node.lineno))
                else:
                    out.append((source, alias.name, node.lineno))
    return out


# ---------------------------------------------------------------------- (a) import cycles
def import_graph() -> dict[str, dict[str, int]]:
    """Module -> {imported module: first line of such an import}."""
    known = _modules()
    graph: dict[str, dict[str, int]] = {m: {} for m in known}
    for module in known:
        for target, _, line in _imports(module):
            if target in known and target != module:
                graph[module].setdefault(target, line)
    return graph


def _components(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _cycle_in(graph: dict[str, dict[str, int]], component: list[str]) -> list[str]:
    """One concrete cycle through the component's first module (breadth-first, so a shortest one)."""
    members = set(component)
    start = component[0]
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for child in graph[node]:
            if child == start:
                return paths[node] + [start]
            if child in members and child not in paths:
                paths[child] = paths[node] + [child]
                queue.append(child)
    raise AssertionError(f"no cycle through {start} in {component}")  # pragma: no cover


def _describe(graph: dict[str, dict[str, int]], cycle: list[str]) -> str:
    steps = [f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])]
    return " -> ".join(steps + [cycle[-1]])


def test_no_import_cycles():
    graph = import_graph()
    cycles = [f"{_describe(graph, _cycle_in(graph, c))}   [all of {c}]" for c in _components(graph)]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


# ---------------------------------------------------------------------- (b) private names
def _unit(module: str) -> str:
    """The unit whose privates ``module`` may use: its first-level subpackage, or itself."""
    parts = module.split(".")
    if len(parts) <= 2 and not (len(parts) == 2 and _is_package(module)):
        return module
    return ".".join(parts[:2])


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_aliases(module: str) -> dict[str, str]:
    """Local name -> mixprec module, for ``import mixprec.x as y`` / ``from mixprec import x``."""
    known = _modules()
    out: dict[str, str] = {}
    for node in ast.walk(_tree(module)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in known:
                    out[alias.asname] = alias.name
                elif alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    out[alias.name.split(".")[0]] = PACKAGE
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            for alias in node.names:
                if f"{source}.{alias.name}" in known:
                    out[alias.asname or alias.name] = f"{source}.{alias.name}"
    return out


def _dotted(node: ast.expr) -> list[str] | None:
    """``a.b.c`` as ["a", "b", "c"]; None for anything but names and attributes."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _private_uses() -> list[str]:
    """Each use of another unit's private name, as text."""
    known = _modules()
    found = []
    for module in known:
        uses: list[tuple[str, str, int]] = []
        for target, name, line in _imports(module):
            if name is not None and _private(name):
                uses.append((target, name, line))
            elif name is None and any(_private(p) for p in target.split(".")):
                parent, _, leaf = target.rpartition(".")
                uses.append((parent, leaf, line))
        aliases = _module_aliases(module)
        for node in ast.walk(_tree(module)):
            parts = _dotted(node) if isinstance(node, ast.Attribute) else None
            if not parts or parts[0] not in aliases:
                continue
            target = aliases[parts[0]]
            for attr in parts[1:]:  # mixprec.numerics.advice._num: walk down the submodules
                if f"{target}.{attr}" in known and not _private(attr):
                    target = f"{target}.{attr}"
                    continue
                if _private(attr):
                    uses.append((target, attr, node.lineno))
                break
        for target, name, line in sorted(set(uses), key=lambda u: u[2]):
            if target not in known or _unit(target) == _unit(module):
                continue
            found.append(f"{module} (line {line}) uses {target}.{name}")
    return sorted(set(found))


def test_no_private_names_across_units():
    uses = _private_uses()
    assert not uses, "private names used outside the subpackage or module defining them:\n" + "\n".join(uses)


# ---------------------------------------------------------------------- (c) engine size
def _lines(node: ast.AST) -> int:
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    return node.end_lineno - first + 1


def _mixed_precision() -> ast.ClassDef:
    for node in _tree("mixprec.engine.mixed_precision").body:
        if isinstance(node, ast.ClassDef) and node.name == "MixedPrecision":
            return node
    raise AssertionError("src/mixprec/engine/mixed_precision.py defines no class MixedPrecision")


def test_mixed_precision_class_is_short():
    cls = _mixed_precision()
    assert _lines(cls) <= CLASS_LINES_LIMIT, (
        f"MixedPrecision spans {_lines(cls)} lines (mixed_precision.py:{cls.lineno}-{cls.end_lineno}), "
        f"more than {CLASS_LINES_LIMIT}: move what it needs into collaborators")


def test_precision_optimizer_is_a_thin_shell():
    tree = _tree("mixprec.optim.precision_optimizer")
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PrecisionOptimizer")
    assert _lines(cls) <= 150, (f"PrecisionOptimizer spans {_lines(cls)} lines: storage belongs in optim/state_codec.py, "
                                "rounding in optim/write_back.py")


def test_mixed_precision_step_is_short():
    cls = _mixed_precision()
    step = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "step"), None)
    assert step is not None, "MixedPrecision has no step method"
    assert _lines(step) <= STEP_LINES_LIMIT, (
        f"MixedPrecision.step spans {_lines(step)} lines (mixed_precision.py:{step.lineno}-{step.end_lineno}), "
        f"more than {STEP_LINES_LIMIT}: let it read as its documented sequence of calls")


# ---------------------------------------------------------------------- the checker itself
def test_the_graph_sees_every_kind_of_import():
    """Guards the checks above against reading nothing: known edges of each kind are found."""
    graph = import_graph()
    assert "mixprec.numerics" in graph["mixprec"]                        # from mixprec.numerics import X
    assert "mixprec.numerics.inspect" in graph["mixprec.numerics"]       # a package importing its module
    assert "mixprec.programs.inspect" in graph["mixprec.programs.cli"]            # inside a function
    assert len(graph) == len(_modules()) > 30


# ---------------------------------------------------------------------- (d) layering
# Dependencies point one way, from data toward programs (docs/architecture.md). A module belongs to the
# layer of its longest matching prefix and imports only from its own layer or lower ones.
LAYERS = (
    ("where messages point", ("mixprec.messages",)),
    ("data", ("mixprec.formats", "mixprec.machine", "mixprec.workloads")),
    ("the policy as data", ("mixprec.policy",)),
    ("kernels and ops", ("mixprec.autocast", "mixprec.fp8", "mixprec.blockscale", "mixprec.optim", "mixprec.ops",
                         "mixprec.memory")),
    ("resolution", ("mixprec.policy.resolve", "mixprec.auto.trial")),
    ("processes", ("mixprec.distributed",)),
    ("engine", ("mixprec.engine", "mixprec.auto.pending")),
    ("around the engine", ("mixprec.checkpoint", "mixprec.guard", "mixprec.ema", "mixprec.numerics",
                           "mixprec.integrations", "mixprec.safety")),
    ("programs", ("mixprec.programs", "mixprec.__main__")),
    ("public API", ("mixprec",)),
)


def _layer(module: str) -> int:
    best, level = -1, None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, level = len(prefix), index
    if level is None:
        raise AssertionError(f"{module} is in no layer of LAYERS: add it where it belongs")
    return level


def test_imports_point_down_the_layers():
    graph = import_graph()
    upward = [f"{m} ({LAYERS[_layer(m)][0]}) imports {t} ({LAYERS[_layer(t)][0]}) at line {line}"
              for m, targets in graph.items() for t, line in targets.items() if _layer(t) > _layer(m)]
    assert not upward, "imports against the layering:\n" + "\n".join(sorted(upward))


def _program(module: str) -> str | None:
    """The program a module belongs to (``mixprec.programs.bench``, ``mixprec.programs.cli``, ...)."""
    parts = module.split(".")
    return ".".join(parts[:3]) if len(parts) >= 3 and parts[1] == "programs" else None


def test_programs_never_import_each_others_internals():
    """cli dispatches to every program's entry point; ``programs.session`` (a workload under an engine) is
    shared by the programs; otherwise a program imports the library only."""
    shared = {"mixprec.programs.session", "mixprec.programs.cli"}
    graph = import_graph()
    crossing = [f"{m} imports {t} (line {line})" for m, targets in graph.items() for t, line in targets.items()
                if _program(m) and _program(t) and _program(m) != _program(t)
                and _program(t) != "mixprec.programs.session" and _program(m) not in shared]
    assert not crossing, "a program importing another program's module:\n" + "\n".join(sorted(crossing))


# ---------------------------------------------------------------------- (e) the root and the sizes
ROOT_MODULES = {"mixprec", "mixprec.__main__", "mixprec.formats", "mixprec.ops", "mixprec.guard", "mixprec.ema"}
FUNCTION_LINES_LIMIT = 50
MODULE_LINES_LIMIT = 400   # every module, the engine's included: no exceptions


def test_the_root_holds_only_public_entry_points():
    """Top-level modules are the public API's: each is imported by ``mixprec/__init__.py`` (or is
    ``__main__``); the rest lives in subpackages by concept."""
    root = {m for m, path in _modules().items() if path.parent == SRC / PACKAGE}
    assert root == ROOT_MODULES, f"top-level modules {sorted(root - ROOT_MODULES)} belong in a subpackage"
    public = set(import_graph()["mixprec"])
    assert ROOT_MODULES - {"mixprec", "mixprec.__main__"} <= public


def test_no_long_functions_or_modules():
    long = []
    for module, path in _modules().items():
        text = path.read_text(encoding="utf-8")
        if text.count("\n") > MODULE_LINES_LIMIT:
            long.append(f"{path.relative_to(SRC)}: {text.count(chr(10))} lines")
        for node in ast.walk(_tree(module)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _lines(node) > FUNCTION_LINES_LIMIT:
                long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name}: {_lines(node)} lines")
    assert not long, (f"over {MODULE_LINES_LIMIT} lines a module or {FUNCTION_LINES_LIMIT} a function:\n"
                      + "\n".join(long))


TESTS = SRC.parent / "tests"
ROOT_TESTS = {"test_api.py", "test_architecture.py", "test_readme.py"}   # the API as a whole, this file, the README


def test_tests_mirror_the_subpackages():
    """tests/ has a folder per subpackage of src/mixprec and no other (but ``data``); its root holds the tests of the
    root modules (``test_<module>.py``) and of the package as a whole; test file names are unique (pytest imports
    them by basename)."""
    subpackages = {p.name for p in (SRC / PACKAGE).iterdir() if (p / "__init__.py").is_file()}
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and p.name not in {"data", "__pycache__"}}
    assert folders == subpackages, (f"tests/ folders without a subpackage: {sorted(folders - subpackages)}; "
                                    f"subpackages without a tests/ folder: {sorted(subpackages - folders)}")
    root_modules = {f"test_{m.rsplit('.', 1)[-1]}.py" for m in ROOT_MODULES - {PACKAGE, "mixprec.__main__"}}
    at_root = {p.name for p in TESTS.glob("test_*.py")}
    assert at_root <= root_modules | ROOT_TESTS, f"move into the folder of what they test: {sorted(at_root - root_modules - ROOT_TESTS)}"
    names = [p.name for p in TESTS.rglob("test_*.py")]
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})


def test_the_source_cites_no_issue_numbers():
    """Docstrings and comments say the behaviour, not the ticket that asked for it (issue numbers mean nothing to a
    reader of the package); the README too, as the package's long description."""
    cited = [f"{path.relative_to(SRC)}:{i}" for path in sorted((SRC / PACKAGE).rglob("*.py"))
             for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if re.search(r"\bissues? [0-9]", line, re.IGNORECASE)]
    cited += [f"README.md:{i}" for i, line in enumerate((SRC.parent / "README.md").read_text().splitlines(), 1)
              if re.search(r"\bissues? [0-9]", line, re.IGNORECASE)]
    assert not cited, "issue numbers cited in:\n" + "\n".join(cited)


# ---------------------------------------------------------------------- (f) the engine's state is the engine's
def _assigned(node: ast.AST, owner: str) -> list[str]:
    """The attributes of the name ``owner`` that ``node`` assigns: ``owner.x = ...`` (also inside a tuple or list
    target, augmented or annotated) or ``setattr(owner, ...)``."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
        first = node.args[0] if node.args else None
        return ["<setattr>"] if isinstance(first, ast.Name) and first.id == owner else []
    targets = list(node.targets) if isinstance(node, ast.Assign) else (
        [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])   # a copy: the tree is cached
    out = []
    while targets:
        target = targets.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            targets.extend(target.elts)
        elif isinstance(target, ast.Starred):
            targets.append(target.value)
        elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == owner:
            out.append(target.attr)
    return out


def _engine_bases() -> list[tuple[str, ast.ClassDef]]:
    """(module, class) for each base class of ``MixedPrecision``, found through mixed_precision.py's imports."""
    tree = _tree("mixprec.engine.mixed_precision")
    imported = {alias.asname or alias.name: _absolute("mixprec.engine.mixed_precision", node)
                for node in tree.body if isinstance(node, ast.ImportFrom) for alias in node.names}
    out = []
    for base in _mixed_precision().bases:
        module = imported.get(base.id) if isinstance(base, ast.Name) else None
        assert module in _modules(), f"MixedPrecision's base {ast.unparse(base)} is no class of {PACKAGE}: check it here"
        out.append((module, next(n for n in _tree(module).body if isinstance(n, ast.ClassDef) and n.name == base.id)))
    return out


def _engine_reach_ins() -> list[str]:
    """Functions outside ``MixedPrecision`` taking an untyped engine (``mp`` unannotated or ``Any``), assignments
    to an engine attribute (``mp.x = ...``) outside it, and to ``self.x`` in its base classes (their methods are
    the engine's, and assign nothing)."""
    found = []
    for module, path in _modules().items():
        tree = _tree(module)
        inside = set()
        if module == "mixprec.engine.mixed_precision":
            inside = {id(n) for n in ast.walk(_mixed_precision())}
        for node in ast.walk(tree):
            if id(node) in inside:
                continue
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for arg in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
                    if arg.arg == "mp" and (arg.annotation is None or ast.unparse(arg.annotation) in ("Any", "typing.Any")):
                        found.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name}(mp) is untyped")
            found += [f"{path.relative_to(SRC)}:{node.lineno} assigns mp.{attr}" for attr in _assigned(node, "mp")]
    for module, cls in _engine_bases():
        path = _modules()[module].relative_to(SRC)
        found += [f"{path}:{node.lineno} {cls.name}, a base of MixedPrecision, assigns self.{attr}"
                  for node in ast.walk(cls) for attr in _assigned(node, "self")]
    return found


def test_only_the_engine_assigns_its_state():
    found = _engine_reach_ins()
    assert not found, "collaborators reaching into the engine:\n" + "\n".join(sorted(found))


def test_the_state_checker_sees_the_engines_bases():
    """Guards the check above against reading nothing: the engine's base classes are found, and an assignment
    of each kind it looks for is seen."""
    assert {cls.name for _, cls in _engine_bases()} >= {"EngineViews", "FrozenControl", "PenaltyGradients"}
    code = ast.parse("self.a = 1\nself.b, (self.c, *self.d) = x\nself.e += 1\nself.f: int = 1\nsetattr(self, 'g', 1)")
    assert sorted(a for node in ast.walk(code) for a in _assigned(node, "self")) == ["<setattr>", *"abcdef"]
