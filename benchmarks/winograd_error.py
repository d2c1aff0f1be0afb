"""Where the CPU path's rounding error comes from: each convolution variant's
forward pass, input gradient and weight gradient against float64, on the
shapes LeNet and ResNet-18 train with (and the FFT, csrc/fft_lanes.h, which the
default precision runs on LeNet's 5x5 layers), beside the GEMM path
(DPCORE_WINOGRAD=0 DPCORE_FFT=0)
and PyTorch float32 (when the benchmark venv has it: benchmarks/setup_bench_env.sh).

    benchmarks/.venv-bench/bin/python benchmarks/winograd_error.py [--seeds 3] [--markdown]

The error of a result r against the float64 reference e is ||r - e||_2 / ||e||_2
(the whole tensor's: stable from seed to seed); the table gives the median over
seeds of each, and the ratio of the fast path's to PyTorch float32's (else to the
GEMM path's). Inputs are what the layers see in training: non-negative
activations (after ReLU / pooling), He-scaled weights, a standard-normal dy.
"""
import argparse
import os
import sys

import numpy as np

try:  # before dpcore: dpcore's CUDA build loads an NCCL that torch's own must not meet first
    import torch
except ImportError:
    torch = None
import dpcore as dp  # noqa: E402

# (name, variant, N, C, H, W, O, K, stride, pad, extra environment)
SHAPES = [
    ("LeNet conv2 20->50 13x13 5x5", "F(3x3,5x5)", 64, 20, 13, 13, 50, 5, 1, 0, {"DPCORE_WINOGRAD_F35": "1"}),
    ("LeNet conv2 20->50 13x13 5x5", "FFT 16x16", 64, 20, 13, 13, 50, 5, 1, 0, {"DPCORE_FFT": "1"}),
    ("book LeNet 6->16 14x14 5x5", "FFT 16x16", 64, 6, 14, 14, 16, 5, 1, 0, {"DPCORE_FFT": "1"}),
    ("ResNet 64->64 24x24 3x3", "F(2x2,3x3)", 16, 64, 24, 24, 64, 3, 1, 1, {}),
    ("ResNet 64->64 24x24 3x3", "F(4x4,3x3)", 16, 64, 24, 24, 64, 3, 1, 1, {"DPCORE_WINOGRAD_F43": "1"}),
    ("ResNet 128->128 12x12 3x3", "F(2x2,3x3)", 16, 128, 12, 12, 128, 3, 1, 1, {}),
    ("ResNet 256->256 6x6 3x3", "F(2x2,3x3)", 16, 256, 6, 6, 256, 3, 1, 1, {}),
    ("ResNet 512->512 3x3 3x3", "F(2x2,3x3)", 16, 512, 3, 3, 512, 3, 1, 1, {}),
    ("ResNet 64->128 24x24 3x3 s2", "stride-2", 16, 64, 24, 24, 128, 3, 2, 1, {"DPCORE_WINOGRAD_S2": "1"}),
    ("ResNet 128->256 12x12 3x3 s2", "stride-2", 16, 128, 12, 12, 256, 3, 2, 1, {"DPCORE_WINOGRAD_S2": "1"}),
]
SWITCHES = ("DPCORE_WINOGRAD", "DPCORE_WINOGRAD_F35", "DPCORE_WINOGRAD_F43", "DPCORE_WINOGRAD_S2", "DPCORE_FFT")


def make(N, C, H, W, O, K, stride, pad, seed):
    rng = np.random.default_rng(seed)
    x = np.maximum(rng.standard_normal((N, C, H, W)), 0).astype(np.float32)
    w = (rng.standard_normal((O, C, K, K)) * np.sqrt(2.0 / (C * K * K))).astype(np.float32)
    OH, OW = (H + 2 * pad - K) // stride + 1, (W + 2 * pad - K) // stride + 1
    dy = rng.standard_normal((N, O, OH, OW)).astype(np.float32)
    return x, w, dy


