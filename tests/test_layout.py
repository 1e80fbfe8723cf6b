"""The package's layout: imports point one way (docs/design.md), with no cycle and no
import hidden inside a function to dodge one."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "specdecode"
# Lower layers never import higher ones; a layer may import itself and anything below.
LAYERS = {"errors": 0, "options": 1, "questions": 1, "suites": 1, "models": 2, "core": 3, "policy": 4, "drafters": 5,
          "heads": 6, "plan": 7, "api": 8, "__init__": 9, "server": 10,
          "commands": 11}
# Imports made when first used, so that flags are checked before torch loads (seconds): the
# command line imports each command's module when it runs, the package its API on first use.
LAZY_ALLOWED = {"specdecode.commands.cli", "specdecode.commands.cli_heads", "specdecode.commands.cli_serve", "specdecode"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[str, bool]]:
    """(imported specdecode module, inside a function?) for every import in the file."""
    tree = ast.parse(path.read_text())
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.ImportFrom) and child.module and child.module.startswith("specdecode"):
                for alias in child.names:  # `from specdecode.heads import draft_vocab` imports a module
                    sub = f"{child.module}.{alias.name}"
                    where = PACKAGE.parent / sub.replace(".", "/")
                    is_module = where.with_suffix(".py").exists() or (where / "__init__.py").exists()
                    found.append((sub if is_module else child.module, nested))
            elif isinstance(child, ast.ImportFrom) and child.level:
                raise AssertionError(f"{path}: relative import; the package imports absolutely")
            elif isinstance(child, ast.Import):
                found.extend((a.name, nested) for a in child.names if a.name.startswith("specdecode"))
            visit(child, nested)

    visit(tree, False)
    return found


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}
GRAPH = {name: imports(path) for name, path in MODULES.items()}


def layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS["__init__"] if len(parts) == 1 else LAYERS[parts[1]]


def test_every_module_belongs_to_a_layer():
    assert all(len(m.split(".")) == 1 or m.split(".")[1] in LAYERS for m in MODULES), sorted(MODULES)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
    upward = [target for target, _ in GRAPH[module] if layer(target) > layer(module)]
    assert not upward, f"{module} imports a higher layer: {upward}"


def test_no_function_local_imports_of_the_package():
    hidden = {m: [t for t, nested in edges if nested] for m, edges in GRAPH.items() if m not in LAZY_ALLOWED}
    assert not {m: t for m, t in hidden.items() if t}


def test_no_import_cycle():
    edges = {m: {t for t, _ in GRAPH[m] if t in MODULES and t != m} for m in MODULES}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module, path):
        state[module] = 1
        for target in edges[module]:
            if state.get(target) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(target):] + [target]))
            if target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(MODULES):
        if module not in state:
            visit(module, [module])


@pytest.mark.parametrize("argv", [
    ["generate", "--prompt", "hi", "--drafter", "prompt-lookup", "--k", "0"],
    ["check", "--drafter", "prompt-lookup", "--samples", "0"],
    ["generate", "--prompt", "hi", "--dtype", "q5"],
])
def test_a_bad_flag_fails_before_torch_is_imported(argv):
    code = ("import sys; from specdecode.commands.cli import main; "
            f"rc = main({argv!r}); print(rc, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["2", "False"], out.stdout + out.stderr
