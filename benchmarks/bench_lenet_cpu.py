#!/usr/bin/env python3
"""Time one training epoch of LeNet on Fashion-MNIST in dpcore and in PyTorch, on the CPU.

Both frameworks train the same network on the same data with the same settings:

    conv3x3 1->20, ReLU, avgpool2; conv5x5 20->50, ReLU, avgpool2; flatten;
    dense 800->128, ReLU; dense 128->10
    weights N(0, 0.01), biases 0; softmax cross-entropy (mean over the batch);
    plain SGD, lr 0.2, batch 256 (the last, partial batch is kept), shuffled every epoch

and the same number of threads (default: the CPUs this process may run on). Each
framework runs in a fresh subprocess of this script, so that OMP_NUM_THREADS (and
MKL_/OPENBLAS_NUM_THREADS) are set before the framework is imported; the parent
alternates the order of the subprocesses from round to round (torch, dpcore, then
dpcore, torch, ...) to spread the noise of a shared machine over both.

Timed: the training pass of each epoch only (no evaluation, no data loading from
disk). Fairness notes: PyTorch gets its inputs as a float32 tensor scaled to [0, 1]
that is computed once, before timing; dpcore gets uint8 batches and converts them
inside its timed loop. Both gather the shuffled batches inside the timed loop.

Usage (from the repository root, in the benchmark venv: benchmarks/setup_bench_env.sh):

    benchmarks/.venv-bench/bin/python benchmarks/bench_lenet_cpu.py                # both, print a table
    benchmarks/.venv-bench/bin/python benchmarks/bench_lenet_cpu.py --write        # ... and update RESULTS.md
    benchmarks/.venv-bench/bin/python benchmarks/bench_lenet_cpu.py --framework torch --threads 1
    options: --threads T  --epochs E (per subprocess, default 2)  --rounds R (default 2)
             --data-dir DIR (default /usr/share/datasets/fashion-mnist)  --results PATH

Exit status: 0 on success; 2 when dpcore is needed but cannot be imported (the message
starts with "dpcore not importable:"); 1 when a subprocess fails otherwise.
PyTorch is a benchmark-only dependency: nothing in dpcore imports it.
"""
import argparse
import datetime
import gzip
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_common import EXIT_DPCORE_MISSING, RESULT_MARKER, import_dpcore, log  # noqa: E402

REPO = os.path.dirname(HERE)
DEFAULT_DATA_DIR = "/usr/share/datasets/fashion-mnist"
DEFAULT_RESULTS = os.path.join(HERE, "RESULTS.md")
SECTION_TITLE = "## LeNet epoch, CPU (dpcore vs PyTorch)"
BATCH_SIZE = 256
LR = 0.2
SEED = 0
FRAMEWORKS = ("torch", "dpcore")


def default_threads():
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def child_json(cmd, env, what):
    """Run a benchmark's child process; its last stdout line, parsed as JSON (a failure ends the run
    with what failed and the child's output)."""
    import json
    import subprocess
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"the {what} subprocess failed:\n{out.stdout}{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def thread_env(threads):
    """The environment of a framework subprocess: every thread knob pinned to `threads`."""
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    # CPU only, even on a machine with a GPU.
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


# ---------------------------------------------------------------------------------------------
# Children: one framework, a few epochs, one JSON line on stdout.
# ---------------------------------------------------------------------------------------------

