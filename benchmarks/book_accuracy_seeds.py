"""The book's LeNet experiment (Dive into Deep Learning 12.5: batch 256, lr 0.2,
10 epochs, N(0, 0.01) weights) over several seeds: the spread of the final test
accuracy that tests/test_train.py's threshold must leave room for.

    python benchmarks/book_accuracy_seeds.py [--seeds 0 1 2 ...] [--epochs 10]
    OPENBLAS_CORETYPE=Sandybridge python benchmarks/book_accuracy_seeds.py   # another CPU's rounding

Seed s draws the initial weights (dp.models.LeNet(seed=s)) and the shuffles
(load_fashion_mnist(seed=s)). Prints one line per seed, then the mean, the
sample standard deviation and the minimum.
"""
import argparse
import os
import statistics
import time

import dpcore as dp


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=list(range(8)))
    ap.add_argument("--epochs", type=int, default=10)
    args = ap.parse_args()
    print(f"BLAS: {dp.build_info()['blas_config']}; OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE')}",
          flush=True)
    accs = []
    for s in args.seeds:
        start = time.perf_counter()
        train_iter, test_iter = dp.data.load_fashion_mnist(batch_size=256, seed=s)
        net = dp.models.LeNet(seed=s)
        history = dp.train(net, train_iter, test_iter, num_epochs=args.epochs, lr=0.2, verbose=False)
        accs.append(history.test_acc[-1])
        print(f"seed {s}: test acc {accs[-1]:.4f}, train loss {history.train_loss[-1]:.4f} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
    sd = statistics.stdev(accs) if len(accs) > 1 else float("nan")
    print(f"{len(accs)} seeds: mean {statistics.mean(accs):.4f}, sd {sd:.4f}, min {min(accs):.4f}, "
          f"max {max(accs):.4f}")


if __name__ == "__main__":
    main()