def reference(x, w, dy, stride, pad):
    """y, dx, dw in float64 (sliding windows: no BLAS, no reordering to speak of)."""
    from numpy.lib.stride_tricks import sliding_window_view
    N, C, H, W = x.shape
    K = w.shape[2]
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    win = sliding_window_view(xp, (K, K), axis=(2, 3))[:, :, ::stride, ::stride]
    w64, dy64 = w.astype(np.float64), dy.astype(np.float64)
    y = np.einsum("nchwij,ocij->nohw", win, w64, optimize=True)
    dw = np.einsum("nchwij,nohw->ocij", win, dy64, optimize=True)
    OH, OW = dy.shape[2:]
    dxp = np.zeros_like(xp)
    for i in range(K):
        for j in range(K):
            dxp[:, :, i:i + stride * OH:stride, j:j + stride * OW:stride] += np.einsum(
                "nohw,oc->nchw", dy64, w64[:, :, i, j], optimize=True)
    return y, dxp[:, :, pad:pad + H, pad:pad + W], dw


def rel(a, ref):
    return float(np.linalg.norm(np.asarray(a, np.float64) - ref) / np.linalg.norm(ref))


def run_dpcore(x, w, dy, stride, pad, env):
    saved = {k: os.environ.get(k) for k in SWITCHES}
    try:
        for k in SWITCHES:
            os.environ.pop(k, None)
        os.environ.update(env)
        y = dp.ops.conv2d(x, w, None, stride=stride, padding=pad)
        dx, dw, _ = dp.ops.conv2d_backward(x, w, dy, stride=stride, padding=pad)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return y, dx, dw


def run_torch(x, w, dy, stride, pad):
    tx, tw, tdy = torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(dy)
    y = torch.nn.functional.conv2d(tx, tw, stride=stride, padding=pad)
    dx = torch.nn.grad.conv2d_input(tx.shape, tw, tdy, stride=stride, padding=pad)
    dw = torch.nn.grad.conv2d_weight(tx, tw.shape, tdy, stride=stride, padding=pad)
    return y.numpy(), dx.numpy(), dw.numpy()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    have_torch = torch is not None
    if have_torch:
        torch.set_num_threads(os.cpu_count() or 1)
    cols = ["fast", "gemm"] + (["torch"] if have_torch else [])
    rows = []
    for name, variant, N, C, H, W, O, K, stride, pad, env in SHAPES:
        errs = {c: [] for c in cols}
        for seed in range(args.seeds):
            x, w, dy = make(N, C, H, W, O, K, stride, pad, seed)
            ref = reference(x, w, dy, stride, pad)
            got = {"fast": run_dpcore(x, w, dy, stride, pad, {"DPCORE_WINOGRAD": "1", **env}),
                   "gemm": run_dpcore(x, w, dy, stride, pad, {"DPCORE_WINOGRAD": "0", "DPCORE_FFT": "0"})}
            if have_torch:
                got["torch"] = run_torch(x, w, dy, stride, pad)
            for c in cols:
                errs[c].append([rel(a, r) for a, r in zip(got[c], ref)])
        med = {c: np.median(np.array(errs[c]), axis=0) for c in cols}
        rows.append((name, variant, med))
    base = "torch" if have_torch else "gemm"
    hdr = ["layer", "variant", "pass"] + [f"{c} rel err" for c in cols] + [f"fast / {base}"]
    print(f"# dpcore {dp.__version__}; {dp.build_info()['summary'].get('blas', '')}; "
          f"seeds {args.seeds}; relative 2-norm error against float64", file=sys.stderr)
    if args.markdown:
        print("| " + " | ".join(hdr) + " |")
        print("|" + "---|" * len(hdr))
    else:
        print("  ".join(f"{h:>14}" for h in hdr))
    for name, variant, med in rows:
        for i, p in enumerate(("forward", "dx", "dw")):
            vals = [f"{med[c][i]:.2e}" for c in cols] + [f"{med['fast'][i] / med[base][i]:.1f}x"]
            cells = [name if i == 0 else "", variant if i == 0 else "", p] + vals
            if args.markdown:
                print("| " + " | ".join(cells) + " |")
            else:
                print("  ".join(f"{c:>14}" for c in cells))


if __name__ == "__main__":
    main()
