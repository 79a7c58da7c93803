"""Layering by role, bottom-up: kernels -> backend (the serving core) -> frontend -> agents ->
training (corpus and trainer) -> drivers (benchmarks, soak, evaluation, fidelity) -> cli. No
module imports a layer above its own, absolutely or relatively (a relative import is resolved
from the importing file's place)."""

import ast
from pathlib import Path

import pytest

LAYERS = ["kernels", "backend", "frontend", "agents", "training", "drivers", "cli"]
ROOT = Path(__file__).resolve().parents[1]


def module_of(path: Path) -> list[str]:
    """``drivers/bench/hits.py`` -> ["cedar", "drivers", "bench", "hits"] (a package: its folder)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ["cedar"] + (parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Every cedar module ``path`` imports, relative imports resolved."""
    here = module_of(path)
    package = here if path.name == "__init__.py" else here[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                found.add(node.module or "")
            else:
                base = package[:len(package) - (node.level - 1)]
                found.add(".".join(base + ([node.module] if node.module else [])))
    return {m for m in found if m.startswith("cedar.")}


def imported_layers(path: Path) -> set[str]:
    return {m.split(".")[1] for m in imported_modules(path)}


@pytest.mark.parametrize("layer", LAYERS)
def test_no_layer_imports_one_above_it(layer):
    above = set(LAYERS[LAYERS.index(layer) + 1:])
    files = sorted((ROOT / layer).rglob("*.py"))
    assert files
    for path in files:
        bad = imported_layers(path) & above
        assert not bad, f"{path} imports {bad}"


def test_relative_imports_are_resolved(tmp_path, monkeypatch):
    """The check sees a relative import that climbs into another layer (it can fail)."""
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    bad = tmp_path / "backend" / "serving" / "x.py"
    bad.parent.mkdir(parents=True)
    bad.write_text("from ...drivers.bench import hits\nfrom .planner import ServingFlags\n")
    assert imported_modules(bad) == {"cedar.drivers.bench", "cedar.backend.serving.planner"}
    assert imported_layers(bad) & {"drivers"}


def test_every_top_level_package_is_a_layer():
    """A new top-level folder of Python code must be placed in the order above."""
    tops = {p.parent.relative_to(ROOT).parts[0] for p in ROOT.glob("*/__init__.py")}
    assert tops <= set(LAYERS), tops - set(LAYERS)


def test_every_cedar_import_resolves():
    """Every cedar module a file of a layer or of ``scripts/`` imports (lazily inside a function
    too, relative ones resolved) exists: a moved module leaves no import behind that only fails when its command runs."""
    import importlib.util

    missing = []
    for layer in LAYERS + ["scripts"]:  # NOTE: scripts/ sits above every layer (it may import any)
        for path in sorted((ROOT / layer).rglob("*.py")):
            for m in imported_modules(path):
                if importlib.util.find_spec(m) is None:
                    missing.append(f"{path.relative_to(ROOT)}: {m}")
    assert not missing, missing


def test_each_cli_command_loads_only_its_own_layer():
    """Every command in ``cedar.cli.COMMANDS`` is registered by its module (a fresh interpreter
    each, no entry points), and loading it imports no layer above that module's: ``cedar serve``
    does not import the trainer, the drivers or the agents."""
    import json
    import subprocess
    import sys

    from cedar.cli import COMMANDS

    code = (
        "import json, sys\n"
        "from cedar.cli import build_parser\n"
        "found = {}\n"
        "for name in sys.argv[1:]:\n"
        "    sub = next(a for a in build_parser(name)._actions if a.dest == 'command')\n"
        "    found[name] = name in sub.choices\n"
        "print(json.dumps([found, sorted({m.split('.')[1] for m in sys.modules if m.startswith('cedar.')})]))\n")
    by_module: dict[str, list[str]] = {}
    for name, (module, _) in COMMANDS.items():
        by_module.setdefault(module, []).append(name)
    for module, names in by_module.items():  # NOTE: one interpreter per module: its commands share it
        done = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (module, done.stderr[-2000:])
        found, layers = json.loads(done.stdout.strip().splitlines()[-1])
        assert found == {name: True for name in names}, (module, found)
        own = module.split(".")[1]
        above = set(LAYERS[LAYERS.index(own) + 1:]) - {"cli"}
        assert not set(layers) & above, (module, sorted(set(layers) & above))
