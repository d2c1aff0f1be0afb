"""dpcore names OpenBLAS's kernels from the CPU's instruction sets unless the user has
(python/dpcore/_blas_kernels.py): Debian's OpenBLAS 0.3.21 falls back to its SSE3 kernels on
some virtual CPUs, several times slower."""
import os
import subprocess
import sys

import dpcore as dp
from dpcore import _blas_kernels


def test_kernels_chosen_from_cpu_flags():
    avx512 = {"avx", "avx2", "fma", "avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}
    assert _blas_kernels.choose(avx512) == "SkylakeX"
    assert _blas_kernels.choose(avx512 - {"avx512bw"}) == "Haswell"  # Knights Landing-like: no BW/VL
    assert _blas_kernels.choose({"avx", "avx2", "fma"}) == "Haswell"
    assert _blas_kernels.choose({"avx", "avx2"}) == "Sandybridge"
    assert _blas_kernels.choose({"avx"}) == "Sandybridge"
    assert _blas_kernels.choose({"sse2", "sse3"}) is None  # OpenBLAS's own choice
    assert _blas_kernels.choose(set()) is None


def test_loaded_kernels_match_the_cpu():
    """Without OPENBLAS_CORETYPE the kernels in use are the ones the CPU flags name, never the
    SSE3 fallback on an AVX machine."""
    forced = os.environ.get("OPENBLAS_CORETYPE")
    config = dp.build_info()["blas_config"].split()
    want = forced or _blas_kernels.choose(_blas_kernels.cpu_flags())
    if want:
        assert want.lower() in (w.lower() for w in config), (want, config)


def test_environment_left_as_the_user_set_it():
    code = "import os, dpcore as dp; print(os.environ.get('OPENBLAS_CORETYPE')); print(dp.build_info()['blas_config'])"
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[0] == "None", out  # set while OpenBLAS loaded, then removed
    env["OPENBLAS_CORETYPE"] = "Sandybridge"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[0] == "Sandybridge" and "Sandybridge" in out.splitlines()[1], out
    env["OPENBLAS_CORETYPE"] = "Prescott"
    env.pop("DPCORE_BLAS_AUTO_CORETYPE", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert "Prescott" in out.splitlines()[1], out  # the user's choice wins
