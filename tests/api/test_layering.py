"""The package's floors, read from its folders (docs/design.md, "Map of the house").

Each folder of `tiercheck/` is a floor: its `__init__.py` states ``FLOOR = n``, and a module
may import only from its own floor and the floors below it. Two kinds of top-level module
sit outside the folders: `errors.py`, the ground every floor stands on (floor 0, importing
nothing of the package), and the front door (`checkpointer.py`, `options.py`, `api.py`, the
package `__init__`), one floor above the tools; `__main__.py` is the command's entry and
stands with `cli/`. The pure floors (`format/`, `plan/`) start no thread and touch no file.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "tiercheck"


def _declared_floor(init: Path) -> int:
    for node in ast.parse(init.read_text("utf-8")).body:
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["FLOOR"]:
            value = ast.literal_eval(node.value)
            assert isinstance(value, int), f"{init}: FLOOR must be an int"
            return value
    raise AssertionError(f"{init.relative_to(PACKAGE.parent)} declares no FLOOR = n: every folder is a floor")


FLOORS: dict[str, int] = {
    d.name: _declared_floor(d / "__init__.py") for d in sorted(PACKAGE.iterdir()) if (d / "__init__.py").exists()
}
GROUND = 0
FRONT = max(f for name, f in FLOORS.items() if name not in ("cli", "integrations")) + 1
PURE_FLOORS = ("format", "plan")
EFFECTS = {"threading", "os", "socket", "subprocess", "concurrent", "fsspec", "signal"}


def layer(module: str) -> int:
    top = module.split(".")[0]
    if top in FLOORS:
        return FLOORS[top]
    if module == "errors":
        return GROUND
    if module == "__main__":
        return FLOORS["cli"]
    return FRONT


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts) or "__init__"


def runtime_imports(path: Path) -> list[tuple[str, int]]:
    """(imported module, line) for every import not under ``if TYPE_CHECKING:``; package
    modules as dotted names relative to the package, others as their top-level name."""
    tree = ast.parse(path.read_text("utf-8"))
    typing_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for node in ast.walk(block)
    }
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found += [(a.name.split(".")[0], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module.split(".")[0], node.lineno))
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
            if node.module:
                found.append((".".join([*base, node.module]), node.lineno))
            else:
                found += [(".".join([*base, a.name]), node.lineno) for a in node.names]
    return found


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_imports_follow_the_layers(path: Path) -> None:
    me = module_name(path)
    internal = {module_name(p) for p in MODULES}
    wrong = [
        f"line {line}: {me} (layer {layer(me)}) imports {target} (layer {layer(target)})"
        for target, line in runtime_imports(path)
        if target in internal and layer(target) > layer(me)
    ]
    assert wrong == []


@pytest.mark.parametrize(
    "path", [p for p in MODULES if p.relative_to(PACKAGE).parts[0] in PURE_FLOORS], ids=lambda p: module_name(p)
)
def test_decision_floors_are_pure(path: Path) -> None:
    effects = [f"line {line}: {target}" for target, line in runtime_imports(path) if target in EFFECTS]
    assert effects == [], f"{module_name(path)} is on a pure floor but imports {effects}"


def test_only_known_modules_sit_outside_the_floors() -> None:
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert loose == ["__init__.py", "__main__.py", "api.py", "checkpointer.py", "errors.py", "options.py"]


def test_floors_are_ordered_by_what_they_import() -> None:
    """No two floors share a number unless neither imports the other (cli, integrations)."""
    assert FLOORS["observe"] == GROUND
    by_number: dict[int, list[str]] = {}
    for name, floor in FLOORS.items():
        by_number.setdefault(floor, []).append(name)
    shared = {floor: sorted(names) for floor, names in by_number.items() if len(names) > 1}
    assert shared == {FLOORS["cli"]: ["cli", "integrations"]}


def test_the_design_map_follows_the_folders() -> None:
    """docs/design.md's map names every folder, lowest floor first, and every module in it."""
    text = (PACKAGE.parent / "docs" / "design.md").read_text("utf-8")
    heads = [m.group(1) for m in re.finditer(r"^### Floor \d+: `(\w+)/`", text, re.M)]
    expected = sorted(FLOORS, key=lambda name: (FLOORS[name], name))
    assert heads == expected
    missing = [
        module_name(p) for p in MODULES if p.name != "__init__.py" and f"`{p.name}`" not in text
    ]
    assert missing == [], f"modules missing from docs/design.md's map: {missing}"
