"""Where a training step's time goes, layer by layer, against each layer's GEMM
floor (issue 14: which layers are far from the machine's own limit).

    python benchmarks/bench_layers.py [--rounds 5] [--resnet-batch 32] [--write]

In one process, with the threads dpcore gives one device (both cores here):

1. the sustained SGEMM rate through dpcore's own BLAS (benchmarks/floor.py);
2. each layer of LeNet (batch 256) and ResNet-18 (batch --resnet-batch, 28x28)
   alone: a one-layer ``_core.Model`` on cpu:0 (the stage models of
   PipelineStrategy), its training forward pass and its backward pass timed
   separately (best of --rounds after a warm-up; the first layer computes no
   input gradient, as in the network); the layer's floor is its counted FLOPs
   (floor.layer_flops: forward, weight gradient, input gradient) over the
   SGEMM rate; layers that only move memory (ReLU, pooling, BatchNorm, add)
   have no floor and show their time alone;
3. with PyTorch installed (benchmarks/setup_bench_env.sh), the same conv2d and
   dense shapes through torch.nn.functional, forward and backward: oneDNN's
   convolutions (and MKL's GEMM) against dpcore's im2col + OpenBLAS, the A/B
   that says whether oneDNN would be the faster CPU convolution engine;
4. the whole network's train_step on the same batch (best of --rounds): what
   the layers' sum leaves out (the loss, the SGD update, the host copies a
   one-layer model adds are in the sum, not in the step) shows as the gap.

A one-layer model copies its output to the host and its input gradient back,
which the whole network does not: the per-layer times are an upper bound of
the layer's share, most so for the cheap memory-bound layers.
"""
import argparse
import datetime
import os
import sys
import time

import numpy as np

# PyTorch first: its CUDA build needs its own NCCL, which dpcore's (the system's) would shadow if loaded first
try:
    if "--no-torch" not in sys.argv:
        import torch as _torch
    else:
        _torch = None
except ImportError:
    _torch = None

import dpcore as dp  # noqa: E402
from dpcore import _core  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import floor  # noqa: E402
from bench_lenet_cpu import command_line, machine_info, publish  # noqa: E402

SECTION_TITLE = "## Where the time goes: each layer against its GEMM floor (CPU, one device)"


def layer_times(net, batch, rounds, rng):
    """[(index, kind, out shape, forward s, backward s)] for every layer of net, one batch each."""
    rows = []
    for j, ((kind, ins, outs), spec) in enumerate(zip(net._model.layers(), net._specs)):
        layer = ("add", -1, -1) if kind == "add" else tuple(spec)
        model = _core.Model(tuple(ins), [layer], 0, 0, [-1], "cpu", 0, headless=True, input_grad=j > 0)
        if model.nparams:
            model.set_params(rng.standard_normal(model.nparams).astype(np.float32) * 0.05)
        X = rng.standard_normal((batch,) + tuple(ins)).astype(np.float32)
        dy = rng.standard_normal((batch,) + tuple(outs)).astype(np.float32)
        fwd = bwd = float("inf")
        for r in range(rounds + 1):
            t0 = time.perf_counter()
            model.stage_forward(0, X, training=True)
            t1 = time.perf_counter()
            model.stage_backward(0, batch, dy, input_grad=j > 0)
            t2 = time.perf_counter()
            if r:
                fwd, bwd = min(fwd, t1 - t0), min(bwd, t2 - t1)
        rows.append((j, kind, tuple(outs), fwd, bwd))
        del model
    return rows


def torch_layer_times(torch, net, batch, rounds):
    """{index: (forward s, backward s)} of PyTorch's own conv2d / linear (oneDNN and MKL
    on the CPU) for every conv2d and dense layer of net: the same shapes, the same
    gradients (no input gradient for the first layer), the same threads."""
    F = torch.nn.functional
    out = {}
    for j, ((kind, ins, outs), spec) in enumerate(zip(net._model.layers(), net._specs)):
        if kind not in ("conv2d", "dense"):
            continue
        x = torch.randn((batch,) + tuple(ins)).requires_grad_(j > 0)
        if kind == "conv2d":
            _, o, k, stride, pad = spec
            w = (torch.randn(o, ins[0], k, k) * 0.05).requires_grad_()

            def forward():
                return F.conv2d(x, w, b, stride, pad)
        else:
            w = (torch.randn(outs[0], ins[0] * ins[1] * ins[2]) * 0.05).requires_grad_()

            def forward():
                return F.linear(x.reshape(batch, -1), w, b)
        b = torch.zeros(w.shape[0], requires_grad=True)
        dy = torch.randn((batch,) + (tuple(outs) if kind == "conv2d" else (outs[0],)))
        fwd = bwd = float("inf")
        for r in range(rounds + 1):
            for t in (x, w, b):
                t.grad = None
            t0 = time.perf_counter()
            y = forward()
            t1 = time.perf_counter()
            y.backward(dy)
            t2 = time.perf_counter()
            if r:
                fwd, bwd = min(fwd, t1 - t0), min(bwd, t2 - t1)
        out[j] = (fwd, bwd)
    return out


def step_time(net, X, y, rounds):
    net.train_step(X, y, lr=0.01)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        net.train_step(X, y, lr=0.01)
        best = min(best, time.perf_counter() - t0)
    return best


