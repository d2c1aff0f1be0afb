"""ResNet-18 (d2l 12.6) training throughput on the CPU: dpcore beside PyTorch, same run.

Both frameworks train the same network (dpcore's ResNet18 and d2l's torch
resnet18, built as in tests/fixtures/make_fixtures.py) on the same batch of
real Fashion-MNIST images (batch 64, SGD lr 0.05), each in a fresh subprocess
with the same thread count; rounds alternate the order. The headline is the
best step of each (the machine is shared: other work only ever slows a step
down); the median of every timed step and each round's best are reported
beside it, so a lucky step shows.

    benchmarks/.venv-bench/bin/python benchmarks/bench_resnet_cpu.py [--steps 6] [--rounds 2] [--write]

Needs PyTorch (benchmarks/setup_bench_env.sh installs it with dpcore into
benchmarks/.venv-bench).
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_lenet_cpu as common  # noqa: E402  (machine_info, thread_env, write_results, ...)

SECTION_TITLE = "## ResNet-18 training throughput, CPU (dpcore vs PyTorch)"
BATCH, LR, WARMUP = 64, 0.05, 2


def batch():
    import numpy as np
    root = os.environ.get("DPCORE_DATA", common.DEFAULT_DATA_DIR)  # as dp.data finds it
    X = common.read_idx(os.path.join(root, "train-images-idx3-ubyte.gz"))[:BATCH]
    y = common.read_idx(os.path.join(root, "train-labels-idx1-ubyte.gz"))[:BATCH]
    return (X[:, None].astype(np.float32) / 255.0), y.astype(np.int64)


def child(framework, steps):
    X, y = batch()
    times = []
    if framework == "torch":
        import torch
        sys.path.insert(0, os.path.join(common.REPO, "tests", "fixtures"))
        from make_fixtures import build_models  # d2l's modules, as the fixtures build them
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        net = build_models()["resnet18"](10, 1)
        opt = torch.optim.SGD(net.parameters(), lr=LR)
        loss_fn = torch.nn.CrossEntropyLoss()
        Xt, yt = torch.from_numpy(X), torch.from_numpy(y)
        net.train()
        for i in range(WARMUP + steps):
            start = time.perf_counter()
            opt.zero_grad()
            loss = loss_fn(net(Xt), yt)
            loss.backward()
            opt.step()
            if i >= WARMUP:
                times.append(time.perf_counter() - start)
        version = torch.__version__
    else:
        import dpcore as dp
        net = dp.models.ResNet18()
        for i in range(WARMUP + steps):
            start = time.perf_counter()
            net.train_step(X, y, lr=LR)
            if i >= WARMUP:
                times.append(time.perf_counter() - start)
        version = f"{dp.__version__} (precision {dp.get_precision()!r})"
        import floor  # benchmarks/floor.py: the same threads, after the timed steps
        result_floor = {"sgemm_gflops": floor.sgemm_gflops(threads=int(os.environ["OMP_NUM_THREADS"])),
                        "flops_per_image": floor.training_flops_per_image(net)}
    print(json.dumps({"framework": framework, "version": version, "times": times,
                      "floor": result_floor if framework == "dpcore" else None}))


def spawn(framework, args):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", framework, "--steps", str(args.steps)]
    out = subprocess.run(cmd, env=common.thread_env(args.threads), capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6, help="timed steps per subprocess (default 6)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=common.default_threads())
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--child", choices=("torch", "dpcore"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.steps)
    load_before = os.getloadavg()[0]
    best, steps, rounds = {}, {"torch": [], "dpcore": []}, {"torch": [], "dpcore": []}
    floors = []
    for r in range(args.rounds):
        order = ("torch", "dpcore") if r % 2 == 0 else ("dpcore", "torch")
        for fw in order:
            run = spawn(fw, args)
            step = min(run["times"])
            steps[fw] += run["times"]
            floors += [run["floor"]] if run.get("floor") else []
            rounds[fw].append(step)
            common.log(f"round {r + 1} {fw}: best step {step:.3f} s ({BATCH / step:.1f} images/s)")
            if fw not in best or step < best[fw]["step"]:
                best[fw] = {"step": step, "version": run["version"], "all": run["times"]}
    median = {fw: statistics.median(t) for fw, t in steps.items()}
    ratio = (BATCH / best["dpcore"]["step"]) / (BATCH / best["torch"]["step"])
    ratio_median = median["torch"] / median["dpcore"]
    # the GEMM floor of one step (benchmarks/floor.py) at the best SGEMM rate of the rounds
    machine = max(floors, key=lambda f: f["sgemm_gflops"])
    floor_step = machine["flops_per_image"] * BATCH / (machine["sgemm_gflops"] * 1e9)
    lines = [
        SECTION_TITLE, "",
        "- date: %s" % datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "- machine: %s; load average before / after: %.2f / %.2f" % (common.machine_info(), load_before,
                                                                     os.getloadavg()[0]),
        "- PyTorch %s, dpcore %s, %d threads each; command (from the repository root): `%s`" % (
            best["torch"]["version"], best["dpcore"]["version"], args.threads, common.command_line()),
        "- setup: ResNet-18 (d2l 12.6, 28x28 inputs, 11.2M parameters), training mode, batch %d of real "
        "Fashion-MNIST images, SGD lr %g; %d warm-up + %d timed steps per fresh subprocess, %d round(s) in "
        "alternating order, best step counts" % (BATCH, LR, WARMUP, args.steps, args.rounds),
        "- floor (benchmarks/floor.py): %.3f GFLOP per image for a training step (conv and dense: forward, "
        "weight and input gradients) at this machine's best %.1f GFLOP/s of a 2048^3 SGEMM through dpcore's "
        "OpenBLAS with the same threads: %.3f s per step" % (machine["flops_per_image"] / 1e9,
                                                         machine["sgemm_gflops"], floor_step),
        "",
        "| framework | best step s | images/s (best) | median step s | images/s (median) | best / floor "
        "| median / floor | best step of each round, s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for fw in ("torch", "dpcore"):
        lines.append("| %s | %.3f | %.1f | %.3f | %.1f | %.2f | %.2f | %s |" % (
            fw, best[fw]["step"], BATCH / best[fw]["step"], median[fw], BATCH / median[fw],
            best[fw]["step"] / floor_step, median[fw] / floor_step, ", ".join("%.3f" % t for t in rounds[fw])))
    lines += [
        "",
        "**dpcore images/s / PyTorch images/s: %.2f** (best steps; %.2f on the medians of all %d timed steps each; "
        "goal >= 1.0: %s)" % (ratio, ratio_median, len(steps["dpcore"]),
                              "met" if ratio >= 1 and ratio_median >= 1 else
                              "met on the best steps only" if ratio >= 1 else "not met"),
        "",
    ]
    common.publish(lines, SECTION_TITLE, args.write)


if __name__ == "__main__":
    main()
