#!/usr/bin/env python3
"""Which fast form could LeNet's 5x5 layer (20 -> 50 channels, 13x13 input) run in the default
precision? A NumPy simulation of each Winograd form's float32 rounding, forward pass, against a
float64 direct convolution (relative 2-norm error; inputs as in training: non-negative
activations, He-scaled weights), beside float32 im2col + GEMM (NumPy's sgemm) -- before writing a
kernel for a form, to see whether it can meet the default precision's bound (within ~2x float32
GEMM's error, benchmarks/RESULTS.md "Precision").

    .venv/bin/python benchmarks/winograd5_forms.py [--seeds 0 1 2] [--batch 32]

Forms: F(3x3, 5x5) (dpcore's fast precision) and F(2x2, 5x5) over several interpolation point
sets (scripts/winograd_matrices.py builds the transforms), each in float32 throughout (as a
kernel would run), and with the transform domain (filter and input transforms and the sum over
the input channels) in float64, only the output transform and the result in float32 (what
a float64 transform domain would cost in accuracy). Each stage rounds to float32 where a
float32 kernel would; the sum over channels runs in channel order.
"""
import argparse
import os
import sys
from fractions import Fraction as Fr

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from winograd_matrices import transforms  # noqa: E402

FORMS = [("F(3x3, 5x5)", 3, [0, 1, -1, 2, -2, Fr(1, 2)]),
         ("F(2x2, 5x5)", 2, [0, 1, -1, 2, -2]),
         ("F(2x2, 5x5)", 2, [0, 1, -1, 2, Fr(-1, 2)]),
         ("F(2x2, 5x5)", 2, [0, 1, -1, Fr(1, 2), Fr(-1, 2)])]


def winograd(x, w, m, points, domain):
    """conv(x, w) (valid, stride 1) by F(m x m, r x r); domain: the transform domain's dtype."""
    N, C, H, _ = x.shape
    O, r = w.shape[0], w.shape[2]
    a = m + r - 1
    AT, G, BT = (np.array([[float(v) for v in row] for row in M]) for M in transforms(m, r, points))
    OH = H - r + 1
    t = -(-OH // m)
    xp = np.zeros((N, C, t * m + r - 1, t * m + r - 1), np.float32)
    xp[:, :, :H, :H] = x
    f32 = domain == np.float32
    Gd, BTd = (G.astype(np.float32), BT.astype(np.float32)) if f32 else (G, BT)
    U = np.einsum("ij,ocjk,lk->ocil", Gd, w.astype(domain), Gd).astype(domain)
    tiles = np.stack([np.stack([xp[:, :, i * m:i * m + a, j * m:j * m + a] for j in range(t)], 2)
                      for i in range(t)], 2).astype(domain)
    V = np.einsum("ij,ncpqjk,lk->ncpqil", BTd, tiles, BTd).astype(domain)
    M = np.zeros((N, O, t, t, a, a), domain)
    for c in range(C):  # the sum over the input channels, in order
        M += U[None, :, c, None, None] * V[:, c, None]
    AT32 = AT.astype(np.float32)
    Y = np.einsum("ij,nopqjk,lk->nopqil", AT32, M.astype(np.float32), AT32).astype(np.float32)
    return Y.transpose(0, 1, 2, 4, 3, 5).reshape(N, O, t * m, t * m)[:, :, :OH, :OH]


def im2col_gemm(x, w, dtype):
    N, C, H, _ = x.shape
    O, _, r, _ = w.shape
    OH = H - r + 1
    cols = np.stack([x[:, :, i:i + OH, j:j + OH] for i in range(r) for j in range(r)], 2).astype(dtype)
    return np.matmul(w.reshape(O, -1).astype(dtype), cols.reshape(N, C * r * r, OH * OH)).reshape(N, O, OH, OH)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    rows = {}
    for seed in args.seeds:
        rng = np.random.default_rng(seed)
        x = rng.random((args.batch, 20, 13, 13)).astype(np.float32)
        w = (rng.standard_normal((50, 20, 5, 5)) * np.sqrt(2 / 500)).astype(np.float32)
        ref = im2col_gemm(x, w, np.float64)

        def err(y):
            return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
        rows.setdefault(("im2col + GEMM, float32", "-"), []).append(err(im2col_gemm(x, w, np.float32)))
        for name, m, points in FORMS:
            pts = ", ".join(str(p) for p in points)
            for domain, label in ((np.float32, "float32"), (np.float64, "float64 transform domain")):
                rows.setdefault((f"{name}, {label}", pts), []).append(err(winograd(x, w, m, points, domain)))
    gemm = np.median(rows[("im2col + GEMM, float32", "-")])
    print(f"LeNet's 20 -> 50 5x5 layer, forward, batch {args.batch}, median of seeds {args.seeds}\n")
    print("| form | points | relative error | x float32 GEMM's |\n|---|---|---|---|")
    for (form, pts), errs in rows.items():
        print(f"| {form} | {pts} | {np.median(errs):.2e} | {np.median(errs) / gemm:.1f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
