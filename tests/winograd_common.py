"""The harness of the Winograd tests (test_winograd.py, test_winograd_s2.py,
test_winograd_lanes.py): the absolute-value expressions S of their error bounds
|computed - exact| <= gamma_k S, for any transform (A^T, G, B^T) of m x m output
blocks from a x a input tiles, and the check of one convolution's y, dx, dw and
db against the float64 reference within such bounds. Each test file derives its
algorithm's k; the derivations are in their docstrings.

Tiles: tile (i, j) reads the input from row step i - pad, column step j - pad
(step = stride * m), zero outside the input, and gives outputs m i .. m i + m - 1
(those past the output's edge are dropped; dy is zero there).
"""
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

import dpcore as dp
from test_conv_cpu import assert_within_bound, make, reference

ops = dp.ops


def input_tiles(x, a, step, pad, th, tw):
    """(N, C, th, tw, a, a): the a x a tiles of |x| in float64."""
    N, C, H, W = x.shape
    xp = np.zeros((N, C, step * (th - 1) + a, step * (tw - 1) + a))
    xp[:, :, pad:pad + H, pad:pad + W] = np.abs(x.astype(np.float64))
    return sliding_window_view(xp, (a, a), axis=(2, 3))[:, :, ::step, ::step]


def output_blocks(dy, m, th, tw):
    """(N, O, th, tw, m, m): dy's m x m blocks in absolute values, zero past its edge."""
    N, O, OH, OW = dy.shape
    dyp = np.zeros((N, O, m * th, m * tw))
    dyp[:, :, :OH, :OW] = np.abs(dy.astype(np.float64))
    return dyp.reshape(N, O, th, m, tw, m).transpose(0, 1, 2, 4, 3, 5)


