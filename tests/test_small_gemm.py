"""dpcore's own GEMM kernel (csrc/small_gemm.c: AVX-512, 8x32 register block,
built where the compiler targets AVX-512) against float64 references, and its
switch DPCORE_OWN_GEMM (0: the BLAS's GEMM everywhere).

It runs the products of Winograd F(2x2, 3x3) (tests/test_winograd.py checks
those against their bounds with the kernel on, the default) and the im2col
GEMMs of the CPU convolutions the implicit GEMM does not take (more than 64
output channels, ResNet-18's stride-2 and 1x1 layers): forward (A . B), dx
through col2im (A^T . B), dw (A . B^T, B packed a panel at a time). The
shapes below cross each of its edges: rows not a multiple of 8 (the one-row
kernel), columns not a multiple of 32 (masked loads and stores) nor of 16 (the
packing's scalar edge), K past its accumulation block (DP_GEMM_KB = 128: NN,
TN) and the NT packing's 512, and more than 128 rows (two row blocks).

The bound. On the kernel each output is summed in blocks of DP_GEMM_KB k, each
block one chain of fused multiply-adds from zero, the blocks' results added in
turn (|error| <= gamma_{KB + K/KB - 1} * sum |a_k b_k|: test_long_sums_are_blocked
holds it to that); for any BLAS, and for any grouping
of a sum of n products (blocks, groups of samples, threads' partials added
last), each product meets at most n roundings (its multiplication and n - 1
additions in any summation tree of n terms), so gamma_n bounds it whatever the
order, the core count or the ISA (issue 29); then:
  y  = the GEMM over the C*KH*KW taps, + bias:                 n = C*KH*KW + 1
  dx = col2im of w^T . dy (a sum over O, then up to KH*KW
       such columns added into one input pixel: O + KH*KW - 1),
       or, for stride-1 "same" layers, the convolution of dy
       with the flipped filter (one GEMM over O*KH*KW):        n = O*KH*KW
  dw = per group of samples a sum over its positions, the
       groups' and threads' partials added: N*OH*OW products   n = N*OH*OW
  db = likewise, N*OH*OW values of dy                          n = N*OH*OW
S, the computation in absolute values, is the float64 reference run on |x|,
|w|, |b|, |dy| (every term is a product of one entry of each).
(Before issue 29's audit dx used O + KH*KW, which the "same" case's single
GEMM over O*9 = 648 terms does not satisfy by derivation, dw a "+ 2 threads"
that assumed this machine's core count, and y, dx, dw, db also a fixed 1e-5 /
5e-5, read off one machine: dropped.)
"""
import subprocess

import numpy as np
import pytest

import dpcore as dp
from test_benchmarks import run_benchmark
from test_conv_cpu import U32, assert_switch_rejects, assert_within_dot_bounds, make, reference

ops = dp.ops
BUILT = dp.build_info()["cpu_gemm"] != "the BLAS"       # a kernel of dpcore's (AVX-512 or AVX2 + FMA)
AVX512 = "AVX-512" in dp.build_info()["cpu_gemm"]

# (N, C, H, W, O, K, stride, pad): each on the im2col path (O > 64: not the implicit GEMM's)
CASES = [
    (2, 64, 28, 28, 128, 3, 2, 1),    # ResNet-18's first stride-2 layer (K = 576: three k blocks)
    (3, 128, 7, 7, 256, 1, 2, 0),     # a 1x1 projection: 16 positions a sample
    (3, 40, 9, 11, 67, 3, 2, 1),      # 67 rows (8 blocks and 3 single rows), 5x6 outputs: ld 90
    (2, 33, 12, 12, 150, 3, 1, 0),    # 150 rows: two row blocks; K = 297; dx as col2im of a valid conv
    (9, 70, 15, 15, 72, 3, 1, 1),     # "same" padding: dx as a convolution (its GEMM over O*9 = 648)
    (40, 65, 6, 6, 66, 3, 1, 1),      # dw's K = 40*36 = 1440 per thread's group: NT k blocks; 585 packed
]


def run(case, seed):
    N, C, H, W, O, K, stride, pad = case
    x, w, b, dy = make(N, C, H, W, O, K, stride, pad, seed)
    y = ops.conv2d(x, w, b, stride=stride, padding=pad)
    dx, dw, db = ops.conv2d_backward(x, w, dy, stride=stride, padding=pad)
    return (x, w, b, dy), (y, dx, dw, db)


