"""Layering: agents/ -> frontend/ -> backend/ -> kernels/; nothing imports a layer above it."""

import ast
from pathlib import Path

import pytest

LAYERS = ["kernels", "backend", "frontend", "agents"]


def imported_layers(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
        found |= {n.split(".")[1] for n in names if n.startswith("cedar.") and n.count(".") >= 1}
    return found


@pytest.mark.parametrize("layer", LAYERS)
def test_no_layer_imports_one_above_it(layer):
    above = set(LAYERS[LAYERS.index(layer) + 1:])
    for path in sorted(Path(layer).rglob("*.py")):
        bad = imported_layers(path) & above
        assert not bad, f"{path} imports {bad}"