def abs_forward(x, w, b, mats, stride, pad):
    """S of the forward pass, (N, O, OH, OW): |A|^T [ sum over c of (|G| |g| |G|^T) . (|B|^T |d| |B|) ] |A|
    + |b|. mats: (A^T, G, B^T), used as given (the caller passes their absolute values)."""
    At, Ga, Bt = mats
    m, a = At.shape
    N, C, H, W = x.shape
    O, K = w.shape[0], w.shape[2]
    OH, OW = (H + 2 * pad - K) // stride + 1, (W + 2 * pad - K) // stride + 1
    th, tw = -(-OH // m), -(-OW // m)
    d = input_tiles(x, a, stride * m, pad, th, tw)
    V = np.einsum("ij,nctsjk,lk->nctsil", Bt, d, Bt, optimize=True)
    U = np.einsum("ij,ocjk,lk->ocil", Ga, np.abs(w.astype(np.float64)), Ga, optimize=True)
    M = np.einsum("ocil,nctsil->notsil", U, V, optimize=True)
    Y = np.einsum("ij,notsjk,lk->notsil", At, M, At, optimize=True)            # (N, O, th, tw, m, m)
    Y = Y.transpose(0, 1, 2, 4, 3, 5).reshape(N, O, m * th, m * tw)[:, :, :OH, :OW]
    return Y + (0.0 if b is None else np.abs(b.astype(np.float64))[None, :, None, None])


def abs_dx(x_shape, w, dy, mats, stride, pad):
    """S of dx, (N, C, H, W): each tile's |B| [sum over o of |U| . |A| |dY| |A|^T] |B|^T added
    where the tile lies. mats as for abs_forward."""
    At, Ga, Bt = mats
    m, a = At.shape
    N, C, H, W = x_shape
    OH, OW = dy.shape[2:]
    th, tw = -(-OH // m), -(-OW // m)
    step = stride * m
    dM = np.einsum("ji,notsjk,kl->notsil", At, output_blocks(dy, m, th, tw), At, optimize=True)
    U = np.einsum("ij,ocjk,lk->ocil", Ga, np.abs(w.astype(np.float64)), Ga, optimize=True)
    Z = np.einsum("ocil,notsil->nctsil", U, dM, optimize=True)
    T = np.einsum("ji,nctsjk,kl->nctsil", Bt, Z, Bt, optimize=True)            # (N, C, th, tw, a, a)
    dxp = np.zeros((N, C, step * (th - 1) + a, step * (tw - 1) + a))
    for i in range(th):
        for j in range(tw):
            dxp[:, :, step * i:step * i + a, step * j:step * j + a] += T[:, :, i, j]
    return dxp[:, :, pad:pad + H, pad:pad + W]


def abs_dw(x, dy, mats, stride, pad):
    """S of dw, (O, C, r, r): |G|^T [ sum over the tiles of (|A| |dY| |A|^T) . (|B|^T |d| |B|) ] |G|.
    mats as for abs_forward."""
    At, Ga, Bt = mats
    m, a = At.shape
    OH, OW = dy.shape[2:]
    th, tw = -(-OH // m), -(-OW // m)
    d = input_tiles(x, a, stride * m, pad, th, tw)
    dM = np.einsum("ji,notsjk,kl->notsil", At, output_blocks(dy, m, th, tw), At, optimize=True)
    V = np.einsum("ij,nctsjk,lk->nctsil", Bt, d, Bt, optimize=True)
    dU = np.einsum("notsil,nctsil->ocil", dM, V, optimize=True)
    return np.einsum("ji,ocjk,kl->ocil", Ga, dU, Ga, optimize=True)


def check_within_bounds(what, N, C, H, W, O, K, stride, pad, seed, use_bias, bounds):
    """conv2d and conv2d_backward on make()'s data against test_conv_cpu.reference: y, dx, dw within
    gamma_k S for bounds(x, w, bias, dy, y) = ((S_y, k_y), (S_dx, k_dx), (S_dw, k_dw)) (bias: b, or
    None without one), db (a plain sum of dy's values) within gamma_{N OH OW} of its S. Returns
    (x, w, b, dy, y, dx, dw)."""
    x, w, b, dy = make(N, C, H, W, O, K, stride, pad, seed)
    bias = b if use_bias else None
    y = ops.conv2d(x, w, bias, stride=stride, padding=pad)
    dx, dw, db = ops.conv2d_backward(x, w, dy, stride=stride, padding=pad)
    y_ref, dx_ref, dw_ref, db_ref = reference(x, w, b if use_bias else np.zeros_like(b), dy, stride, pad)
    assert y.shape == y_ref.shape and dx.shape == x.shape
    (S_y, k_y), (S_dx, k_dx), (S_dw, k_dw) = bounds(x, w, bias, dy, y)
    assert_within_bound(y, y_ref, S_y, k_y, f"{what} forward")
    assert_within_bound(dx, dx_ref, S_dx, k_dx, f"{what} dx")
    assert_within_bound(dw, dw_ref, S_dw, k_dw, f"{what} dw")
    assert_within_bound(db, db_ref, np.abs(dy.astype(np.float64)).sum(axis=(0, 2, 3)),
                        max(dy.shape[0] * dy.shape[2] * dy.shape[3], 1), f"{what} db")
    return x, w, b, dy, y, dx, dw


def finite_with_pixels_that_overflow_when_added(shape, stride, x_pixels, dy_pixels):
    """(y, dx, dw) all finite? x: zero but for x_pixels [(row, col, value)] of sample 0, channel 0;
    w = 2^-10 everywhere, no bias; y and dw from that x with dy = 2^-10, dx from dy zero but for
    dy_pixels. Every product is at most 2^117 and at most two are nonzero in any output: a path
    that multiplies before adding stays finite; one that adds two of the pixels first does not."""
    N, C, H, W, O = shape
    OH, OW = (H + 2 - 3) // stride + 1, (W + 2 - 3) // stride + 1
    x = np.zeros((N, C, H, W), np.float32)
    for r, c, v in x_pixels:
        x[0, 0, r, c] = v
    dy_pix = np.zeros((N, O, OH, OW), np.float32)
    for r, c, v in dy_pixels:
        dy_pix[0, 0, r, c] = v
    w = np.full((O, C, 3, 3), 2.0 ** -10, np.float32)
    small = np.full((N, O, OH, OW), 2.0 ** -10, np.float32)
    with np.errstate(all="ignore"):
        y = ops.conv2d(x, w, None, stride=stride, padding=1)
        dw = ops.conv2d_backward(x, w, small, stride=stride, padding=1)[1]
        dx = ops.conv2d_backward(np.zeros_like(x), w, dy_pix, stride=stride, padding=1)[0]
    return tuple(bool(np.isfinite(a).all()) for a in (y, dx, dw))