def read_idx(path):
    """A minimal IDX reader (gzip + numpy) for the torch half; dpcore reads the files itself."""
    import numpy as np
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError("%s: not an unsigned-byte IDX file" % path)
    ndim = raw[3]
    dims = tuple(int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load_fashion_mnist_arrays(data_dir):
    def find(stem):
        for name in (stem, stem + ".gz"):  # raw first, as dpcore does
            p = os.path.join(data_dir, name)
            if os.path.exists(p):
                return p
        raise FileNotFoundError("%s: no %s(.gz)" % (data_dir, stem))

    return tuple(read_idx(find(stem)) for stem in (
        "train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"))


def child_torch(args):
    import numpy as np
    import torch
    from torch import nn

    torch.set_num_threads(args.threads)
    if args.torch_flush_denormal:
        torch.set_flush_denormal(True)
    torch.manual_seed(SEED)

    Xtr, ytr, Xte, yte = load_fashion_mnist_arrays(args.data_dir)
    # Precomputed once, outside the timed loop (dpcore converts uint8 inside its loop).
    X = torch.from_numpy(Xtr.reshape(-1, 1, 28, 28).astype(np.float32) / 255.0).contiguous()
    y = torch.from_numpy(ytr.astype(np.int64))
    Xt = torch.from_numpy(Xte.reshape(-1, 1, 28, 28).astype(np.float32) / 255.0).contiguous()
    yt = torch.from_numpy(yte.astype(np.int64))
    n = X.shape[0]

    net = nn.Sequential(
        nn.Conv2d(1, 20, kernel_size=3), nn.ReLU(), nn.AvgPool2d(2),
        nn.Conv2d(20, 50, kernel_size=5), nn.ReLU(), nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Linear(800, 128), nn.ReLU(),
        nn.Linear(128, 10),
    )
    for m in net.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            nn.init.normal_(m.weight, mean=0.0, std=0.01)
            nn.init.zeros_(m.bias)
    loss_fn = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(net.parameters(), lr=LR)

    def evaluate():
        net.eval()
        correct = 0
        with torch.no_grad():
            for s in range(0, Xt.shape[0], 1000):
                correct += int((net(Xt[s:s + 1000]).argmax(1) == yt[s:s + 1000]).sum())
        net.train()
        return correct / Xt.shape[0]

    epochs = []
    for e in range(args.epochs):
        # The same seeded shuffle as dpcore's training iterator: epoch e visits the examples
        # in the order np.random.default_rng([seed, e]).permutation(n).
        perm = torch.from_numpy(np.random.default_rng([SEED, e]).permutation(n))
        loss_sum = torch.zeros((), dtype=torch.float64)
        correct = torch.zeros((), dtype=torch.int64)
        t0 = time.perf_counter()
        for s in range(0, n, BATCH_SIZE):
            idx = perm[s:s + BATCH_SIZE]
            xb, yb = X[idx], y[idx]
            opt.zero_grad(set_to_none=True)
            out = net(xb)
            loss = loss_fn(out, yb)
            loss.backward()
            opt.step()
            with torch.no_grad():
                loss_sum += loss.detach().double() * yb.shape[0]
                correct += (out.argmax(1) == yb).sum()
        seconds = time.perf_counter() - t0
        epochs.append({
            "seconds": seconds,
            "train_loss": float(loss_sum) / n,
            "train_acc": int(correct) / n,
            "test_acc": evaluate(),
        })
        log("  torch  epoch %d: %.3f s  loss %.4f  train acc %.3f  test acc %.3f" % (
            len(epochs), seconds, epochs[-1]["train_loss"], epochs[-1]["train_acc"], epochs[-1]["test_acc"]))
    return {
        "framework": "torch",
        "version": torch.__version__,
        "threads": torch.get_num_threads(),
        "n_train": int(n),
        "epochs": epochs,
        "info": {"mkldnn": bool(torch.backends.mkldnn.is_available()),
                 "flush_denormal": bool(args.torch_flush_denormal)},
    }


def child_dpcore(args):
    dp, err = import_dpcore()
    if dp is None:
        print("dpcore not importable: %s" % err, file=sys.stderr, flush=True)
        sys.exit(EXIT_DPCORE_MISSING)

    net = dp.models.LeNet(seed=SEED)
    train_iter, test_iter = dp.data.load_fashion_mnist(batch_size=BATCH_SIZE, root=args.data_dir)
    history = dp.train(net, train_iter, test_iter, num_epochs=args.epochs, lr=LR, verbose=False)

    def at(name, i):
        values = list(getattr(history, name, None) or [])
        return float(values[i]) if i < len(values) else None

    epochs = []
    for i, seconds in enumerate(history.epoch_seconds):
        epochs.append({"seconds": float(seconds), "train_loss": at("train_loss", i),
                       "train_acc": at("train_acc", i), "test_acc": at("test_acc", i)})
        log("  dpcore epoch %d: %.3f s  loss %s  train acc %s  test acc %s" % (
            i + 1, seconds, fmt(epochs[-1]["train_loss"], 4), fmt(epochs[-1]["train_acc"], 3),
            fmt(epochs[-1]["test_acc"], 3)))
    n_train = getattr(train_iter, "num_examples", None)
    info = {}
    try:
        summary = dp.build_info().get("summary", {})
        info = dict(summary) if isinstance(summary, dict) else {"build": str(summary)}
    except Exception:
        pass
    if getattr(history, "devices", None):
        info["devices"] = list(history.devices)
    import floor
    gflops = floor.sgemm_gflops(threads=args.threads)
    per_image = floor.training_flops_per_image(net)
    log("  machine floor: SGEMM %.1f GFLOP/s with %d thread(s); %.4f GFLOP per image -> %.3f s per epoch" % (
        gflops, args.threads, per_image / 1e9, floor.floor_seconds(per_image * (n_train or 60000), gflops)))
    return {
        "framework": "dpcore",
        "version": getattr(dp, "__version__", "?"),
        "threads": int(os.environ.get("OMP_NUM_THREADS", "0")) or None,
        "n_train": n_train,
        "epochs": epochs,
        "info": info,
        "floor": {"sgemm_gflops": gflops, "flops_per_image": per_image},
    }


def run_child(args):
    os.environ.update({k: v for k, v in thread_env(args.threads).items()
                       if k.endswith("_NUM_THREADS") or k == "CUDA_VISIBLE_DEVICES"})
    result = (child_torch if args.framework == "torch" else child_dpcore)(args)
    print(RESULT_MARKER + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------------------
# Parent: orchestrate, summarise, write RESULTS.md.
# ---------------------------------------------------------------------------------------------

def fmt(x, digits):
    return "-" if x is None else ("%.*f" % (digits, x))


def spawn(framework, args):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--framework", framework,
           "--threads", str(args.threads), "--epochs", str(args.epochs), "--data-dir", args.data_dir]
    if args.torch_flush_denormal:
        cmd.append("--torch-flush-denormal")
    proc = subprocess.run(cmd, env=thread_env(args.threads), stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        return None, proc.returncode
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_MARKER):
            return json.loads(line[len(RESULT_MARKER):]), 0
    log("%s subprocess printed no result" % framework)
    return None, 1


def check_dpcore_importable(args):
    """Fail fast (before minutes of torch timing) when dpcore cannot be imported."""
    code = "import dpcore"
    proc = subprocess.run([sys.executable, "-c", code], env=thread_env(args.threads),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE)
    if proc.returncode != 0:
        lines = [l for l in proc.stderr.strip().splitlines() if l.strip()]
        return lines[-1] if lines else "exit status %d" % proc.returncode
    return None


def summarise(runs):
    times = [e["seconds"] for r in runs for e in r["epochs"]]
    last = runs[-1]["epochs"][-1]
    n = runs[-1].get("n_train") or 60000
    return {
        "framework": runs[0]["framework"],
        "version": runs[0]["version"],
        "threads": runs[0]["threads"],
        "n_train": n,
        "times": times,
        "min": min(times),
        "mean": statistics.mean(times),
        "ips": n / min(times),
        "train_loss": last["train_loss"],
        "train_acc": last["train_acc"],
        "test_acc": last["test_acc"],
        "info": runs[0].get("info", {}),
        # the machine's best SGEMM rate over the rounds: the lowest (strictest) floor
        "floor": max((r["floor"] for r in runs if r.get("floor")), key=lambda f: f["sgemm_gflops"], default=None),
    }


def floor_seconds(summaries):
    """The epoch's GEMM floor (benchmarks/floor.py), measured in dpcore's subprocesses, or None."""
    measured = [s["floor"] for s in summaries if s.get("floor")]
    if not measured:
        return None
    best = max(measured, key=lambda f: f["sgemm_gflops"])
    n = next(s["n_train"] for s in summaries if s.get("floor"))
    return best["flops_per_image"] * n / (best["sgemm_gflops"] * 1e9)


def table(summaries):
    floor_s = floor_seconds(summaries)
    rows = ["| framework | version | threads | epochs timed | min s | mean s | images/s (min) "
            "| floor s | min / floor | train loss | train acc | test acc |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        rows.append("| %s | %s | %s | %d | %.3f | %.3f | %.0f | %s | %s | %s | %s | %s |" % (
            s["framework"], s["version"], s["threads"], len(s["times"]), s["min"], s["mean"], s["ips"],
            fmt(floor_s, 3), fmt(floor_s and s["min"] / floor_s, 2),
            fmt(s["train_loss"], 4), fmt(s["train_acc"], 3), fmt(s["test_acc"], 3)))
    return "\n".join(rows)


