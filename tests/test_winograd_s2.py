"""The stride-2 Winograd for 3x3 stride-2 pad-1 convolutions (csrc/winograd_s2.c):
the forward pass, dx and dw against the float64 reference of tests/test_conv_cpu.py.

The algorithm (winograd_s2.h): each 2x2 block of outputs from the 5x5 input tile d
around it (tiles at stride 4), y = A^T [ (G g G^T) . (B^T d B) ] A summed over the
input channels, with

    B^T = [[1, 0, -1, 0, 0], [0, 0, 1, 0, 0], [0, 0, -1, 0, 1], [0, 1, 0, 0, 0], [0, 0, 0, 1, 0]]
    G   = [[1, 0, 0], [1, 0, 1], [0, 0, 1], [0, 1, 0], [0, 1, 0]]
    A^T = [[1, 1, 0, 1, 0], [0, 1, 1, 0, 1]]

The error bound, as tests/test_winograd.py derives F(2x2, 3x3)'s: every computed
value is an exact expression of the float32 inputs whose terms each carry at most k
rounding factors (1 + d_i), |d_i| <= u = 2^-24, so |computed - exact| <= gamma_k * S,
S the same expression with every coefficient and input in absolute value. Counting
the roundings on the longest path:

  forward: G g G^T adds 2 terms twice (2), B^T d B 2 terms twice (2), the product
  (1), the GEMM's sum over the C channels (C - 1), A^T M A adds 3 terms twice (4),
  the bias (1): k = C + 9;
  dx: A dY A^T (2), U (2), the product (1), the sum over the O channels (O - 1),
  B Z B^T adds 3 terms twice (4), and a pixel where up to 4 tiles overlap gets up
  to 3 more additions (3): k = O + 11;
  dw: A dY A^T (2), B^T d B (2), the product (1), the sum over the products that
  share a matrix (up to 4) and every tile of the batch (4 T - 1), G'^T dU G' adds
  2 terms twice (2): k = 4 T + 6.

  db: the plain sum of the N*OH*OW values of dy: k = N*OH*OW.

The bounds are the worst case and hold on any GEMM (dpcore's kernel, OpenBLAS
of any core type). Issue 29 dropped the fixed relative tolerances (1e-5, 5e-5)
the tests also asserted (read off one machine), and the tests that held two
paths to differing bits (nothing guarantees it): which path ran is shown by
what it computes (B^T's first row adds d0 - d2 of the input, A's second row
dY0 + dY1 of dy, before any multiplication: +-2^127 there overflow, where a
path that multiplies first stays finite; tests/winograd_common.py's helper).
"""
import os

import numpy as np
import pytest

import dpcore as dp
from test_benchmarks import run_benchmark
from test_conv_cpu import assert_empty_batch, assert_within_bound, make
from winograd_common import abs_dw, abs_dx, abs_forward, check_within_bounds
from winograd_common import finite_with_pixels_that_overflow_when_added

ops = dp.ops

B_T = np.array([[1, 0, -1, 0, 0], [0, 0, 1, 0, 0], [0, 0, -1, 0, 1], [0, 1, 0, 0, 0], [0, 0, 0, 1, 0]], dtype=np.float64)
G = np.array([[1, 0, 0], [1, 0, 1], [0, 0, 1], [0, 1, 0], [0, 1, 0]], dtype=np.float64)
A_T = np.array([[1, 1, 0, 1, 0], [0, 1, 1, 0, 1]], dtype=np.float64)


# The transforms in absolute value (B^T has -1 entries): S of the docstring.
S2_MATS = (np.abs(A_T), np.abs(G), np.abs(B_T))


def s2_abs(x, w, b):
    """S of the forward pass, (N, O, OH, OW)."""
    return abs_forward(x, w, b, S2_MATS, 2, 1)


def s2_abs_dx(x_shape, w, dy):
    """S of dx, (N, C, H, W): each tile's B [U^T . (A dY A^T)] B^T added where the tile lies."""
    return abs_dx(x_shape, w, dy, S2_MATS, 2, 1)


def s2_abs_dw(x, dy):
    """S of dw, (O, C, 3, 3)."""
    return abs_dw(x, dy, S2_MATS, 2, 1)


@pytest.fixture
def s2_on(monkeypatch):
    monkeypatch.setenv("DPCORE_WINOGRAD", "1")
    monkeypatch.setenv("DPCORE_WINOGRAD_S2", "1")


def run(x, w, b, dy):
    y = ops.conv2d(x, w, b, stride=2, padding=1)
    dx, dw, db = ops.conv2d_backward(x, w, dy, stride=2, padding=1)
    return y, dx, dw, db