def check(case, seed):
    N, C, H, W, O, K, stride, pad = case
    (x, w, b, dy), (y, dx, dw, db) = run(case, seed)
    refs = reference(x, w, b, dy, stride, pad)
    sums = reference(np.abs(x), np.abs(w), np.abs(b), np.abs(dy), stride, pad)
    for got, ref, name in zip((y, dx, dw, db), refs, ("y", "dx", "dw", "db")):
        assert got.shape == ref.shape, name
    assert_within_dot_bounds(case, (y, dx, dw, db), refs, sums)
    return y, dx, dw, db


@pytest.fixture(autouse=True)
def gemm_path(monkeypatch):
    """Nothing on the Winograd paths (the im2col GEMMs are this file's subject)."""
    monkeypatch.setenv("DPCORE_WINOGRAD", "0")
    monkeypatch.setenv("DPCORE_FFT", "0")       # the FFT (fft_lanes.h) is not a GEMM path either


@pytest.mark.parametrize("own", ["1", "0"], ids=["own_gemm", "blas"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "N{}C{}H{}W{}O{}K{}s{}p{}".format(*c))
def test_within_the_bounds(monkeypatch, own, case):
    monkeypatch.setenv("DPCORE_OWN_GEMM", own)
    check(case, seed=sum(case))


@pytest.mark.skipif(not BUILT, reason="this build has no dpcore GEMM kernel (no AVX-512, no AVX2 + FMA): the switch has nothing to turn")
def test_the_switch_reaches_the_kernel(monkeypatch):
    """The switch by what it switches: _core.debug_counters() counts the GEMMs that went to
    dpcore's kernel and to the BLAS; on, the convolution's GEMMs go to the kernel (its A^T . B^T
    form, which none of these takes, would go to the BLAS), off, none does. Each setting gives
    the same bits twice, and test_within_the_bounds holds both to the float64 reference. (Whether
    the two give other bits than each other is no property of dpcore: a BLAS may sum in the
    kernel's order.)"""
    case = CASES[0]
    runs = {}
    for v in ("1", "0", "1"):
        monkeypatch.setenv("DPCORE_OWN_GEMM", v)
        before = dp._core.debug_counters()
        got = run(case, seed=5)[1]
        after = dp._core.debug_counters()
        own, blas = after["gemm_own"] - before["gemm_own"], after["gemm_blas"] - before["gemm_blas"]
        if v == "1":
            assert own > 0 and blas == 0, (own, blas)
        else:
            assert own == 0 and blas > 0, (own, blas)
        if v in runs:
            for a, c in zip(runs[v], got):
                np.testing.assert_array_equal(a, c)
        runs[v] = got


def gemm_kb():
    """csrc/small_gemm.h's DP_GEMM_KB, the kernel's accumulation block (a constant of the build)."""
    import os
    import re
    header = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "small_gemm.h")
    with open(header) as f:
        return int(re.search(r"^#define DP_GEMM_KB (\d+)", f.read(), re.M).group(1))


def gamma(n):
    return n * U32 / (1 - n * U32)


@pytest.mark.skipif(not BUILT, reason="this build has no dpcore GEMM kernel (no AVX-512, no AVX2 + FMA): the BLAS blocks K its own way")
@pytest.mark.parametrize("inputs", ["uniform", "one_way"])
@pytest.mark.parametrize("O, path", [(72, "im2col + GEMM kernel"), (48, "implicit GEMM")], ids=["gemm", "igemm"])
def test_long_sums_are_blocked(monkeypatch, O, path, inputs):
    """A sum of K = 8192 positive products (a 1x1 convolution over 8192 channels) within the
    blocked summation's worst-case bound. Each output is summed in blocks of KB (DP_GEMM_KB) k,
    each block one fused multiply-add chain from zero, the blocks' results added in turn: no
    product meets more than n = KB + K/KB - 1 roundings, so |y - y64| <= gamma_n S elementwise
    (S = y64 here, every term positive), and the relative 2-norm error too: gamma_191 = 1.1e-5
    at KB = 128, against the single chain's gamma_8192 = 4.9e-4. "one_way": every product 1 +
    a few ulp, so that while a long chain's partial sum is large each addition rounds the same
    way: one chain over all K (the kernel before the blocking) was 770 u off (u = 2^-24), past the
    bound; blocked it is a few u. "uniform": U(0, 1) operands, where one chain was 74 u at
    worst and 20 u in the 2-norm, blocked 7 u and 2 u. Both GEMM kernels: dpcore's own
    (O = 72 > 64: im2col) and the implicit GEMM's (O = 48), blocked alike."""
    monkeypatch.setenv("DPCORE_OWN_GEMM", "1")
    K, KB, H = 8192, gemm_kb(), 8
    rng = np.random.default_rng(32)
    if inputs == "uniform":
        x = rng.random((1, K, H, H), dtype=np.float32)
        w = rng.random((O, K, 1, 1), dtype=np.float32)
    else:
        x = (1.0 + rng.integers(1, 2 ** 10, (1, K, H, H)) * 2.0 ** -23).astype(np.float32)
        w = np.ones((O, K, 1, 1), np.float32)
    before = dp._core.debug_counters()["gemm_own"]
    y = ops.conv2d(x, w, None, stride=1, padding=0).astype(np.float64)
    assert (dp._core.debug_counters()["gemm_own"] > before) == (path == "im2col + GEMM kernel")
    ref = np.einsum("nkhw,ok->nohw", x.astype(np.float64), w[:, :, 0, 0].astype(np.float64))
    n = KB + (K + KB - 1) // KB - 1
    err = np.abs(y - ref)
    worst = float((err / ref).max())
    assert worst <= gamma(n), f"{path}: {worst / U32:.1f} u elementwise, bound gamma_{n} = {gamma(n) / U32:.0f} u"
    rel2 = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
    assert rel2 <= gamma(n), f"{path}: {rel2 / U32:.1f} u in the 2-norm"


