#!/usr/bin/env python3
"""The machine's own limit for a training benchmark: its GEMM floor.

A training step of a convolutional network is, at best, its multiplies at the
rate this machine's BLAS sustains on a large square SGEMM. This module measures
that rate through the very BLAS library dpcore's extension links (not NumPy's
bundled one) with the benchmark's own thread count, and counts a network's
training FLOPs layer by layer, so that a benchmark can report

    measured time / floor,   floor = counted training FLOPs / SGEMM rate

in the same run, on any machine. The count (written out in ``layer_flops``):

- conv2d (C_in -> C_out, k x k, output H_o x W_o): one multiply-add per weight
  per output pixel, 2 * C_out * H_o * W_o * C_in * k * k FLOPs for the forward
  pass, as many for the weight gradient, and as many for the input gradient,
  except for the first layer (nothing needs the gradient of the images);
- dense (n_in -> n_out): 2 * n_in * n_out forward, the same for each gradient;
- every other layer (ReLU, pooling, BatchNorm, the residual add, the loss, the
  SGD update) counts 0: they move memory rather than multiply, so the floor is
  a lower bound that no implementation can beat without doing fewer multiplies
  (Winograd, FFT).

Usage (from the repository root):

    .venv/bin/python benchmarks/floor.py               # the SGEMM rate and both networks' counts
    .venv/bin/python benchmarks/floor.py --threads 1
"""
import argparse
import ctypes
import os
import sys
import time

import numpy as np

# CBLAS enums (cblas.h)
_ROW_MAJOR, _NO_TRANS = 101, 111


def _dpcore_extension_path():
    import dpcore._core as core

    return os.path.realpath(core.__file__)


def blas_library_path():
    """The BLAS shared library that dpcore's extension loaded: the first library
    in this process's mappings that exports cblas_sgemm, other than NumPy's
    bundled copy (wheels ship their own OpenBLAS, which dpcore does not use)."""
    _dpcore_extension_path()  # import dpcore so that its BLAS is mapped
    seen = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if path.startswith("/") and "blas" in os.path.basename(path).lower() and path not in seen:
                seen.append(path)
    for path in seen:
        if "numpy" in path or "scipy_openblas" in path or "cublas" in path:
            continue
        try:
            library = ctypes.CDLL(path)
        except OSError:
            continue
        if hasattr(library, "cblas_sgemm"):
            return path
    raise RuntimeError(f"no CBLAS library mapped into this process besides NumPy's: {seen}")


def _load_blas():
    library = ctypes.CDLL(blas_library_path())
    library.cblas_sgemm.restype = None
    pointer = ctypes.POINTER(ctypes.c_float)
    library.cblas_sgemm.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                    ctypes.c_int, ctypes.c_float, pointer, ctypes.c_int, pointer, ctypes.c_int,
                                    ctypes.c_float, pointer, ctypes.c_int]
    return library


def sgemm(a, b, library=None):
    """C = A @ B through dpcore's BLAS (float32, row-major): the call the rate measures."""
    library = library or _load_blas()
    a = np.ascontiguousarray(a, dtype=np.float32)
    b = np.ascontiguousarray(b, dtype=np.float32)
    (m, k), (k2, n) = a.shape, b.shape
    if k != k2:
        raise ValueError(f"inner dimensions differ: {a.shape} @ {b.shape}")
    c = np.zeros((m, n), dtype=np.float32)
    as_float = ctypes.POINTER(ctypes.c_float)
    library.cblas_sgemm(_ROW_MAJOR, _NO_TRANS, _NO_TRANS, m, n, k, 1.0, a.ctypes.data_as(as_float), k,
                        b.ctypes.data_as(as_float), n, 0.0, c.ctypes.data_as(as_float), n)
    return c


