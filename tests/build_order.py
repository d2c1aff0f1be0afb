"""The order in which the build starts its C compiles (setup.py's HEAVY_FIRST: the longest first),
for the tests that compile the core themselves."""
import ast
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def heavy_first():
    """setup.py's HEAVY_FIRST: the sources whose compiles the build starts first."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    return next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                and any(getattr(t, "id", None) == "HEAVY_FIRST" for t in node.targets))


def compile_order(paths):
    """paths sorted as the build starts their compiles: HEAVY_FIRST's first, then by name."""
    rank = {name: i for i, name in enumerate(heavy_first())}
    return sorted(paths, key=lambda p: (rank.get(os.path.basename(p), len(rank)), str(p)))
