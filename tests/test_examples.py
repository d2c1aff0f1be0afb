"""The examples start: their imports resolve and their options parse (the
training runs themselves are the book's experiments: tests/test_train.py runs
LeNet's with the same calls)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("script", ["train_lenet.py", "train_resnet.py"])
def test_example_parses_its_options(script):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--cpu-devices" in proc.stdout and "--gpu-devices" in proc.stdout
