"""How far training lands from exact arithmetic, in each precision of dpcore
(dp.set_precision) and in PyTorch float32, against PyTorch float64.

    benchmarks/.venv-bench/bin/python benchmarks/precision.py [--model lenet|resnet18]
                                      [--steps 3] [--batch 97] [--seeds 3]

The network from dpcore's initialisation (LeNet(seed=s): the book's N(0, 0.01);
ResNet18(seed=s, init='d2l'): chapter 12.6's recipe), copied into PyTorch
(tests/fixtures/make_fixtures.py's d2l modules), `--steps` SGD steps (lr 0.1,
momentum 0.9, weight decay 1e-3) on consecutive Fashion-MNIST training batches,
then the evaluation logits of 256 test images. Reported per run:
||w - w64|| / ||w64 - w0|| over every parameter tensor (the weights' distance
relative to how far they moved) and max |logits - logits64| / max |logits64|;
the median over --seeds initialisations, and each as a multiple of PyTorch
float32's (PyTorch's default, oneDNN's convolutions), and PyTorch float32 with
oneDNN off (its im2col + GEMM convolutions) beside it: two float32 orders of the
same sums, the spread a sound float32 implementation can land in.
"""
import argparse
import importlib.util
import os

import numpy as np

import torch  # before dpcore: dpcore's CUDA build loads an NCCL that torch's own must not meet first
import dpcore as dp  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location(
    "make_fixtures", os.path.join(os.path.dirname(HERE), "tests", "fixtures", "make_fixtures.py"))
make_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_fixtures)
TORCH_MODELS = make_fixtures.build_models()


def make_dpcore(model, seed):
    if model == "lenet":
        return dp.models.LeNet(seed=seed, devices=["cpu:0"])
    return dp.models.ResNet18(seed=seed, init="d2l", devices=["cpu:0"])


def run_torch(model, weights, batches, Xt, dtype, lr, mu, wd, onednn=True):
    torch.backends.mkldnn.enabled = onednn
    try:
        return _run_torch(model, weights, batches, Xt, dtype, lr, mu, wd)
    finally:
        torch.backends.mkldnn.enabled = True


def _run_torch(model, weights, batches, Xt, dtype, lr, mu, wd):
    net = TORCH_MODELS[model]().to(dtype)
    state = net.state_dict()
    net.load_state_dict({k: torch.from_numpy(weights[k].astype(np.float64)).to(dtype) if k in weights else v
                         for k, v in state.items()})
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=mu, weight_decay=wd)
    net.train()
    for X, y in batches:
        opt.zero_grad()
        x = torch.from_numpy(X.astype(np.float64) / 255.0).to(dtype)
        torch.nn.functional.cross_entropy(net(x), torch.from_numpy(y)).backward()
        opt.step()
    net.eval()
    with torch.no_grad():
        logits = net(torch.from_numpy(Xt.astype(np.float64) / 255.0).to(dtype)).double().numpy()
    return {n: p.detach().double().numpy() for n, p in net.named_parameters()}, logits


def run_dpcore(model, weights, batches, Xt, precision, lr, mu, wd, seed):
    dp.set_precision(precision)
    try:
        net = make_dpcore(model, seed)
        net.set_weights(weights)
        for X, y in batches:
            net.train_step(X, y, lr=lr, momentum=mu, weight_decay=wd)
        return {n: w.astype(np.float64) for n, w in net.get_weights().items()}, net.predict(Xt).astype(np.float64)
    finally:
        dp.set_precision("float32")


def distances(got, ref, w0):
    w, logits = got
    w64, logits64 = ref
    names = list(w64)  # the parameters (running statistics are not parameters)
    moved = np.sqrt(sum(((w64[n] - w0[n]) ** 2).sum() for n in names))
    dist = np.sqrt(sum(((w[n] - w64[n]) ** 2).sum() for n in names)) / moved
    return dist, float(np.abs(logits - logits64).max() / np.abs(logits64).max())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("lenet", "resnet18"), default="lenet")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=97)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    lr, mu, wd = 0.1, 0.9, 1e-3
    X, y, Xtest, _ = dp.data._load_fashion_mnist_arrays(None)
    Xt = Xtest[:256].reshape(-1, 1, 28, 28)
    runs = {"dpcore float32 (default)": [], "dpcore fast": [], "PyTorch float32": [],
            "PyTorch float32, oneDNN off": []}
    for seed in range(args.seeds):
        w0 = make_dpcore(args.model, seed).get_weights()
        start = seed * args.steps * args.batch
        batches = [(X[i:i + args.batch].reshape(-1, 1, 28, 28), y[i:i + args.batch].astype(np.int64))
                   for i in range(start, start + args.steps * args.batch, args.batch)]
        ref = run_torch(args.model, w0, batches, Xt, torch.float64, lr, mu, wd)
        w064 = {n: w0[n].astype(np.float64) for n in ref[0]}
        for name, precision in (("dpcore float32 (default)", "float32"), ("dpcore fast", "fast")):
            runs[name].append(distances(run_dpcore(args.model, w0, batches, Xt, precision, lr, mu, wd, seed),
                                        ref, w064))
        runs["PyTorch float32"].append(distances(run_torch(args.model, w0, batches, Xt, torch.float32, lr, mu, wd),
                                                 ref, w064))
        # the same float32 training by PyTorch's other CPU convolutions (im2col + GEMM): how
        # far two sound float32 orders of the same sums land apart is the noise floor here
        runs["PyTorch float32, oneDNN off"].append(distances(
            run_torch(args.model, w0, batches, Xt, torch.float32, lr, mu, wd, onednn=False), ref, w064))
    peer = np.median(np.array(runs["PyTorch float32"]), axis=0)
    print(f"{args.model}, dpcore's init (seed 0..{args.seeds - 1}), {args.steps} SGD steps of {args.batch} "
          f"Fashion-MNIST images, median of {args.seeds} seeds; distance to PyTorch float64")
    print("| run | weights, relative to their movement | x PyTorch f32 | eval logits, max relative | x PyTorch f32 |")
    print("|---|---|---|---|---|")
    for name, vals in runs.items():
        m = np.median(np.array(vals), axis=0)
        print(f"| {name} | {m[0]:.2e} | {m[0] / peer[0]:.1f}x | {m[1]:.2e} | {m[1] / peer[1]:.1f}x |")
    # the medians hide how heavy-tailed these distances are (ReLU flips): every seed's
    print("\nper seed: weights | eval logits")
    for name, vals in runs.items():
        print(f"{name}: " + ", ".join(f"{w:.2e} | {lg:.2e}" for w, lg in vals))


if __name__ == "__main__":
    main()