def test_build_info_names_the_kernel():
    assert dp.build_info()["cpu_gemm"] in ("dpcore AVX-512 8x32 (DPCORE_OWN_GEMM=0: the BLAS)",
                                           "dpcore AVX2 6x16 (DPCORE_OWN_GEMM=0: the BLAS)", "the BLAS")


@pytest.mark.parametrize("value", ["yes", "2", "-1"])
def test_a_bad_switch_value_is_an_error(monkeypatch, value):
    """In every build (where the kernel is not built, the switch is still read)."""
    assert_switch_rejects(monkeypatch, "DPCORE_OWN_GEMM", value, 1, 8, 6, 80, 3, 2, 1)


def test_winograd_products_with_the_switch_off(monkeypatch):
    """The Winograd F(2x2, 3x3) products on the BLAS (the fallback where the kernel
    is not built): the same bounds as on the kernel (tests/test_winograd.py's check)."""
    from test_winograd import check as winograd_check
    monkeypatch.setenv("DPCORE_WINOGRAD", "1")
    monkeypatch.setenv("DPCORE_WINOGRAD_F43", "0")
    monkeypatch.setenv("DPCORE_OWN_GEMM", "0")
    for case in [(3, 64, 28, 28, 64), (5, 256, 7, 7, 256), (3, 64, 9, 13, 65)]:
        winograd_check(case, seed=sum(case))


def test_benchmark_quick_run():
    """benchmarks/bench_own_gemm.py end to end on a tiny batch: every row, nothing written."""
    proc = run_benchmark("bench_own_gemm.py", "--rounds", "1", "--reps", "1", "--batch", "2", "--steps", "1")
    for row in ("| 64 -> 64, 3x3 on 28x28 (Winograd F(2x2, 3x3)) | 2 |", "| 64 -> 128, 1x1 stride 2 on 28x28 (im2col) |",
                "whole ResNet-18 train_step", "OpenBLAS (dpcore's choice) / dpcore's", "SkylakeX" if AVX512 else ""):
        assert row in proc.stdout, proc.stdout


def skip_without_avx2_fma():
    from dpcore._blas_kernels import cpu_flags
    if not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("this CPU has no AVX2 + FMA: a -march=haswell program cannot run here")


def skip_where_native_is_avx2(native_test):
    """The -march=haswell twins of the native programs run the AVX2 forms on an AVX-512 machine;
    on a CPU with AVX2 and no AVX-512, -march=native compiles those same forms, which the native
    test runs."""
    skip_without_avx2_fma()
    from dpcore._blas_kernels import cpu_flags
    if "avx512f" not in cpu_flags():
        pytest.skip(f"this CPU has no AVX-512: its -march=native program is the AVX2 build, which {native_test} runs")


