"""GPU benchmark: LeNet epoch seconds and ResNet-18 training images/s on cuda:0,
with PyTorch's numbers beside them when torch with CUDA is installed.

    python benchmarks/bench_gpu.py [--epochs 1] [--resnet-steps 20] [--batch 256]

Exits with status 2 and a message when no usable CUDA device is present.
"""
import argparse
import sys
import time

import numpy as np

import dpcore as dp


def no_gpu_reason():
    if not dp.build_info().get("cuda_backend"):
        return "dpcore was built without the CUDA backend (needs the CUDA toolkit, cuDNN and cuBLAS)"
    info = dp._core.runtime_info()
    if info["cuda_device_count"] == 0:
        return "no usable CUDA device: " + info["cuda_why"]
    return None


def dpcore_lenet_epoch(epochs, batch):
    train_iter, _ = dp.data.load_fashion_mnist(batch_size=batch)
    net = dp.models.LeNet(devices=["cuda:0"])
    times = []
    for _ in range(epochs):
        start = time.perf_counter()
        for X, y in train_iter:
            net.train_step(X, y, lr=0.2)
        net._model.get_params()  # waits for the GPU
        times.append(time.perf_counter() - start)
    return min(times)


def dpcore_resnet_images_per_s(steps, batch):
    net = dp.models.ResNet18(devices=["cuda:0"])
    rng = np.random.default_rng(0)
    X = rng.standard_normal((batch, 1, 28, 28)).astype(np.float32)
    y = rng.integers(0, 10, batch)
    net.train_step(X, y, lr=0.05)  # plans the convolutions
    start = time.perf_counter()
    for _ in range(steps):
        net.train_step(X, y, lr=0.05)
    net._model.get_params()
    return steps * batch / (time.perf_counter() - start)


def torch_numbers(steps, batch):
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        return None
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    net = torch.nn.Sequential(
        torch.nn.Conv2d(1, 20, 3), torch.nn.ReLU(), torch.nn.AvgPool2d(2),
        torch.nn.Conv2d(20, 50, 5), torch.nn.ReLU(), torch.nn.AvgPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(800, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)).cuda()
    opt = torch.optim.SGD(net.parameters(), lr=0.2)
    X = torch.randn(batch, 1, 28, 28, device="cuda")
    y = torch.randint(0, 10, (batch,), device="cuda")
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(X), y).backward()
        opt.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(X), y).backward()
        opt.step()
    torch.cuda.synchronize()
    return {"lenet_images_per_s": steps * batch / (time.perf_counter() - start)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--resnet-steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=256)
    args = p.parse_args()
    reason = no_gpu_reason()
    if reason:
        print(f"bench_gpu: {reason}; nothing to measure", file=sys.stderr)
        return 2
    print(f"dpcore LeNet epoch on cuda:0: {dpcore_lenet_epoch(args.epochs, args.batch):.2f} s "
          f"(batch {args.batch}, best of {args.epochs})")
    print(f"dpcore ResNet-18 training on cuda:0: {dpcore_resnet_images_per_s(args.resnet_steps, 64):.0f} images/s "
          f"(batch 64)")
    torch = torch_numbers(50, args.batch)
    if torch is None:
        print("PyTorch with CUDA not installed: no comparison")
    else:
        print(f"PyTorch LeNet training on cuda:0: {torch['lenet_images_per_s']:.0f} images/s (batch {args.batch}, TF32 off)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
