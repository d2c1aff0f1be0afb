#!/usr/bin/env python3
"""Render the pictures of the notebook experience (docs/notebooks.md) from a real run:

    docs/progress_bar.png    the text of tqdm's bar as dp.train drew it (the
                             notebook shows the same as a widget)
    docs/live_curves.png     dp.train(..., plot='docs/live_curves.png'): the
                             book's figure as the last epoch left it
    docs/timeline.png        history.timeline.plot(): the step timeline
    docs/scaling_report.png  dp.scaling_report(...).plot()

LeNet on a subset of Fashion-MNIST (--samples, default all 60000) on 2 logical
CPU devices for --epochs (default 5). Run from the repository root:

    .venv/bin/python scripts/render_docs.py
"""
import argparse
import io
import os
import sys

import dpcore as dp
from dpcore import progress

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")


def text_png(lines, path):
    """A PNG of monospace text lines, as a terminal shows them."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 0.32 * len(lines) + 0.2))
    figure.patch.set_facecolor("#1e1e1e")
    for i, line in enumerate(lines):
        figure.text(0.01, 1 - (i + 0.8) / (len(lines) + 0.3), line, family="monospace", fontsize=10, color="#e0e0e0")
    figure.savefig(path, dpi=100, facecolor=figure.get_facecolor())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=60000)
    ap.add_argument("--epochs", type=int, default=5)
    args = ap.parse_args()
    os.makedirs(DOCS, exist_ok=True)
    dp.set_logical_devices("cpu", 2)
    train_iter, test_iter = dp.data.load_fashion_mnist(batch_size=256)
    train_iter = dp.data.from_arrays(train_iter.X[:args.samples], train_iter.y[:args.samples], 256, shuffle=True,
                                     seed=0)
    with dp.MirroredStrategy(["cpu:0", "cpu:1"]).scope():
        net = dp.models.LeNet()
    # the bar as a terminal gets it, captured
    captured, real_stderr, real_check = io.StringIO(), sys.stderr, progress._stderr_is_terminal
    progress._stderr_is_terminal, sys.stderr = (lambda: True), captured
    try:
        history = dp.train(net, train_iter, test_iter, num_epochs=args.epochs, lr=0.2, profile=True,
                           plot=os.path.join(DOCS, "live_curves.png"))
    finally:
        progress._stderr_is_terminal, sys.stderr = real_check, real_stderr
    bars = [part.strip() for part in captured.getvalue().replace("\n", "\r").split("\r") if "epoch" in part]
    finals = [next(b for b in reversed(bars) if b.startswith(f"epoch {e}/")) for e in range(1, args.epochs + 1)]
    text_png(finals, os.path.join(DOCS, "progress_bar.png"))
    history.timeline.plot(steps=3).figure.savefig(os.path.join(DOCS, "timeline.png"), dpi=100)
    report = dp.scaling_report(lambda: dp.models.LeNet(), train_iter, devices=["cpu:0", "cpu:1"], steps=10)
    report.plot().figure.savefig(os.path.join(DOCS, "scaling_report.png"), dpi=100)
    print("wrote", ", ".join(sorted(p for p in os.listdir(DOCS) if p.endswith(".png"))), "in", DOCS)


if __name__ == "__main__":
    main()