def set_blas_threads(threads, library=None):
    """OpenBLAS's thread count (openblas_set_num_threads); False when the library has no such call."""
    library = library or _load_blas()
    if not hasattr(library, "openblas_set_num_threads"):
        return False
    library.openblas_set_num_threads(int(threads))
    return True


def sgemm_gflops(n=2048, repeats=5, threads=None, min_seconds=0.3):
    """The sustained float32 GEMM rate, GFLOP/s: the best of ``repeats`` timings of
    an n x n x n SGEMM (each timing repeats the call for at least ``min_seconds``),
    after one warm-up call. ``threads``: OpenBLAS's thread count for the measurement
    (None: as the process has it, e.g. from OMP_NUM_THREADS)."""
    library = _load_blas()
    if threads is not None:
        set_blas_threads(threads, library)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    sgemm(a, b, library)
    best = float("inf")
    for _ in range(repeats):
        calls, start = 0, time.perf_counter()
        while True:
            sgemm(a, b, library)
            calls += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_seconds:
                break
        best = min(best, elapsed / calls)
    return 2.0 * n ** 3 / best / 1e9


def layer_flops(net):
    """[(index, kind, forward, weight_grad, input_grad)] in FLOPs per image, for
    every conv2d and dense layer of a dpcore model (see the module's docstring)."""
    rows = []
    for index, ((kind, in_shape, out_shape), spec) in enumerate(zip(net._model.layers(), net._specs)):
        if kind == "conv2d":
            kernel = spec[2]
            macs = out_shape[0] * out_shape[1] * out_shape[2] * in_shape[0] * kernel * kernel
        elif kind == "dense":
            macs = in_shape[0] * in_shape[1] * in_shape[2] * out_shape[0]
        else:
            continue
        rows.append((index, kind, 2 * macs, 2 * macs, 0 if index == 0 else 2 * macs))
    return rows


def training_flops_per_image(net):
    """The network's counted training FLOPs for one image (forward + both gradients)."""
    return sum(forward + weight + data for _, _, forward, weight, data in layer_flops(net))


def machine_floor(net, threads, quick=False):
    """The floor of training ``net`` with ``threads`` cores, measured now:
    {"sgemm_gflops", "flops_per_image", "images_per_s"}; images_per_s is what a step
    would reach with every counted multiply at the SGEMM rate. quick: a rough
    rate (one 512^3 timing), for smoke runs."""
    gflops = (sgemm_gflops(n=512, threads=threads, repeats=1, min_seconds=0.02) if quick else
              sgemm_gflops(threads=threads, repeats=3))
    per_image = training_flops_per_image(net)
    return {"sgemm_gflops": gflops, "flops_per_image": per_image, "images_per_s": gflops * 1e9 / per_image}


def floor_seconds(flops, gflops):
    """Seconds the counted FLOPs take at the measured rate."""
    return flops / (gflops * 1e9)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="OpenBLAS threads (default: the process's)")
    parser.add_argument("--n", type=int, default=2048, help="the square SGEMM's size (default 2048)")
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_common import import_dpcore_or_exit

    dp = import_dpcore_or_exit()
    rate = sgemm_gflops(n=args.n, threads=args.threads)
    print(f"BLAS: {blas_library_path()}")
    print(f"SGEMM {args.n}^3, threads {args.threads or 'default'}: {rate:.1f} GFLOP/s (best of 5)")
    for name, net, images in (("LeNet", dp.models.LeNet(), 60000), ("ResNet-18", dp.models.ResNet18(), 1)):
        per_image = training_flops_per_image(net)
        print(f"{name}: {per_image / 1e9:.4f} GFLOP per image for a training step; "
              f"floor {floor_seconds(per_image * images, rate):.3f} s per {images} image(s)")
        for index, kind, forward, weight, data in layer_flops(net):
            print(f"  layer {index:2d} {kind:6s} forward {forward / 1e6:9.2f} MFLOP, weight grad "
                  f"{weight / 1e6:9.2f}, input grad {data / 1e6:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
