"""The PyTorch distributed tutorial's two-layer network split over two processes with send / recv:
rank 0 holds the first layer (Linear 10 -> 10, ReLU), rank 1 the second (Linear 10 -> 5) and the
loss. Each step rank 0 sends its activations forward and rank 1 sends their gradient back.

    mpirun -np 2 python examples/two_process_split.py     # split over two processes (make two-process-split)
    python examples/two_process_split.py                  # the same network in one process

Both print every step's loss and the final weights' digest: the same numbers to the bit, since
each process runs the same float32 operations on the same inputs as the single process does.
"""
import argparse
import hashlib

import numpy as np

import dpcore as dp
from dpcore import distributed as dist
from dpcore import ops


def init(seed=0):
    rng = np.random.default_rng(seed)
    def u(shape, fan):
        return rng.uniform(-fan ** -0.5, fan ** -0.5, shape).astype(np.float32)
    return {"W1": u((10, 10), 10), "b1": u(10, 10), "W2": u((5, 10), 10), "b2": u(5, 10)}


TEACHER = np.random.default_rng(7).standard_normal((5, 10))


def data(step, n=20):
    """A batch whose label is the argmax of a fixed linear map of the input: learnable."""
    X = np.random.default_rng(1000 + step).standard_normal((n, 10)).astype(np.float32)
    return X, (X @ TEACHER.T).argmax(axis=1)


def digest(P, names):
    h = hashlib.sha256()
    for k in names:
        h.update(P[k].tobytes())
    return h.hexdigest()[:16]


def first_forward(P, X):
    return ops.relu(ops.dense(X, P["W1"], P["b1"]))


def first_backward(P, V, X, h, dh, lr):
    _, dW1, db1 = ops.dense_backward(X, P["W1"], ops.relu_backward(h, dh))
    ops.sgd_update(P["W1"], dW1, V["W1"], lr, momentum=0.9)
    ops.sgd_update(P["b1"], db1, V["b1"], lr, momentum=0.9)


def second(P, V, h, y, lr):
    """The second layer's forward, the loss and its backward: (loss, dh)."""
    loss, _, dlogits = ops.softmax_cross_entropy(ops.dense(h, P["W2"], P["b2"]), y)
    dh, dW2, db2 = ops.dense_backward(h, P["W2"], dlogits)
    ops.sgd_update(P["W2"], dW2, V["W2"], lr, momentum=0.9)
    ops.sgd_update(P["b2"], db2, V["b2"], lr, momentum=0.9)
    return loss, dh


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--lr", type=float, default=0.1)
    args = ap.parse_args()
    P = init()
    V = {k: np.zeros_like(v) for k, v in P.items()}
    size, rank = dist.world_size(), dist.rank()
    if size not in (1, 2):
        raise SystemExit(f"two_process_split: run it in 1 or 2 processes, not {size}")
    for step in range(args.steps):
        X, y = data(step)
        if size == 1:
            h = first_forward(P, X)
            loss, dh = second(P, V, h, y, args.lr)
            first_backward(P, V, X, h, dh, args.lr)
        elif rank == 0:
            h = first_forward(P, X)
            dist.send(h, 1)
            first_backward(P, V, X, h, dist.recv(h.shape, 1), args.lr)
        else:
            h = dist.recv((len(X), 10), 0)
            loss, dh = second(P, V, h, y, args.lr)
            dist.send(dh, 0)
        if size == 1 or rank == 1:
            print(f"step {step + 1}: loss {loss:.9g}", flush=True)
    if size == 1 or rank == 0:
        print(f"layer 1 digest {digest(P, ['W1', 'b1'])}", flush=True)
    if size == 1 or rank == 1:
        print(f"layer 2 digest {digest(P, ['W2', 'b2'])}", flush=True)


if __name__ == "__main__":
    main()
