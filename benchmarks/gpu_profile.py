"""Where a GPU step's time goes: dpcore's ResNet-18 against PyTorch's on the same GPU, by kernel.

    python benchmarks/gpu_profile.py [--steps 20] [--batch 64]
    (scripts/gpu-day.sh --also 'python benchmarks/gpu_profile.py' runs it in the day's build)

Prints, in one run on cuda:0 (float32, TF32 off on both sides):
  1. ResNet-18 training images/s for dpcore with deterministic cuDNN algorithms (its default) and
     without, and for PyTorch with cudnn.deterministic off (its default) and on: the like-for-like
     pairs;
  2. the CUDA kernels of a few steps of each, from PyTorch's profiler (CUPTI sees every kernel of
     the process, dpcore's and cuDNN's included): total kernel time per step, the GPU's idle share
     of the step's wall time, and the top kernels by time;
  3. the layerwise split (ModelParallelStrategy over 2 logical GPUs): Python's profile of two
     steps, by cumulative time (its activations pass through the host between layers).
Needs a CUDA device and PyTorch with CUDA; exits 2 with the reason otherwise.
"""
import argparse
import cProfile
import io
import pstats
import sys
import time

import numpy as np


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    try:
        import torch
    except ImportError:
        print("gpu_profile: PyTorch is not installed", file=sys.stderr)
        return 2
    import dpcore as dp
    if not torch.cuda.is_available() or not dp.build_info().get("cuda_backend") or \
            dp._core.runtime_info()["cuda_device_count"] == 0:
        print("gpu_profile: needs a CUDA device, PyTorch with CUDA and dpcore's CUDA backend", file=sys.stderr)
        return 2
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from bench_gpu import synthetic, torch_resnet18
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    X, y = synthetic(args.batch)

    def dpcore_steps(deterministic, steps, net=None):
        dp.set_deterministic(deterministic)
        net = net or dp.models.ResNet18(devices=["cuda:0"])
        net.train_step(X, y, lr=0.05)
        net._model.get_params()
        start = time.perf_counter()
        for _ in range(steps):
            net.train_step(X, y, lr=0.05)
        net._model.get_params()
        return steps * args.batch / (time.perf_counter() - start), net

    tnet = torch_resnet18(torch)
    opt = torch.optim.SGD(tnet.parameters(), lr=0.05)
    tX, ty = torch.from_numpy(X).cuda(), torch.from_numpy(y).cuda()

    def torch_step():
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(tnet(tX), ty)
        loss.backward()
        opt.step()
        loss.item()

    def torch_steps(deterministic, steps):
        torch.backends.cudnn.deterministic = deterministic
        for _ in range(3):
            torch_step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            torch_step()
        torch.cuda.synchronize()
        return steps * args.batch / (time.perf_counter() - start)

    print(f"== ResNet-18 training, batch {args.batch}, {args.steps} steps, images/s (TF32 off)")
    rates = {}
    for det in (True, False):
        rates[("dpcore", det)], _ = dpcore_steps(det, args.steps)
        rates[("torch", det)] = torch_steps(det, args.steps)
    for (who, det), r in sorted(rates.items()):
        print(f"{who:7s} deterministic={det!s:5s} {r:9.1f}")
    for det in (True, False):
        print(f"dpcore / PyTorch, both deterministic={det}: {rates[('dpcore', det)] / rates[('torch', det)]:.3f}")
    dp.set_deterministic(True)
    torch.backends.cudnn.deterministic = False

    from torch.profiler import ProfilerActivity, profile

    def kernel_table(name, step, steps=5):
        step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - start) / steps
        kernels = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                k = kernels.setdefault(e.name, [0, 0.0])
                k[0] += 1
                k[1] += e.time_range.elapsed_us()  # a device event's interval is the kernel's on the GPU
        total = sum(v[1] for v in kernels.values()) / steps / 1e3  # ms a step
        print(f"\n== {name}: {wall * 1e3:.2f} ms a step (wall), kernels {total:.2f} ms a step "
              f"(GPU idle {max(0.0, 1 - total / (wall * 1e3)):.0%} of the step)")
        for kname, (n, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:args.top]:
            print(f"  {us / steps / 1e3:7.3f} ms  {n // steps:4d}x  {kname[:110]}")

    dnet = dp.models.ResNet18(devices=["cuda:0"])
    sys.stdout.flush()
    kernel_table("dpcore ResNet-18 (deterministic)", lambda: (dnet.train_step(X, y, lr=0.05),
                                                               dnet._model.get_params()))
    kernel_table("PyTorch ResNet-18", torch_step)

    print("\n== layerwise split over 2 logical GPUs: Python's profile of 2 steps")
    dp.set_logical_devices("cuda", 2)
    try:
        with dp.ModelParallelStrategy(devices=["cuda:0", "cuda:1"]).scope():
            lnet = dp.models.ResNet18()
            lnet.train_step(X, y, lr=0.05)
            pr = cProfile.Profile()
            start = time.perf_counter()
            pr.enable()
            for _ in range(2):
                lnet.train_step(X, y, lr=0.05)
            pr.disable()
        print(f"{(time.perf_counter() - start) / 2 * 1e3:.1f} ms a step")
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(18)
        print("\n".join(line for line in s.getvalue().splitlines() if line.strip())[:6000])
    finally:
        dp.set_logical_devices("cuda", 1)
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
