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
import re
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


def run_fuzzer(path, seeds, seconds, work_dir):
    """libFuzzer on harness ``path`` for ``seconds`` over a copy of the directory
    ``seeds``; return (exit status, reproducer paths, output, command)."""
    corpus = work_dir / "corpus"
    shutil.copytree(seeds, corpus)
    artifacts = work_dir / "artifacts"
    artifacts.mkdir()
    command = [sys.executable, str(path), f"-max_total_time={seconds}", f"-rss_limit_mb={RSS_LIMIT_MB}",
               f"-timeout={PER_INPUT_TIMEOUT_S}", f"-artifact_prefix={artifacts}/", "-print_final_stats=1",
               str(corpus)]
    # libFuzzer's RSS limit reads the peak RSS (getrusage), which Linux keeps
    # across exec: a fuzzer exec'd straight from pytest would start at pytest's
    # own peak (2.9 GB after the training tests) and report an out-of-memory
    # finding on its first input. A shell forks the fuzzer instead (the
    # "; exit" keeps it from exec'ing its last command), so the fuzzer's peak
    # starts from the shell's few MB.
    result = subprocess.run(["/bin/sh", "-c", '"$@"; exit $?', "sh", *command], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace", timeout=seconds + 300)
    output = "\n".join(line for line in result.stdout.splitlines()
                       if not line.startswith("INFO: Instrumenting"))
    reproducers = sorted(str(artifact) for artifact in artifacts.iterdir())
    return result.returncode, reproducers, output, command


@pytest.mark.parametrize("path", HARNESSES, ids=harness_name)
def test_fuzz_for_a_bounded_time(path, tmp_path):
    """libFuzzer for DPCORE_FUZZ_SECONDS over a copy of the corpus (the repository
    is not modified); a crash, timeout or memory blow-up fails with its reproducer."""
    require_atheris()
    status, reproducers, output, command = run_fuzzer(path, corpus_dir(path), FUZZ_SECONDS, tmp_path)
    if status != 0 or reproducers:
        pytest.fail(
            f"{path} found a problem (exit status {status}).\n"
            f"Reproducers (pytest keeps its last 3 temporary directories; libFuzzer also prints "
            f"each as Base64 below): {reproducers or 'none written'}\n"
            f"Replay one with: {sys.executable} {path} REPRODUCER; add it to {corpus_dir(path)} "
            f"once fixed.\nCommand: {' '.join(command)}\nOutput (last 6000 characters):\n{output[-6000:]}")
    assert "Done" in output and "runs in" in output, f"libFuzzer did not finish a run:\n{output[-3000:]}"
    # The limit measures the harness, not the process that started it.
    inited = re.search(r"INITED .* rss: (\d+)Mb", output)
    assert inited and int(inited.group(1)) < RSS_LIMIT_MB // 2, (inited and inited.group(0), output[:3000])


def test_a_finding_is_reported_with_its_reproducer(tmp_path):
    """The runner above on a harness with a planted bug: a non-zero exit status
    and the reproducer written, so a finding cannot pass unnoticed."""
    require_atheris()
    harness = tmp_path / "fuzz_planted.py"
    harness.write_text(
        "import sys\nimport atheris\n\n"
        "def TestOneInput(data):\n"
        "    if data.startswith(b'boom'):\n"
        "        raise RuntimeError('planted bug')\n\n"
        "atheris.Setup(sys.argv, TestOneInput)\natheris.Fuzz()\n")
    seeds = tmp_path / "seeds"
    seeds.mkdir()
    (seeds / "harmless").write_bytes(b"hello")
    (seeds / "trigger").write_bytes(b"boom!")
    work_dir = tmp_path / "run"
    work_dir.mkdir()
    status, reproducers, output, _ = run_fuzzer(harness, seeds, 10, work_dir)
    assert status != 0, output[-3000:]
    assert "planted bug" in output
    assert len(reproducers) == 1 and os.path.basename(reproducers[0]).startswith("crash-"), reproducers
    with open(reproducers[0], "rb") as file:
        assert file.read().startswith(b"boom")
