"""GPU benchmark: dpcore against PyTorch on the same GPU, in one run.

    python benchmarks/bench_gpu.py [--epochs 2] [--resnet-steps 30] [--logical 2] [--write]
    (make bench-gpu)

Measures, on cuda:0 (TF32 off on both sides, float32 everywhere):
  1. LeNet, Fashion-MNIST, batch 256, lr 0.2: seconds per epoch (best of --epochs)
     with the training set resident on the GPU and with host batches; PyTorch's
     epoch with the dataset on the GPU too (the fairest setting for it).
  2. ResNet-18 (d2l, 28x28, 1 channel), batch 64: training images/s; PyTorch's
     d2l-equivalent ResNet-18 beside it.
  3. LeNet on --logical logical GPUs of the one physical GPU (our all-reduce
     kernel, gradient buckets): epoch seconds against one replica.
Ratios are dpcore / PyTorch (seconds) or PyTorch / dpcore (images/s), from this
run. With --write the numbers go to benchmarks/RESULTS.md ("GPU" section).

Exits with status 2 and the reason when no usable CUDA device is present.
`--device cpu --max-batches 3` runs the same code on CPU devices (a dry run
that tests/test_benchmarks.py does, so that the script works on the day a GPU
is there).
"""
import argparse
import datetime
import itertools
import os
import sys
import time

import numpy as np

import dpcore as dp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_lenet_cpu import command_line, machine_info, replace_section  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")


def no_gpu_reason():
    if not dp.build_info().get("cuda_backend"):
        return "dpcore was built without the CUDA backend (needs the CUDA toolkit, cuDNN and cuBLAS)"
    info = dp._core.runtime_info()
    if info["cuda_device_count"] == 0:
        return "no usable CUDA device: " + info["cuda_why"]
    return None


def dpcore_lenet_epoch(devices, epochs, batch, resident, max_batches=None):
    train_iter, _ = dp.data.load_fashion_mnist(batch_size=batch)
    net = dp.models.LeNet(devices=devices)
    residents = net.make_resident(train_iter.X, train_iter.y) if resident else None
    times = []
    for _ in range(epochs):
        start = time.perf_counter()
        batches = train_iter.index_batches() if resident else iter(train_iter)
        for batch in itertools.islice(batches, max_batches):
            if resident:
                net.train_step_rows(residents, batch, 0.2)
            else:
                net.train_step(*batch, lr=0.2)
        net._model.get_params()  # the host reads: every queued step is done
        times.append(time.perf_counter() - start)
    return min(times)


def synthetic(batch, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((batch, 1, 28, 28)).astype(np.float32), rng.integers(0, 10, batch)


def dpcore_resnet_images_per_s(devices, steps, batch):
    net = dp.models.ResNet18(devices=devices)
    X, y = synthetic(batch)
    net.train_step(X, y, lr=0.05)  # plans the convolutions, sizes the workspaces
    start = time.perf_counter()
    for _ in range(steps):
        net.train_step(X, y, lr=0.05)
    net._model.get_params()
    return steps * batch / (time.perf_counter() - start)


def torch_lenet_epoch(torch, epochs, batch):
    train_iter, _ = dp.data.load_fashion_mnist(batch_size=batch)
    X = torch.from_numpy(train_iter.X).cuda().float().div_(255)
    y = torch.from_numpy(train_iter.y).cuda()
    nn = torch.nn
    net = nn.Sequential(nn.Conv2d(1, 20, 3), nn.ReLU(), nn.AvgPool2d(2), nn.Conv2d(20, 50, 5), nn.ReLU(),
                        nn.AvgPool2d(2), nn.Flatten(), nn.Linear(800, 128), nn.ReLU(), nn.Linear(128, 10)).cuda()
    opt = torch.optim.SGD(net.parameters(), lr=0.2)
    times = []
    for epoch in range(epochs):
        order = torch.randperm(len(y), device="cuda", generator=None)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(0, len(y), batch):
            idx = order[i:i + batch]
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(net(X[idx]), y[idx])
            loss.backward()
            opt.step()
            loss.item()  # dpcore returns every step's loss to the host too
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def torch_resnet18(torch):
    nn = torch.nn

    class Residual(nn.Module):
        def __init__(self, cin, cout, use_1x1, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, padding=1, stride=stride)
            self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
            self.conv3 = nn.Conv2d(cin, cout, 1, stride=stride) if use_1x1 else None
            self.bn1, self.bn2 = nn.BatchNorm2d(cout), nn.BatchNorm2d(cout)

        def forward(self, x):
            y = torch.relu(self.bn1(self.conv1(x)))
            y = self.bn2(self.conv2(y))
            return torch.relu(y + (self.conv3(x) if self.conv3 is not None else x))

    layers = [nn.Conv2d(1, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU()]
    cin = 64
    for stage, cout in enumerate((64, 128, 256, 512)):
        for block in range(2):
            down = block == 0 and stage > 0
            layers.append(Residual(cin, cout, down, 2 if down else 1))
            cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 10)]
    return nn.Sequential(*layers).cuda()


