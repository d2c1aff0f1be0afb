"""The guides in docs/ run: every ```python block of a guide, in order, in one
fresh interpreter per guide (the blocks of a guide build on each other), must
finish without an error, and the comments that state a printed value must
match what it printed (a line `print(x)  # 'v': ...` promises that the printed
line starts with v, quotes dropped), so a guide cannot drift from the code.
Guides without python blocks (docs/gpu-day.md: shell commands for a GPU
machine) are not run here.
"""
import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUIDES = sorted(p for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))
                if "```python" in open(p, encoding="utf-8").read())
BLOCK = re.compile(r"```python\n(.*?)```", re.S)
PROMISE = re.compile(r"^\s*print\(.*\)\s*#\s*'([^']*)'")


def blocks(path):
    return BLOCK.findall(open(path, encoding="utf-8").read())


def test_the_guides_are_found():
    assert any(p.endswith("precision.md") for p in GUIDES), GUIDES


@pytest.mark.parametrize("path", GUIDES, ids=[os.path.basename(p) for p in GUIDES])
def test_a_guide_runs_and_prints_what_it_says(path):
    code = "\n".join(blocks(path))
    promises = [m.group(1) for line in code.splitlines() if (m := PROMISE.match(line))]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DPCORE_WINOGRAD")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    printed = [line for line in out.stdout.splitlines() if not line.startswith("dpcore ")]
    assert len(printed) >= len(promises), printed
    # each promise is met by the next printed line that is not before the previous one's
    i = 0
    for want in promises:
        while i < len(printed) and not printed[i].replace("'", "").startswith(want):
            i += 1
        assert i < len(printed), f"{os.path.basename(path)} promises a line starting {want!r}; printed {printed}"
        i += 1