def machine_info():
    model = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
            mem = ", %.0f GiB RAM" % (kb / 2 ** 20)
    except (OSError, ValueError, IndexError):
        pass
    return "%s, nproc %d (%d usable)%s, %s %s, Python %s" % (
        model, os.cpu_count() or 0, default_threads(), mem, platform.system(), platform.release(),
        platform.python_version())


def command_line():
    def rel(p):
        p = os.path.abspath(p)
        return os.path.relpath(p, REPO) if p.startswith(REPO + os.sep) else p
    return shlex.join([rel(sys.executable), rel(sys.argv[0])] + sys.argv[1:])


def section_text(args, summaries, ratio_min, ratio_mean, load_before, load_after):
    torch_s = next(s for s in summaries if s["framework"] == "torch")
    dp_s = next(s for s in summaries if s["framework"] == "dpcore")
    info = dp_s.get("info") or {}
    dp_info = ", ".join("%s: %s" % (k, info[k]) for k in ("blas", "openmp", "devices") if k in info)
    goal = "met" if ratio_min <= 1.0 else "not met"
    lines = [
        SECTION_TITLE,
        "",
        "- date: %s" % datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "- machine: %s" % machine_info(),
        "- load average before / after: %s / %s (a shared 2-core machine: other work inflates single epochs, "
        "so the headline ratio uses each framework's best epoch)" % (load_before, load_after),
        "- PyTorch %s (MKL-DNN %s, flush denormals %s); dpcore %s%s" % (
            torch_s["version"], "on" if torch_s["info"].get("mkldnn") else "off",
            "on" if torch_s["info"].get("flush_denormal") else "off (stock)", dp_s["version"],
            (" (" + dp_info + ")") if dp_info else ""),
        "- threads: %d (OMP_NUM_THREADS=MKL_NUM_THREADS=OPENBLAS_NUM_THREADS=%d, torch.set_num_threads(%d))" % (
            args.threads, args.threads, args.threads),
        "- command (from the repository root): `%s`" % command_line(),
        "- setup: LeNet (conv3x3 1->20, avgpool, conv5x5 20->50, avgpool, dense 800->128->10), "
        "Fashion-MNIST train set (%d images), batch %d, plain SGD lr %g, N(0, 0.01) init; "
        "%d round(s) of fresh subprocesses in alternating order, %d epoch(s) each; "
        "a training pass only is timed" % (torch_s["n_train"], BATCH_SIZE, LR, args.rounds, args.epochs),
        "- fairness: PyTorch's float32 inputs (/255) are precomputed before timing; "
        "dpcore converts uint8 batches inside its timed loop",
        "- floor (benchmarks/floor.py): the epoch's counted training FLOPs (conv and dense: forward, weight "
        "and input gradients) at this machine's best %s GFLOP/s of a 2048^3 SGEMM through dpcore's OpenBLAS "
        "with the same threads, measured in the dpcore subprocesses" % fmt(
            max((s["floor"]["sgemm_gflops"] for s in summaries if s.get("floor")), default=None), 1),
        "",
        table(summaries),
        "",
        "All epoch times (s): torch %s; dpcore %s" % (
            ", ".join("%.3f" % t for t in torch_s["times"]), ", ".join("%.3f" % t for t in dp_s["times"])),
        "",
        "**Ratio dpcore_seconds / torch_seconds: %.3f** (best epochs; %.3f on the means). "
        "Goal <= 1.0: %s; project goal 0.5." % (ratio_min, ratio_mean, goal),
        "",
    ]
    return "\n".join(lines)


