"""The package's layers (docs/design.md, "Map of the house"): a module imports only from
its own layer and the layers above it, and the pure decision modules start no thread and
touch no file."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tiercheck"

# Layer 0: values and format (pure); 1: stores; 2: work on one step; 3 (everything else):
# orchestration and front ends.
LAYERS: list[set[str]] = [
    {
        "errors",
        "layout",
        "manifest",
        "dtypes",
        "checksum",
        "state",
        "structure",
        "planner",
        "placement",
        "steporder",
        "stepdoc",
        "retarget",
        "retention",
        "schedule",
        "progress",
        "events",
    },
    {
        "tiers",
        "tiers.base",
        "tiers.local",
        "tiers.remote",
        "tiers.multipart",
        "tiers.open",
        "tiers.copy",
        "tiers.codec",
        "throttle",
        "retry",
        "priority",
        "catalog",
        "store",
        "commit",
        "agreement",
        "coordination",
    },
    {"staging", "writestep", "upload", "pruner", "restore", "runlog", "goodput", "handle"},
]
PURE = {"placement", "steporder", "stepdoc", "retention", "planner", "manifest", "layout", "retarget", "schedule"}
EFFECTS = {"threading", "os", "socket", "subprocess", "concurrent", "fsspec", "signal"}


def layer(module: str) -> int:
    for i, members in enumerate(LAYERS):
        if module in members:
            return i
    return len(LAYERS)


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


@pytest.mark.parametrize("name", sorted(PURE))
def test_decision_modules_are_pure(name: str) -> None:
    path = PACKAGE / f"{name}.py"
    effects = [f"line {line}: {target}" for target, line in runtime_imports(path) if target in EFFECTS]
    assert effects == [], f"{name}.py is a pure decision module but imports {effects}"


def test_every_module_is_placed_in_the_design_map() -> None:
    text = (PACKAGE.parent / "docs" / "design.md").read_text("utf-8")
    missing = [
        module_name(p) for p in MODULES if p.name != "__init__.py" and p.parent == PACKAGE and f"`{p.name}`" not in text
    ]
    assert missing == [], f"modules missing from docs/design.md's map: {missing}"