def run_native_c_check(tmp_path, program, core_sources, march="native", **env):
    """tests/c/<program>.c with the named csrc/ files, built for this CPU (-march=native, as the
    extension is: its AVX-512 code, where the CPU has it; or the given -march) under ASan and
    UBSan, run (env: variables of its own); it must say "<program>: ok" with no sanitizer
    report. Returns its output."""
    from test_sanitizers import ASAN_UBSAN, clean_env, compile_program
    exe = compile_program(tmp_path, program, core_sources, ASAN_UBSAN, link_flags=["-march=" + march])
    proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600,
                          env=clean_env(ASAN_OPTIONS="detect_leaks=1:halt_on_error=1",
                                        UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1", **env))
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, report
    assert f"{program}: ok" in proc.stdout, report
    assert "runtime error" not in report and "Sanitizer" not in report, report
    return report


def test_kernel_against_float64_under_the_sanitizers(tmp_path):
    """tests/c/small_gemm_check.c: NN, TN and NT at the kernel's edges (rows around
    its 8-row block, columns around 16 and 32, K around its blocks, empty sizes)
    within gamma_K of a double reference, nothing written outside C's block, NT's
    accumulation the same bits as one call; built for this CPU (-march=native, as
    the extension is) with ASan and UBSan. Without AVX-512 it checks that the
    kernel reports itself not built."""
    report = run_native_c_check(tmp_path, "small_gemm_check", ["small_gemm.c", "status.c"])
    # -march=native targets AVX-512 (or AVX2 and FMA) exactly where this CPU has it (whatever the
    # extension's build did)
    from dpcore._blas_kernels import cpu_flags
    flags = cpu_flags()
    assert ("not built" in report) == ("avx512f" not in flags and not {"avx2", "fma"} <= flags), report


def test_avx2_kernel_against_float64_under_the_sanitizers(tmp_path):
    """The same check of the AVX2 + FMA kernel (6x16 block; what an AVX2-only machine's
    -march=native build runs), built with -march=haswell on a CPU that has AVX2 and FMA."""
    skip_where_native_is_avx2("test_kernel_against_float64_under_the_sanitizers")
    report = run_native_c_check(tmp_path, "small_gemm_check", ["small_gemm.c", "status.c"], march="haswell")
    assert "not built" not in report, report


def test_winograd_bits_do_not_depend_on_the_thread_count(tmp_path):
    """tests/c/winograd_threads.c: Winograd F(2x2, 3x3)'s y, dx, dw and db on 1, 2, 3, 5
    and 17 threads, the same bits (wide and narrow planes, chunks of unequal sizes): the
    threads that transform their own GEMMs' entries (with AVX-512) neither race nor
    change a sum's order. Built for this CPU under ASan and UBSan."""
    run_native_c_check(tmp_path, "winograd_threads", ["winograd.c", "small_gemm.c", "status.c", "cpu_caches.c"])


def test_winograd_avx2_forms_bits_do_not_depend_on_the_thread_count(tmp_path):
    """The same program built with -march=haswell (an AVX2-only machine's build: the AVX2 GEMM
    kernel, the bordered planes' input and the short rows' output transforms 8 tiles a vector,
    masked to the rows and tiles), under ASan and UBSan, on a CPU that has AVX2 and FMA. The
    bits' independence of the threads is the kernel's (the BLAS blocks by the call): the
    kernel asked for (DPCORE_OWN_GEMM=1) whatever the environment says."""
    skip_where_native_is_avx2("test_winograd_bits_do_not_depend_on_the_thread_count")
    run_native_c_check(tmp_path, "winograd_threads", ["winograd.c", "small_gemm.c", "status.c", "cpu_caches.c"], march="haswell",
                       DPCORE_OWN_GEMM="1")


def test_stride2_winograd_bits_and_blocks(tmp_path):
    """tests/c/winograd_s2_threads.c: the stride-2 Winograd (csrc/winograd_s2.c) with its
    groups, blocks and rounds made small: y, dx, dw and db against a double direct
    convolution, the same bits on 1, 2, 3, 5 and 17 threads, nothing read from the
    scratch that the pass did not write (it starts as NaN). Built for this CPU under
    ASan and UBSan."""
    run_native_c_check(tmp_path, "winograd_s2_threads", ["winograd.c", "small_gemm.c", "status.c", "cpu_caches.c"])


def test_stride2_winograd_avx2_forms(tmp_path):
    """The same program built with -march=haswell (an AVX2-only machine's build: the AVX2
    GEMM kernel, the lane planes' 8x8 register transposes, the filter transform 8 pairs a
    vector), under ASan and UBSan, on a CPU that has AVX2 and FMA; the kernel asked for, as above."""
    skip_where_native_is_avx2("test_stride2_winograd_bits_and_blocks")
    run_native_c_check(tmp_path, "winograd_s2_threads", ["winograd.c", "small_gemm.c", "status.c", "cpu_caches.c"], march="haswell",
                       DPCORE_OWN_GEMM="1")