def publish(lines, title, write):
    """Print a benchmark's section (a list of lines) and, with --write, put it into RESULTS.md."""
    section = "\n".join(lines)
    print(section)
    if write:
        replace_section(DEFAULT_RESULTS, title, section)


def replace_section(path, title, section):
    """Replace (or append) the section headed `title` in RESULTS.md, keeping every other
    section; written atomically (temp file + os.replace). Every benchmark writes through this."""
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
    else:
        text = "# Benchmark results\n"
    lines = text.splitlines()
    start = next((i for i, l in enumerate(lines) if l.strip() == title), None)
    if start is None:
        kept = text.rstrip("\n") + "\n\n" + section
    else:
        end = next((j for j in range(start + 1, len(lines)) if lines[j].startswith("## ")), len(lines))
        before = "\n".join(lines[:start]).rstrip("\n")
        after = "\n".join(lines[end:]).strip("\n")
        kept = (before + "\n\n" if before else "") + section.rstrip("\n") + "\n" + ("\n" + after + "\n" if after else "")
    kept = kept.rstrip("\n") + "\n"
    fd, tmp = tempfile.mkstemp(prefix=".RESULTS.", suffix=".md.tmp", dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "w") as f:
            f.write(kept)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_results(path, section):
    """Replace (or append) this benchmark's section in RESULTS.md."""
    replace_section(path, SECTION_TITLE, section)