def table(name, net, batch, rounds, gflops, rng, torch=None):
    flops = {j: (f, wg, ig) for j, _, f, wg, ig in floor.layer_flops(net)}
    times = layer_times(net, batch, rounds, rng)
    theirs = torch_layer_times(torch, net, batch, rounds) if torch else {}
    X = rng.random((batch,) + tuple(net._model.input_shape), dtype=np.float32)
    y = rng.integers(0, net._model.num_classes, batch)
    step = step_time(net, X, y, rounds)
    total_floor = sum(sum(f) for f in flops.values()) * batch / (gflops * 1e9)
    peer = " PyTorch fwd + bwd ms | dpcore / PyTorch |" if torch else ""
    lines = [f"### {name}, batch {batch}", "",
             "| layer | kind | output | forward ms | backward ms | share of the layers' sum | floor ms | "
             "time / floor |" + peer, "|---|---|---|---|---|---|---|---|" + ("---|---|" if torch else "")]
    layer_sum = sum(f + b for *_, f, b in times)
    for j, kind, outs, f, b in times:
        fl = flops.get(j)
        floor_s = sum(fl) * batch / (gflops * 1e9) if fl else None
        lines.append(f"| {j} | {kind} | {'x'.join(map(str, outs))} | {f * 1e3:.2f} | {b * 1e3:.2f} | "
                     f"{(f + b) / layer_sum:.1%} | {'-' if floor_s is None else f'{floor_s * 1e3:.2f}'} | "
                     f"{'-' if floor_s is None else f'{(f + b) / floor_s:.2f}x'} |"
                     + ("" if not torch else " - | - |" if j not in theirs else
                        f" {sum(theirs[j]) * 1e3:.2f} | {(f + b) / sum(theirs[j]):.2f}x |"))
    gemm_layers = sum(f + b for j, _, _, f, b in times if j in flops)
    if theirs:
        torch_gemm = sum(sum(v) for v in theirs.values())
        lines += ["", f"- conv / dense layers: dpcore {gemm_layers * 1e3:.1f} ms, PyTorch {torch_gemm * 1e3:.1f} ms "
                  f"(**dpcore / PyTorch {gemm_layers / torch_gemm:.2f}x**; PyTorch / floor "
                  f"{torch_gemm / total_floor:.2f}x)"]
    lines += ["", f"- the layers' sum {layer_sum * 1e3:.1f} ms (conv / dense {gemm_layers * 1e3:.1f} ms, "
              f"{gemm_layers / layer_sum:.0%}; the rest moves memory); the whole train_step {step * 1e3:.1f} ms; "
              f"the network's floor {total_floor * 1e3:.1f} ms: **step / floor {step / total_floor:.2f}x**, "
              f"conv / dense layers alone / floor {gemm_layers / total_floor:.2f}x", ""]
    print(f"{name}: step / floor {step / total_floor:.2f}x", flush=True)
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--lenet-batch", type=int, default=256)
    ap.add_argument("--resnet-batch", type=int, default=32, help="ResNet-18 batch (0: skip ResNet-18)")
    ap.add_argument("--write", action="store_true", help="put the tables into benchmarks/RESULTS.md")
    ap.add_argument("--no-torch", action="store_true", help="no PyTorch column even when torch is installed")
    args = ap.parse_args(argv)
    threads = dp.build_info()["cpu_cores"]  # what one CPU device gets (set_logical_devices('cpu', 1))
    gflops = floor.sgemm_gflops(threads=threads)
    rng = np.random.default_rng(0)
    torch = None if args.no_torch else _torch
    if torch is not None:
        torch.set_num_threads(threads)
    elif not args.no_torch:
        print("PyTorch is not installed (benchmarks/setup_bench_env.sh): no per-layer comparison", flush=True)
    load_before = os.getloadavg()[0]
    body = table("LeNet", dp.models.LeNet(devices=["cpu:0"]), args.lenet_batch, args.rounds, gflops, rng, torch)
    if args.resnet_batch:
        body += table("ResNet-18 (28x28)", dp.models.ResNet18(devices=["cpu:0"]), args.resnet_batch,
                      max(2, args.rounds // 2), gflops, rng, torch)
    lines = [SECTION_TITLE, "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"- machine: {machine_info()}; load average before / after: {load_before:.2f} / "
             f"{os.getloadavg()[0]:.2f}",
             f"- command (from the repository root): `{command_line()}`",
             f"- SGEMM rate (2048^3 through dpcore's OpenBLAS, {threads or 'default'} threads, best of 5): "
             f"**{gflops:.1f} GFLOP/s**; floor = the layer's counted FLOPs (forward, weight gradient, input "
             "gradient; benchmarks/floor.py) / that rate",
             "- each layer alone as a one-layer model on cpu:0 (its output copied to the host and its input "
             "gradient back: an upper bound of its share), best of the rounds after a warm-up",
             "- PyTorch (when installed): " + (f"{torch.__version__}, " if torch else "not installed; ")
             + "the same conv2d / linear shapes through torch.nn.functional (oneDNN convolutions and MKL GEMM "
             "on the CPU), forward and backward, the same threads, best of the same rounds: the A/B for "
             "oneDNN as dpcore's CPU convolution engine", ""] + body
    publish(lines, SECTION_TITLE, args.write)


if __name__ == "__main__":
    main()
