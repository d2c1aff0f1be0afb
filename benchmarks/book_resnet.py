"""The book's ResNet-18 experiment (Dive into Deep Learning 12.6: batch 256, lr 0.1,
10 epochs, Fashion-MNIST at 28x28) in dpcore and, where PyTorch is installed, in the
book's own PyTorch code, on the same device: test accuracy and seconds per epoch, to
tell whether a gap to the book's 0.91-0.93 is noise or the recipe.

    python benchmarks/book_resnet.py [--epochs 10] [--device cuda|cpu] [--seeds 0]
        [--runs dpcore:d2l:float32,dpcore:torch:float32,dpcore:d2l:fast,torch:d2l,torch:d2l:tf32]
        [--subset N]   # the first N training and test images only (a quick look; not the book's number)
        [--test-subset M] [--batch-size B] [--lr LR]   # a shorter recipe over several seeds

    # the suite's short experiment (tests/test_resnet.py), both frameworks, 10 seeds:
    python benchmarks/book_resnet.py --subset 2000 --test-subset 1000 --batch-size 32 --lr 0.05 \
        --epochs 4 --seeds 0 1 2 3 4 5 6 7 8 9 --runs dpcore:d2l:float32,torch:d2l

A run is FRAMEWORK:INIT[:PRECISION]. dpcore: INIT 'd2l' is the chapter's recipe (its
train() re-draws every conv and dense weight from N(0, 0.01): ResNet18(init='d2l')),
'torch' PyTorch's default initialisation (dpcore's ResNet18 before); PRECISION is
dp.set_precision's. torch: the chapter's code (d2l's resnet18 as
tests/fixtures/make_fixtures.py builds it, init_weights N(0, 0.01), SGD, evaluation in
eval mode), 'torch' skips init_weights; PRECISION 'tf32' turns TF32 on in PyTorch (the peer of
dpcore's 'fast'), else it is off. Each run is its own subprocess (fresh state,
no framework sharing a process with the other). Prints one line per epoch, a table, and
per run over the seeds the last epoch's mean accuracy, its sample standard deviation and
mean - 4 sd (the bound a test of one seed can hold).
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def fashion(subset, test_subset=0):
    """The training and test sets as (n, 1, 28, 28) uint8 and int64 labels: the first
    `subset` training images (0: all) and the first `test_subset` test images (0: as many
    as `subset`, 0: all)."""
    import dpcore as dp
    X, y, Xt, yt = dp.data._load_fashion_mnist_arrays(None)
    test_subset = test_subset or subset
    if subset:
        X, y = X[:subset], y[:subset]
    if test_subset:
        Xt, yt = Xt[:test_subset], yt[:test_subset]
    return X.reshape(-1, 1, 28, 28), y.astype(np.int64), Xt.reshape(-1, 1, 28, 28), yt.astype(np.int64)


def run_dpcore(init, precision, args):
    import dpcore as dp
    dp.set_precision(precision)
    X, y, Xt, yt = fashion(args.subset, args.test_subset)
    device = "cuda:0" if args.device == "cuda" else "cpu:0"
    net = dp.models.ResNet18(seed=args.seed, init=init, devices=[device])
    train_iter = dp.data.from_arrays(X, y, batch_size=args.batch_size, shuffle=True, seed=args.seed)
    test_iter = dp.data.from_arrays(Xt, yt, batch_size=256)
    h = dp.train(net, train_iter, test_iter, num_epochs=args.epochs, lr=args.lr, verbose=False, progress=False)
    return list(h.test_acc), list(h.epoch_seconds)


def run_torch(init, precision, args):
    import torch
    spec = importlib.util.spec_from_file_location("make_fixtures", os.path.join(ROOT, "tests", "fixtures",
                                                                                  "make_fixtures.py"))
    mf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mf)
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    if device.type == "cuda":
        # PRECISION 'tf32' is the peer of dpcore's 'fast': TF32 in convolutions and matmuls
        # (cuDNN's algorithms are not deterministic in either, PyTorch's default).
        tf32 = precision == "tf32"
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
    net = mf.build_models()["resnet18"]()
    if init == "d2l":
        def init_weights(m):
            if type(m) in (torch.nn.Linear, torch.nn.Conv2d):
                torch.nn.init.normal_(m.weight, std=0.01)
        net.apply(init_weights)
    net = net.to(device)
    X, y, Xt, yt = fashion(args.subset, args.test_subset)
    X = torch.from_numpy(X.astype(np.float32) / 255.0)
    Xt = torch.from_numpy(Xt.astype(np.float32) / 255.0)
    y, yt = torch.from_numpy(y), torch.from_numpy(yt)
    trainer = torch.optim.SGD(net.parameters(), lr=args.lr)
    loss = torch.nn.CrossEntropyLoss()
    rng = np.random.default_rng(args.seed)
    accs, secs = [], []
    for _ in range(args.epochs):
        net.train()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        order = torch.from_numpy(rng.permutation(len(y)))
        for i in range(0, len(y), args.batch_size):
            idx = order[i:i + args.batch_size]
            trainer.zero_grad()
            loss(net(X[idx].to(device)), y[idx].to(device)).backward()
            trainer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        secs.append(time.perf_counter() - start)
        net.eval()
        hits = 0
        with torch.no_grad():
            for i in range(0, len(yt), 256):
                hits += int((net(Xt[i:i + 256].to(device)).argmax(1).cpu() == yt[i:i + 256]).sum())
        accs.append(hits / len(yt))
    return accs, secs


def child(args):
    parts = args.child.split(":")
    if parts[0] == "torch":
        accs, secs = run_torch(parts[1], parts[2] if len(parts) > 2 else "float32", args)
    else:
        accs, secs = run_dpcore(parts[1], parts[2] if len(parts) > 2 else "float32", args)
    print("RESULT " + json.dumps({"run": args.child, "test_acc": accs, "epoch_seconds": secs}), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None,
                    help="default: cuda where dpcore sees a GPU, else cpu")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--runs", default="dpcore:d2l:float32,dpcore:torch:float32,dpcore:d2l:fast,torch:d2l")
    ap.add_argument("--subset", type=int, default=0)
    ap.add_argument("--test-subset", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.device is None:
        import dpcore as dp
        args.device = "cuda" if dp._core.runtime_info()["cuda_device_count"] > 0 else "cpu"
    if args.child:
        return child(args)
    rows = []
    for seed in args.seeds:
        for run in [r for r in args.runs.split(",") if r]:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", run, "--epochs", str(args.epochs),
                   "--device", args.device, "--subset", str(args.subset), "--test-subset", str(args.test_subset),
                   "--batch-size", str(args.batch_size), "--lr", str(args.lr), "--seed", str(seed)]
            out = subprocess.run(cmd, capture_output=True, text=True)
            line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
            if out.returncode != 0 or line is None:
                print(f"{run} seed {seed}: failed (status {out.returncode}): {out.stderr.strip()[-400:]}", flush=True)
                continue
            r = json.loads(line[7:])
            for e, (a, s) in enumerate(zip(r["test_acc"], r["epoch_seconds"]), 1):
                print(f"{run} seed {seed} epoch {e}: test acc {a:.4f}, {s:.1f} s", flush=True)
            rows.append((run, seed, r["test_acc"], r["epoch_seconds"]))
    print(f"\n{args.epochs} epochs on {args.device}, batch {args.batch_size}, lr {args.lr}"
          + (f", the first {args.subset} training images" if args.subset else "")
          + (f", the first {args.test_subset or args.subset} test images" if args.test_subset or args.subset else "")
          + "; test accuracy per epoch")
    print("| run | seed | " + " | ".join(str(e) for e in range(1, args.epochs + 1)) + " | s/epoch (median) |")
    print("|---|---|" + "---|" * args.epochs + "---|")
    for run, seed, accs, secs in rows:
        print(f"| {run} | {seed} | " + " | ".join(f"{a:.3f}" for a in accs) + f" | {np.median(secs):.1f} |")
    print("\n| run | seeds | last epoch's accuracy: mean | sd | min | mean - 4 sd |\n|---|---|---|---|---|---|")
    for run in dict.fromkeys(r[0] for r in rows):
        last = [accs[-1] for r, _, accs, _ in rows if r == run]
        sd = float(np.std(last, ddof=1)) if len(last) > 1 else float("nan")
        mean = float(np.mean(last))
        print(f"| {run} | {len(last)} | {mean:.4f} | {sd:.4f} | {min(last):.4f} | {mean - 4 * sd:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