def torch_resnet_images_per_s(torch, steps, batch):
    net = torch_resnet18(torch)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    X, y = (torch.from_numpy(a).cuda() for a in synthetic(batch))
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(net(X), y).backward()
        opt.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(net(X), y)
        loss.backward()
        opt.step()
        loss.item()
    torch.cuda.synchronize()
    return steps * batch / (time.perf_counter() - start)


def import_torch():
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False  # dpcore uses cuDNN's heuristics, not benchmarking
    return torch


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--resnet-steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--logical", type=int, default=2, help="logical GPUs for the all-reduce run (0: skip)")
    p.add_argument("--write", action="store_true", help="record the results in benchmarks/RESULTS.md")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: a dry run of the same code on CPU devices (no PyTorch, nothing written)")
    p.add_argument("--max-batches", type=int, default=None, help="batches per LeNet epoch (default: all)")
    args = p.parse_args()
    kind = args.device
    if kind == "cuda":
        reason = no_gpu_reason()
        if reason:
            print(f"bench_gpu: {reason}; nothing to measure", file=sys.stderr)
            return 2
    elif args.write:
        p.error("--write records GPU numbers; not with --device cpu")
    rows = []

    def report(name, value, unit):
        rows.append((name, value, unit))
        print(f"{name}: {value:.3f} {unit}", flush=True)

    first = [f"{kind}:0"]
    resident = dpcore_lenet_epoch(first, args.epochs, args.batch, True, args.max_batches)
    report(f"dpcore LeNet epoch, {kind}:0, resident", resident, "s")
    report(f"dpcore LeNet epoch, {kind}:0, host batches",
           dpcore_lenet_epoch(first, args.epochs, args.batch, False, args.max_batches), "s")
    resnet = dpcore_resnet_images_per_s(first, args.resnet_steps, 64)
    report(f"dpcore ResNet-18 training, {kind}:0, batch 64", resnet, "images/s")
    # PyTorch right after dpcore's one-device numbers: the ratios come first if time runs out
    torch = import_torch() if kind == "cuda" else None
    ratios = []
    if torch is None:
        print("PyTorch with CUDA is not installed: no comparison")
    else:
        t_lenet = torch_lenet_epoch(torch, args.epochs, args.batch)
        report(f"PyTorch {torch.__version__} LeNet epoch, dataset on the GPU", t_lenet, "s")
        t_resnet = torch_resnet_images_per_s(torch, args.resnet_steps, 64)
        report(f"PyTorch {torch.__version__} ResNet-18 training, batch 64", t_resnet, "images/s")
        ratios = [("LeNet epoch seconds, dpcore (resident) / PyTorch", resident / t_lenet),
                  ("ResNet-18 images/s, dpcore / PyTorch", resnet / t_resnet)]
        for name, r in ratios:
            print(f"{name}: {r:.3f}")
    if args.logical > 1:
        dp.set_logical_devices(kind, args.logical)
        devices = [f"{kind}:{i}" for i in range(args.logical)]
        report(f"dpcore LeNet epoch, {args.logical} logical {kind} devices ({'kernel' if kind == 'cuda' else 'host'} "
               "all-reduce), resident", dpcore_lenet_epoch(devices, args.epochs, args.batch, True, args.max_batches),
               "s")
        report(f"dpcore ResNet-18 training, {args.logical} logical {kind} devices, global batch 64",
               dpcore_resnet_images_per_s(devices, args.resnet_steps, 64), "images/s")
        # model parallelism over the same logical devices (stages hand over device tensors)
        for name, strategy in ((f"pipeline of {args.logical} stages, 1F1B, 4 micro-batches",
                                dp.PipelineStrategy(devices=devices, micro_batches=4)),
                               (f"layerwise split over {args.logical}", dp.ModelParallelStrategy(devices=devices))):
            with strategy.scope():
                rate = dpcore_resnet_images_per_s(None, args.resnet_steps, 64)
            report(f"dpcore ResNet-18 training, {name} logical {kind} devices, batch 64", rate, "images/s")
        dp.set_logical_devices(kind, 1)
    if args.write:
        lines = ["## GPU (dpcore vs PyTorch, same GPU, same run)", "",
                 f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
                 f"- machine: {machine_info()}; GPUs: {dp._core.runtime_info()['cuda_devices']}, CUDA runtime "
                 f"{dp._core.runtime_info()['cuda_runtime_version']}, driver "
                 f"{dp._core.runtime_info()['cuda_driver_version']}",
                 f"- command (from the repository root): `{command_line()}`", "",
                 "| measurement | value | unit |", "|---|---|---|"]
        lines += [f"| {n} | {v:.3f} | {u} |" for n, v, u in rows]
        lines += [""] + [f"**{n}: {r:.3f}**" for n, r in ratios]
        replace_section(RESULTS, lines[0], "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
