"""Who may import whom in outbox/ (docs/architecture.md): read from the source, every import counted, those inside
functions too (those only a type checker runs, under `if TYPE_CHECKING:`, are not imports at run time)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "outbox"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node but those under `if TYPE_CHECKING:`."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            yield from (n for child in node.orelse for n in (child, *_runtime_nodes(child)))
            continue
        yield node
        yield from _runtime_nodes(node)


def imports(module: str) -> set[str]:
    """The outbox modules `module` imports at run time (at its top or inside its functions)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        for name in names:
            target = _resolve(name)
            if target is not None and target != module and target.startswith("outbox"):
                found.add(target)
    return found


GRAPH = {module: imports(module) for module in MODULES}


def _cycles() -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in GRAPH[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(GRAPH):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_in_the_package():
    assert _cycles() == []


def test_a_planted_cycle_is_found(monkeypatch):
    """The check itself has teeth: a cycle added to the graph is reported."""
    monkeypatch.setitem(GRAPH, "outbox.kafka.sizes", GRAPH["outbox.kafka.sizes"] | {"outbox.harvest.topics"})
    assert ["outbox.harvest.topics", "outbox.kafka.sizes"] in _cycles()


def _reaches(module: str, prefixes: tuple[str, ...]) -> list[str]:
    return sorted(target for target in GRAPH[module] if target.startswith(prefixes))


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("outbox.queue")))
def test_the_queues_import_nothing_from_the_harvester(module):
    """What both need lives in outbox.kafka (the shared layer), not in one of them."""
    assert _reaches(module, ("outbox.harvest",)) == []


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("outbox.kafka")))
def test_the_shared_kafka_layer_stands_on_nothing_above_it(module):
    assert _reaches(module, ("outbox.harvest", "outbox.queue", "outbox.pipeline", "outbox.testing")) == []
    source = MODULES[module].read_text()
    assert "django" not in source.split('"""', 2)[-1], f"{module} imports Django"


#: The modules that show the console's pages: Django's admin entry point, and the queues' own pages and charts.
CONSOLE_USERS = {"outbox.admin", "outbox.queue.admin", "outbox.queue.history"}


@pytest.mark.parametrize("module", sorted(m for m in MODULES
                                          if not m.startswith("outbox.console") and m not in CONSOLE_USERS))
def test_only_the_pages_import_the_console(module):
    """The write path, the engine, the commands and the metrics never need the operator console."""
    assert _reaches(module, ("outbox.console",)) == []


def _imports_django(module: str) -> bool:
    """Whether `module` imports Django at run time (at its top or inside a function)."""
    for node in _runtime_nodes(ast.parse(MODULES[module].read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        if any(name == "django" or name.startswith("django.") for name in names):
            return True
    return False


def _reached(module: str) -> set[str]:
    """Every outbox module `module` imports, directly or through others."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        for target in GRAPH[todo.pop()] - seen:
            seen.add(target)
            todo.append(target)
    return seen


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith(("outbox.harvest", "outbox.kafka"))))
def test_the_engine_and_the_stand_alone_harvester_reach_no_module_that_imports_django(module):
    """outbox-harvest runs where Django is not installed: nothing it can import, even lazily, imports it."""
    assert sorted(m for m in _reached(module) | {module} if _imports_django(m)) == []


def test_a_planted_django_import_is_found(monkeypatch):
    monkeypatch.setitem(GRAPH, "outbox.harvest.cli", GRAPH["outbox.harvest.cli"] | {"outbox.conf"})
    assert "outbox.conf" in _reached("outbox.harvest.cli") and _imports_django("outbox.conf")


#: The house rule (docs/architecture.md): a class that grows past this holds two concerns.
MAX_CLASS_LINES = 400


def long_classes(source: str, limit: int = MAX_CLASS_LINES) -> list[tuple[str, int]]:
    """The classes of `source` longer than `limit` lines (their decorators, docstring and blank lines counted)."""
    return [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > limit]


def test_no_class_in_the_package_is_over_400_lines():
    found = [f"{module}.{name} ({lines} lines)" for module, path in sorted(MODULES.items())
             for name, lines in long_classes(path.read_text())]
    assert found == [], "split by concern: " + ", ".join(found)


def test_a_long_class_is_found():
    assert long_classes("class Short:\n    pass\n" + "class Long:\n" + "    x = 1\n" * 400) == [("Long", 401)]


#: The core's parts (core.py): each is told by Core and answers it, and none reaches another through it.
CORE_PARTS = ("lanes", "poison", "marking", "leadership", "settling")


def sideways_calls(source: str) -> list[str]:
    """`core.<part>` and `self.core.<part>` in `source`: a part of the core reaching another part through Core."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in CORE_PARTS:
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id == "core") or \
                    (isinstance(owner, ast.Attribute) and owner.attr == "core"):
                found.append((node.lineno, ast.unparse(node)))
    return [f"line {line}: {text}" for line, text in sorted(found)]


@pytest.mark.parametrize("part", CORE_PARTS)
def test_no_part_of_the_core_reaches_another_through_core(part):
    """Core is the mediator (docs/architecture.md): a part gets what it needs as arguments or from Core's own
    methods, and returns what the others must hear (a Verdict, the lanes it held) for Core to route."""
    assert sideways_calls((PACKAGE / "harvest" / f"{part}.py").read_text()) == []


def test_a_planted_sideways_call_is_found():
    assert sideways_calls("def f(self):\n    self.core.poison.hold(x)\n    core.lanes.queued\n") == \
        ["line 2: self.core.poison", "line 3: core.lanes"]
