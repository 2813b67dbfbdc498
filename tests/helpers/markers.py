"""The markers `procs`, `servers` and `root`, derived from what each test does, so that
``-m "not slow and not procs and not servers"`` (the inner loop, tests/README.md) is truthful
without a hand-kept list of files.

* ``servers``: the test's fixture closure holds a real object-store server fixture of
  ``tests.helpers.servers.plugin`` (``seaweedfs``, ``azurite``, ``gcs_server``), or the test reaches a
  server class (an ``ObjectStoreServer``) and starts one itself.
* ``procs``: the test, a fixture of its own module or of conftest.py, or a helper they reach
  (transitively, through the module's functions and classes and through ``from tests... import``)
  starts a process: ``subprocess``, ``multiprocessing`` / ``torch.multiprocessing``, ``os.fork``,
  ``os.posix_spawn``, ``os.system``. The session server fixtures are not counted here (``servers``).
* ``root``: the test reaches a call that names ``mount``/``umount`` (a tmpfs or a loop-mounted
  ext4: root or CAP_SYS_ADMIN, else it skips).
* ``slow`` is written by hand (``@pytest.mark.slow`` or a module ``pytestmark``) from measured
  durations; a test may also carry any of the others by hand.

``TIERCHECK_AUDIT_MARKS=1`` checks the derivation at run time: a test that starts a process
(``subprocess.Popen``, ``os.fork``, ``os.posix_spawn``, a ``multiprocessing`` process) while
marked neither ``procs`` nor ``servers`` fails, naming what it started.
"""

from __future__ import annotations

