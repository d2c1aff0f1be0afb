"""The fuzz harnesses in fuzz/ (see fuzz/README.md): each fuzzed for a bounded
time over a copy of its committed corpus, and each committed corpus replayed.

DPCORE_FUZZ_SECONDS sets the fuzzing time per harness (default 30). A finding
fails the test with the reproducer's path and the harness's output. atheris is
a test requirement (requirements-dev.txt): without it these tests fail, they
do not skip.
"""

import glob
import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FUZZ_DIR = os.path.join(REPO, "fuzz")
HARNESSES = sorted(glob.glob(os.path.join(FUZZ_DIR, "fuzz_*.py")))
FUZZ_SECONDS = int(os.environ.get("DPCORE_FUZZ_SECONDS", "30"))
# The harness process holds Python, numpy and dpcore (about 250 MB); the inputs
# are a few KB and the loaders bounded, so anything near this limit is a finding.
RSS_LIMIT_MB = 1536
PER_INPUT_TIMEOUT_S = 10


def harness_name(path):
    return os.path.basename(path)[len("fuzz_"):-len(".py")]


def corpus_dir(path):
    return os.path.join(FUZZ_DIR, "corpus", harness_name(path))


def require_atheris():
    if importlib.util.find_spec("atheris") is None:
        pytest.fail("atheris is not installed in this Python; it is a test requirement "
                    "(requirements-dev.txt): run scripts/bootstrap.sh")


def test_every_harness_has_a_committed_corpus():
    assert HARNESSES, f"no fuzz/fuzz_*.py found in {FUZZ_DIR}"
    for path in HARNESSES:
        files = glob.glob(os.path.join(corpus_dir(path), "*"))
        assert files, f"{path}: its seed corpus {corpus_dir(path)} is missing or empty"


@pytest.mark.parametrize("path", HARNESSES, ids=harness_name)
def test_committed_corpus_replays_cleanly(path):
    """Every seed through the harness's TestOneInput, in this process: a
    regression on a known input fails here however short the fuzzing."""
    require_atheris()
    spec = importlib.util.spec_from_file_location(f"dpcore_fuzz_{harness_name(path)}", path)
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)  # defines TestOneInput; fuzzes only as __main__
    seeds = sorted(glob.glob(os.path.join(corpus_dir(path), "*")))
    assert seeds
    for seed in seeds:
        with open(seed, "rb") as file:
            content = file.read()
        try:
            harness.TestOneInput(content)
        except Exception as exc:
            pytest.fail(f"{path}: the committed seed {seed} is a finding: {type(exc).__name__}: {exc}")


@pytest.mark.parametrize("path", HARNESSES, ids=harness_name)
def test_fuzz_for_a_bounded_time(path, tmp_path):
    """libFuzzer for DPCORE_FUZZ_SECONDS over a copy of the corpus (the repository
    is not modified); a crash, timeout or memory blow-up fails with its reproducer."""
    require_atheris()
    corpus = tmp_path / "corpus"
    shutil.copytree(corpus_dir(path), corpus)
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    command = [sys.executable, path, f"-max_total_time={FUZZ_SECONDS}", f"-rss_limit_mb={RSS_LIMIT_MB}",
               f"-timeout={PER_INPUT_TIMEOUT_S}", f"-artifact_prefix={artifacts}/", "-print_final_stats=1",
               str(corpus)]
    result = subprocess.run(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace", timeout=FUZZ_SECONDS + 300)
    output = "\n".join(line for line in result.stdout.splitlines()
                       if not line.startswith("INFO: Instrumenting"))
    reproducers = sorted(str(artifact) for artifact in artifacts.iterdir())
    if result.returncode != 0 or reproducers:
        pytest.fail(
            f"{path} found a problem (exit status {result.returncode}).\n"
            f"Reproducers (pytest keeps its last 3 temporary directories; libFuzzer also prints "
            f"each as Base64 below): {reproducers or 'none written'}\n"
            f"Replay one with: {sys.executable} {path} REPRODUCER; add it to {corpus_dir(path)} "
            f"once fixed.\nCommand: {' '.join(command)}\nOutput (last 6000 characters):\n{output[-6000:]}")
    assert "Done" in output and "runs in" in output, f"libFuzzer did not finish a run:\n{output[-3000:]}"
