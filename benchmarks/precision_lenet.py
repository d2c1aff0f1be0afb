"""How far LeNet's training lands from exact arithmetic, in each precision of
dpcore (dp.set_precision) and in PyTorch float32, against PyTorch float64.

    benchmarks/.venv-bench/bin/python benchmarks/precision_lenet.py [--steps 3] [--batch 97] [--seeds 3]

LeNet from the book's initialisation (dpcore's LeNet(seed=s) weights, copied into
PyTorch), `--steps` SGD steps (lr 0.1, momentum 0.9, weight decay 1e-3) on
consecutive Fashion-MNIST training batches, then the evaluation logits of 256
test images. Reported per run: ||w - w64|| / ||w64 - w0|| over every tensor (the
weights' distance relative to how far they moved) and max |logits - logits64| /
max |logits64|; the median over --seeds initialisations, and each as a multiple
of PyTorch float32's.
"""
import argparse
import os

import numpy as np

import torch  # before dpcore: dpcore's CUDA build loads an NCCL that torch's own must not meet first
import dpcore as dp  # noqa: E402

NAMES = ["0.weight", "0.bias", "3.weight", "3.bias", "7.weight", "7.bias", "9.weight", "9.bias"]


def torch_lenet(weights, dtype):
    nn = torch.nn
    net = nn.Sequential(nn.Conv2d(1, 20, 3), nn.ReLU(), nn.AvgPool2d(2), nn.Conv2d(20, 50, 5), nn.ReLU(),
                        nn.AvgPool2d(2), nn.Flatten(), nn.Linear(800, 128), nn.ReLU(), nn.Linear(128, 10)).to(dtype)
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.copy_(torch.from_numpy(weights[name].astype(np.float64)).to(dtype))
    return net


def run_torch(weights, batches, Xt, dtype, lr, mu, wd):
    net = torch_lenet(weights, dtype)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=mu, weight_decay=wd)
    for X, y in batches:
        opt.zero_grad()
        x = torch.from_numpy(X.astype(np.float64) / 255.0).to(dtype)
        torch.nn.functional.cross_entropy(net(x), torch.from_numpy(y)).backward()
        opt.step()
    with torch.no_grad():
        logits = net(torch.from_numpy(Xt.astype(np.float64) / 255.0).to(dtype)).double().numpy()
    return {n: p.detach().double().numpy() for n, p in net.named_parameters()}, logits


def run_dpcore(weights, batches, Xt, precision, lr, mu, wd):
    dp.set_precision(precision)
    try:
        net = dp.models.LeNet(devices=["cpu:0"])
        net.set_weights(weights)
        for X, y in batches:
            net.train_step(X, y, lr=lr, momentum=mu, weight_decay=wd)
        return {n: w.astype(np.float64) for n, w in net.get_weights().items()}, net.predict(Xt).astype(np.float64)
    finally:
        dp.set_precision("float32")


def distances(got, ref, w0):
    w, logits = got
    w64, logits64 = ref
    moved = np.sqrt(sum(((w64[n] - w0[n]) ** 2).sum() for n in NAMES))
    dist = np.sqrt(sum(((w[n] - w64[n]) ** 2).sum() for n in NAMES)) / moved
    return dist, float(np.abs(logits - logits64).max() / np.abs(logits64).max())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=97)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    lr, mu, wd = 0.1, 0.9, 1e-3
    X, y, Xtest, _ = dp.data._load_fashion_mnist_arrays(None)
    Xt = Xtest[:256].reshape(-1, 1, 28, 28)
    runs = {"dpcore float32 (default)": [], "dpcore fast": [], "PyTorch float32": []}
    for seed in range(args.seeds):
        w0 = {n: w for n, w in dp.models.LeNet(seed=seed, devices=["cpu:0"]).get_weights().items()}
        start = seed * args.steps * args.batch
        batches = [(X[i:i + args.batch].reshape(-1, 1, 28, 28), y[i:i + args.batch].astype(np.int64))
                   for i in range(start, start + args.steps * args.batch, args.batch)]
        ref = run_torch(w0, batches, Xt, torch.float64, lr, mu, wd)
        w064 = {n: w.astype(np.float64) for n, w in w0.items()}
        runs["dpcore float32 (default)"].append(distances(run_dpcore(w0, batches, Xt, "float32", lr, mu, wd), ref, w064))
        runs["dpcore fast"].append(distances(run_dpcore(w0, batches, Xt, "fast", lr, mu, wd), ref, w064))
        runs["PyTorch float32"].append(distances(run_torch(w0, batches, Xt, torch.float32, lr, mu, wd), ref, w064))
    peer = np.median(np.array(runs["PyTorch float32"]), axis=0)
    print(f"LeNet, book init, {args.steps} SGD steps of {args.batch} Fashion-MNIST images, median of {args.seeds} "
          f"seeds; distance to PyTorch float64")
    print("| run | weights, relative to their movement | x PyTorch f32 | eval logits, max relative | x PyTorch f32 |")
    print("|---|---|---|---|---|")
    for name, vals in runs.items():
        m = np.median(np.array(vals), axis=0)
        print(f"| {name} | {m[0]:.2e} | {m[0] / peer[0]:.1f}x | {m[1]:.2e} | {m[1] / peer[1]:.1f}x |")


if __name__ == "__main__":
    main()