def run_parent(args):
    wanted = FRAMEWORKS if args.framework == "both" else (args.framework,)
    if args.write and len(wanted) != 2:
        log("--write needs both frameworks (the section reports their ratio)")
        return 1
    if "dpcore" in wanted:
        err = check_dpcore_importable(args)
        if err is not None:
            log("dpcore not importable: %s" % err)
            log("(build it into this interpreter's environment: benchmarks/setup_bench_env.sh; "
                "or run --framework torch alone)")
            return EXIT_DPCORE_MISSING

    load_before = "%.2f" % os.getloadavg()[0]
    if os.getloadavg()[0] >= 0.5:
        log("note: load average %s (the 1-minute average, which may include earlier runs): "
            "timings may be noisy" % load_before)
    log("LeNet / Fashion-MNIST, batch %d, lr %g, %d thread(s), %d round(s) x %d epoch(s), frameworks: %s" % (
        BATCH_SIZE, LR, args.threads, args.rounds, args.epochs, ", ".join(wanted)))
    results = {f: [] for f in wanted}
    for r in range(args.rounds):
        order = list(wanted) if r % 2 == 0 else list(reversed(wanted))
        for fw in order:
            log("round %d: %s" % (r + 1, fw))
            res, rc = spawn(fw, args)
            if res is None:
                log("%s subprocess failed (exit status %d)" % (fw, rc))
                return EXIT_DPCORE_MISSING if rc == EXIT_DPCORE_MISSING else 1
            results[fw].append(res)
    load_after = "%.2f" % os.getloadavg()[0]

    summaries = [summarise(results[f]) for f in FRAMEWORKS if f in results]
    print()
    print(table(summaries))
    print()
    print("timed: training pass only; torch inputs precomputed as float32/255 outside timing, "
          "dpcore converts uint8 inside its timed loop")
    print("load average before / after: %s / %s" % (load_before, load_after))
    if "torch" in results:
        print("torch flush denormals: %s" % ("on (--torch-flush-denormal)" if args.torch_flush_denormal
                                            else "off (stock PyTorch)"))
    if len(summaries) == 2:
        by = {s["framework"]: s for s in summaries}
        ratio_min = by["dpcore"]["min"] / by["torch"]["min"]
        ratio_mean = by["dpcore"]["mean"] / by["torch"]["mean"]
        print("ratio dpcore_seconds / torch_seconds: %.3f (best epochs), %.3f (means); goal <= 1.0, "
              "project goal 0.5" % (ratio_min, ratio_mean))
        if args.write:
            write_results(args.results, section_text(args, summaries, ratio_min, ratio_mean,
                                                     load_before, load_after))
            print("updated %s" % args.results)
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--framework", choices=("both",) + FRAMEWORKS, default="both",
                    help="which framework(s) to time (default: both)")
    ap.add_argument("--threads", type=int, default=default_threads(),
                    help="threads for both frameworks (default: the CPUs this process may use, %(default)s)")
    ap.add_argument("--epochs", type=int, default=2, help="epochs per subprocess (default 2)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="subprocesses per framework, in alternating order (default 2)")
    ap.add_argument("--data-dir", default=os.environ.get("DPCORE_DATA", DEFAULT_DATA_DIR),
                    help="Fashion-MNIST IDX files (default %(default)s)")
    ap.add_argument("--torch-flush-denormal", action="store_true",
                    help="torch.set_flush_denormal(True) in the torch run (default: stock PyTorch; "
                         "a check for denormal slow-downs, none measured here)")
    ap.add_argument("--write", action="store_true", help="update the section in --results")
    ap.add_argument("--results", default=DEFAULT_RESULTS, help="default benchmarks/RESULTS.md")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.threads < 1 or args.epochs < 1 or args.rounds < 1:
        ap.error("--threads, --epochs and --rounds must be >= 1")
    if args.child:
        if args.framework == "both":
            ap.error("--child needs --framework torch or dpcore")
        run_child(args)
        return 0
    return run_parent(args)


if __name__ == "__main__":
    sys.exit(main())