import ast
import functools
import inspect
import os
import subprocess
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).resolve().parents[1]
SERVER_FIXTURES = frozenset({"seaweedfs", "azurite", "gcs_server"})
_SPAWN_MODULES = {
    "subprocess": {"run", "Popen", "call", "check_call", "check_output", "getoutput", "getstatusoutput"},
    "os": {"fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "popen", "spawnv", "spawnl", "execv"},
    "multiprocessing": {"Process", "Pool", "get_context", "spawn"},
    "mp": {"Process", "Pool", "get_context", "spawn", "start_processes"},
    "torch.multiprocessing": {"Process", "Pool", "get_context", "spawn", "start_processes"},
}
_MOUNT = frozenset({"mount", "umount"})
_Facts = frozenset[str]


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _is_spawn(dotted: str) -> bool:
    mod, _, attr = dotted.rpartition(".")
    return attr in _SPAWN_MODULES.get(mod, ())


class _Scan(ast.NodeVisitor):
    """What one function or class body refers to: names, spawn calls, `mount` arguments."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.facts: set[str] = set()

    def visit_Name(self, node: ast.Name) -> None:
        self.names.add(node.id)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        dotted = _dotted(node)
        if dotted is not None and _is_spawn(dotted):
            self.facts.add("procs")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        args: list[ast.expr] = list(node.args)
        for a in node.args:
            if isinstance(a, (ast.List, ast.Tuple)):
                args.extend(a.elts)
        if any(isinstance(a, ast.Constant) and a.value in _MOUNT for a in args):
            self.facts.add("root")
        if isinstance(node.func, ast.Attribute) and node.func.attr == "getfixturevalue":
            # a fixture asked for by name at run time: its closure is resolved per item
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            self.facts.update(f"fixture:{n}" for n in names)
        self.generic_visit(node)

    def visit_arg(self, node: ast.arg) -> None:
        pass  # annotations (subprocess.CompletedProcess and the like) start nothing

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)


class _Module:
    """Module-level definitions of one test file, each with its direct facts and references."""

    def __init__(self, path: Path) -> None:
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        self.path = path
        self.defs: dict[str, _Scan] = {}
        self.imports: dict[str, tuple[Path, str]] = {}  # local name -> (module file, name there)
        for node in tree.body:
            self._add(node)

    def _add(self, node: ast.stmt) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scan = _Scan()
            if isinstance(node, ast.ClassDef):
                for base in node.bases:
                    scan.visit(base)
            for stmt in node.body:
                scan.visit(stmt)
            for deco in node.decorator_list:
                scan.visit(deco)
            self.defs[node.name] = scan
            if isinstance(node, ast.ClassDef):  # a test class's methods are reached through the class
                for stmt in node.body:
                    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        self.defs.setdefault(stmt.name, scan)
        elif isinstance(node, ast.ImportFrom):
            target = _module_file(self.path, node.module, node.level)
            if target is not None:
                for alias in node.names:
                    self.imports[alias.asname or alias.name] = (target, alias.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(getattr(node, "value", None), ast.AST):
            scan = _Scan()
            scan.visit(node.value)  # type: ignore[arg-type]
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name):
                    self.defs[t.id] = scan
        elif isinstance(node, (ast.If, ast.Try)):
            for stmt in node.body:
                self._add(stmt)


def _module_file(here: Path, module: str | None, level: int) -> Path | None:
    """The file of a `from ... import` inside tests/ (None for anything outside it)."""
    if level:
        base = here.parent
        for _ in range(level - 1):
            base = base.parent
        parts = module.split(".") if module else []
    elif module and (module == "tests" or module.startswith("tests.")):
        base, parts = TESTS.parent, module.split(".")
    else:
        return None
    p = base.joinpath(*parts)
    for candidate in (p.with_suffix(".py"), p / "__init__.py"):
        if candidate.is_file() and TESTS in candidate.resolve().parents:
            return candidate.resolve()
    return None


@functools.cache
def _module(path: Path) -> _Module:
    return _Module(path)


def _facts_of(path: Path, name: str, seen: set[tuple[Path, str]] | None = None) -> _Facts:
    """Facts of `name` in module `path`, through everything it reaches there and by import."""
    seen = set() if seen is None else seen
    if (path, name) in seen:
        return frozenset()
    seen.add((path, name))
    mod = _module(path)
    if name in mod.imports:
        return _facts_of(*mod.imports[name], seen)
    scan = mod.defs.get(name)
    if scan is None:
        return frozenset()
    facts = set(scan.facts)
    if "ObjectStoreServer" in scan.names and TESTS / "helpers" / "servers" in path.parents:
        facts.add("servers")
    for ref in scan.names:
        if ref != name:
            facts |= _facts_of(path, ref, seen)
    return frozenset(facts)


def _closure(item: pytest.Item, names: set[str]) -> dict[str, Any]:
    """Every fixture reachable from `names` for this item, with its definitions."""
    manager = item.session._fixturemanager
    found: dict[str, Any] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in found:
            continue
        fdefs = manager.getfixturedefs(name, item) or ()
        found[name] = fdefs
        for fdef in fdefs:
            todo.extend(fdef.argnames)
    return found


def _fixture_facts(item: pytest.Item, names: set[str]) -> set[str]:
    """Facts of the fixtures `names` reach: `servers` when a server fixture is among them; those
    of fixtures defined in a test module or conftest.py (the plugin's own are `servers` only)."""
    facts: set[str] = set()
    closure = _closure(item, names)
    if SERVER_FIXTURES & set(closure):
        facts.add("servers")
    for fdefs in closure.values():
        for fdef in fdefs:
            func = inspect.unwrap(fdef.func)
            src = getattr(func, "__code__", None)
            if src is None:
                continue
            path = Path(src.co_filename).resolve()
            if TESTS in path.parents and "helpers" not in path.relative_to(TESTS).parts[:1] and path.suffix == ".py":
                facts |= _facts_of(path, func.__name__)
    return facts


def _asked_by_name(item: pytest.Item, facts: set[str]) -> set[str]:
    """Fixtures the test may ask for at run time: literal `getfixturevalue` arguments, and string
    parameters that name a fixture (`request.getfixturevalue(request.param)`)."""
    names = {f.removeprefix("fixture:") for f in facts if f.startswith("fixture:")}
    callspec = getattr(item, "callspec", None)
    if callspec is not None:
        names |= {v for v in callspec.params.values() if isinstance(v, str) and v.isidentifier()}
    return {n for n in names if item.session._fixturemanager.getfixturedefs(n, item)}


def _derive(item: pytest.Item) -> set[str]:
    facts: set[str] = set()
    path = item.path.resolve()
    if isinstance(item, pytest.Function) and TESTS in path.parents and path.suffix == ".py":
        facts |= _facts_of(path, item.originalname)
        if item.cls is not None:
            facts |= _facts_of(path, item.cls.__name__)
    names = set(getattr(item, "fixturenames", ()))
    facts |= _fixture_facts(item, names)
    facts |= _fixture_facts(item, _asked_by_name(item, facts) - names)
    return {f for f in facts if not f.startswith("fixture:")}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for name in sorted(_derive(item) - {m.name for m in item.iter_markers()}):
            item.add_marker(getattr(pytest.mark, name))


# --- the run-time audit (TIERCHECK_AUDIT_MARKS=1) ---

_started: list[str] = []


def _recording(what: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def record(*args: Any, **kwargs: Any) -> Any:
        _started.append(what if what != "subprocess.Popen" else f"{what}({str(args[1] if len(args) > 1 else '')[:80]})")
        return original(*args, **kwargs)

    return record


def _patch_spawns(mp: pytest.MonkeyPatch) -> None:
    import multiprocessing.process

    mp.setattr(subprocess.Popen, "__init__", _recording("subprocess.Popen", subprocess.Popen.__init__))
    mp.setattr(os, "fork", _recording("os.fork", os.fork))
    mp.setattr(os, "posix_spawn", _recording("os.posix_spawn", os.posix_spawn))
    base = multiprocessing.process.BaseProcess
    mp.setattr(base, "start", _recording("multiprocessing start", base.start))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if os.environ.get("TIERCHECK_AUDIT_MARKS") != "1":
        yield
        return
    mp = pytest.MonkeyPatch()
    _started.clear()
    _patch_spawns(mp)
    try:
        yield
    finally:
        mp.undo()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    if os.environ.get("TIERCHECK_AUDIT_MARKS") != "1" or call.when != "teardown" or not _started:
        return
    if item.get_closest_marker("procs") or item.get_closest_marker("servers"):
        return
    report = outcome.get_result()
    report.outcome = "failed"
    report.longrepr = f"started processes without the procs marker (tests/helpers/markers.py): {sorted(set(_started))}"