def check(case, seed, use_bias=True):
    """y, dx, dw and db within their bounds (the docstring's S and k)."""
    N, C, H, W, O = case

    def bounds(x, w, bias, dy, y):
        tiles = N * ((y.shape[2] + 1) // 2) * ((y.shape[3] + 1) // 2)
        return ((s2_abs(x, w, bias), C + 9), (s2_abs_dx(x.shape, w, dy), O + 11),
                (s2_abs_dw(x, dy), 4 * tiles + 6))
    return check_within_bounds(case, N, C, H, W, O, 3, 2, 1, seed, use_bias, bounds)[4:6]


# (N, C, H, W, O): batches the path takes (at least 16 samples, at most a quarter of
# the last chunk's lanes idle, its multiplies at most 0.8 of the direct form's)
CASES = [
    (16, 64, 28, 28, 128),   # ResNet-18's first downsampling layer (28x28 -> 14x14), one chunk
    (32, 256, 7, 7, 512),    # its last (7x7 -> 4x4): 2x2 tiles a sample, two chunks
    (48, 32, 8, 8, 40),      # three chunks, a 4x4 output
    (28, 40, 12, 12, 48),    # two chunks, the second short (12 of 16 lanes)
    (32, 40, 29, 30, 32),    # 15x15 outputs: the tiles' last row and column half outside
    (16, 33, 4, 28, 35),     # a 2x14 output, odd channel counts
]


def takes(N, C, H, W, O):
    """winograd_s2.c's rule: 16+ samples, 32+ channels in and out, and the multiplies
    (25 a 2x2 block and lane, idle lanes and blocks past the edge included) at most
    0.8 of the direct form's 36 a block."""
    OH, OW = (H - 1) // 2 + 1, (W - 1) // 2 + 1
    lanes = -(-N // 16) * 16
    return N >= 16 and min(C, O) >= 32 and \
        25 * 4 * ((OH + 1) // 2) * ((OW + 1) // 2) * lanes <= 0.8 * 36 * OH * OW * N


@pytest.mark.parametrize("case", CASES, ids=lambda c: "N{}C{}H{}W{}O{}".format(*c))
def test_forward_dx_dw_within_the_bounds(s2_on, case):
    assert takes(*case)
    check(case, seed=sum(case))


def test_bias_none(s2_on):
    case = (16, 32, 8, 12, 32)
    y, _ = check(case, seed=3, use_bias=False)
    x, w, b, _ = make(*case[:4], case[4], 3, 2, 1, seed=3)
    np.testing.assert_array_equal(y, ops.conv2d(x, w, np.zeros_like(b), stride=2, padding=1))


def test_empty_batch(s2_on):
    """(the GEMM path's: the path takes batches of 16 or more)"""
    assert_empty_batch(64, 14, 64, 3, 2)


def test_the_switch_reaches_the_kernel(monkeypatch):
    """On: the path's transforms ran, by what they compute (the docstring's overflow: x's rows 3
    and 5 are d0 and d2 of the tiles that start at row 3; dy's rows 0 and 1 one block's dY0 and
    dY1); off, the GEMM path multiplies first and stays finite. Off (either switch), and where
    the path does not take the layer (fewer than 16 samples, a batch that would leave lanes idle,
    too few channels, an odd-sized plane whose tiles would multiply more than 0.8 of the direct
    form, stride 1 or other padding): both settings run the GEMM path (dp_s2_takes refuses it;
    nothing else reads DPCORE_WINOGRAD_S2), the same bits by construction."""
    def both(case, stride=2, pad=1, **env):
        x, w, b, dy = make(*case[:4], case[4], 3, stride, pad, seed=4)
        out = {}
        for v in ("0", "1"):
            monkeypatch.setenv("DPCORE_WINOGRAD_S2", v)
            for k, val in env.items():
                monkeypatch.setenv(k, val)
            out[v] = (ops.conv2d(x, w, b, stride=stride, padding=pad),) + \
                ops.conv2d_backward(x, w, dy, stride=stride, padding=pad)[:2]
        return out
    monkeypatch.setenv("DPCORE_WINOGRAD", "1")
    big = 2.0 ** 127
    for v, finite in (("1", (False, False, False)), ("0", (True, True, True))):
        monkeypatch.setenv("DPCORE_WINOGRAD_S2", v)
        assert finite_with_pixels_that_overflow_when_added(
            (16, 32, 12, 12, 32), 2, [(3, 3, big), (5, 3, -big)], [(0, 1, big), (1, 1, big)]) == finite, v
    for case, kw in [((15, 32, 12, 12, 32), {}), ((20, 32, 12, 12, 32), {}), ((16, 16, 12, 12, 32), {}),
                     ((16, 32, 12, 12, 24), {}), ((16, 32, 10, 10, 32), {}), ((16, 32, 14, 14, 32), {}),
                     ((16, 32, 12, 12, 32), {"pad": 0}), ((16, 32, 12, 12, 32), {"DPCORE_WINOGRAD": "0"})]:
        assert not takes(*case) or kw
        runs = both(case, **kw)
        for gemm, s2 in zip(runs["0"], runs["1"]):
            np.testing.assert_array_equal(gemm, s2, err_msg=f"{case} {kw}")


def test_a_bad_switch_value_is_an_error(monkeypatch):
    monkeypatch.setenv("DPCORE_WINOGRAD_S2", "yes")
    x, w, b, _ = make(16, 32, 4, 4, 32, 3, 2, 1, seed=1)
    with pytest.raises(ValueError, match="DPCORE_WINOGRAD_S2"):
        ops.conv2d(x, w, b, stride=2, padding=1)


def test_samples_do_not_depend_on_the_batch(s2_on):
    """A sample's y and dx come from its own lane: on dpcore's GEMM kernel (whose
    columns are each summed alone, in k order in fixed blocks) the same bits in a batch of 32 and in
    any batch of 16 or more that holds it, at any place. On the BLAS (builds without
    dpcore's kernel, or DPCORE_OWN_GEMM=0) the GEMMs' widths follow the batch, and
    OpenBLAS's blocking with them: there two computations of one value, each within
    gamma_k S of it (the docstring's k and S), so within 2 gamma_k S of each other."""
    N, C, H, W, O = 32, 48, 12, 12, 40
    x, w, b, dy = make(N, C, H, W, O, 3, 2, 1, seed=9)
    y_all = ops.conv2d(x, w, b, stride=2, padding=1)
    dx_all = ops.conv2d_backward(x, w, dy, stride=2, padding=1)[0]
    own = dp.build_info()["cpu_gemm"].startswith("dpcore") and os.environ.get("DPCORE_OWN_GEMM", "1") == "1"
    S_y, S_dx = s2_abs(x, w, b), s2_abs_dx(x.shape, w, dy)

    def same(a, c, S, k, what):
        if own:
            np.testing.assert_array_equal(a, c, err_msg=what)
        else:
            assert_within_bound(a, c.astype(np.float64), 2 * S, k, what)   # 2 gamma_k S <= gamma_k (2 S)
    for lo, hi in [(0, 16), (16, 32), (5, 21), (3, 31)]:
        assert takes(hi - lo, C, H, W, O)
        same(ops.conv2d(x[lo:hi], w, b, stride=2, padding=1), y_all[lo:hi], S_y[lo:hi], C + 9, f"y {lo}:{hi}")
        same(ops.conv2d_backward(x[lo:hi], w, dy[lo:hi], stride=2, padding=1)[0], dx_all[lo:hi], S_dx[lo:hi],
             O + 11, f"dx {lo}:{hi}")
    perm = np.random.default_rng(1).permutation(N)
    same(ops.conv2d(x[perm], w, b, stride=2, padding=1), y_all[perm], S_y[perm], C + 9, "y permuted")


def test_repeatable_after_other_shapes(s2_on):
    """The scratch holds another geometry's numbers (the zero borders written again)."""
    x, w, b, dy = make(16, 32, 8, 8, 32, 3, 2, 1, seed=5)
    first = run(x, w, b, dy)
    check((32, 64, 12, 12, 48), seed=6)
    again = run(x, w, b, dy)
    for a, c in zip(first, again):
        np.testing.assert_array_equal(a, c)


def test_resnet18_takes_its_downsampling_layers(s2_on, monkeypatch):
    """ResNet-18 at 28x28 inputs and batch 32: of its three 3x3 stride-2 layers (64 -> 128 on
    28x28, 128 -> 256 on 14x14, 256 -> 512 on 7x7) the path takes the first and the last (by
    winograd_s2.c's rule, which test_the_switch_reaches_the_kernel ties to the C side), whose
    geometries CASES hold to the derived bounds; and a training step through the path gives a
    finite loss and finite updates. Issue 29: the step is no longer compared with the GEMM path's
    within 1e-5 (loss) and 1 % (updates): those were read off one machine, and a whole network's
    difference (ReLU inputs within rounding of 0 flipping, BatchNorm over few values) has no
    derived float32 bound; nor asserted to differ from it (no kernel choice guarantees that)."""
    assert [takes(32, c, h, h, 2 * c) for c, h in ((64, 28), (128, 14), (256, 7))] == [True, False, True]
    rng = np.random.default_rng(0)
    X = rng.random((32, 1, 28, 28), dtype=np.float32)
    y = rng.integers(0, 10, 32)
    net = dp.models.ResNet18(devices=["cpu:0"], seed=3)
    before = net.get_weights()
    loss = net.train_step(X, y, lr=0.05)[0]
    assert np.isfinite(loss)
    after = net.get_weights()
    assert all(np.isfinite(after[k]).all() for k in after)
    assert any(not np.array_equal(after[k], before[k]) for k in after)


def test_benchmark_quick_run():
    """benchmarks/bench_winograd_s2.py end to end on a tiny run: every row, nothing written."""
    proc = run_benchmark("bench_winograd_s2.py", "--rounds", "1", "--steps", "1", "--layer-reps", "1", "--batch", "16")
    for row in ("| 64x28x28 -> 128 | forward |", "| 256x7x7 -> 512 | backward |", "whole ResNet-18 train_step",
                "GEMM / stride-2 Winograd", "stride-2 Winograd, no huge pages / stride-2 Winograd"):
        assert row in proc.stdout, proc.stdout
