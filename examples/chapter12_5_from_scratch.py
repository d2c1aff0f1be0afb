"""Chapter 12.5 of Dive into Deep Learning, "Training on Multiple GPUs", from
scratch with dpcore's pieces: the CPU split into logical devices, all_reduce
and scatter demos, then LeNet on Fashion-MNIST with the chapter's own loop
(split_batch, forward/backward on every replica, all_reduce of the gradients,
an SGD step on every replica) and the test accuracy from net.evaluate.

    python examples/chapter12_5_from_scratch.py [--epochs 1] [--batch-size 256] [--lr 0.2]
                                                [--num-devices 2] [--steps N] [--data DIR]

--steps N stops each epoch after N minibatches (a quick check of the loop).
"""
import argparse
import time

import numpy as np

import dpcore as dp


def demos(devices):
    """The chapter's two demos: all-reduce of [[1, 1]] and [[2, 2]], and scatter of a 4x5 array."""
    data = [dp.tensor(np.ones((1, 2)) * (i + 1), device=d) for i, d in enumerate(devices[:2])]
    print("allreduce before:")
    for t in data:
        print("", t)
    dp.all_reduce(data)
    print("allreduce after:")
    for t in data:
        print("", t)

    data = np.arange(20).reshape(4, 5)
    split = dp.scatter(data, devices[:2])
    print("input :", data.tolist())
    print("load into", devices[:2])
    print("output:", split)

    # the chapter's get_params: one copy of the parameters per device
    params = dp.broadcast(np.zeros(3, np.float32), devices)
    print("broadcast:", params)


def train_batch(net, X, y, lr):
    """One step of chapter 12.5's train_batch, over every replica of ``net``."""
    X_shards, y_shards = dp.split_batch(X, y, net.devices)
    loss_sum, correct = 0.0, 0
    for replica, X_shard, y_shard in zip(net.replicas, X_shards, y_shards):
        # gradient of this shard's share of the mean loss of the global batch
        shard_loss, shard_correct = replica.forward_backward(X_shard, y_shard, grad_scale=1 / len(y))
        loss_sum += shard_loss
        correct += shard_correct
    dp.all_reduce([replica.grads for replica in net.replicas])  # every replica: the mean gradient
    for replica in net.replicas:
        replica.sgd_step(lr)
    return loss_sum, correct


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--num-devices", type=int, default=2, help="logical CPU devices (default 2)")
    parser.add_argument("--steps", type=int, default=None, help="stop each epoch after this many minibatches")
    parser.add_argument("--data", default=None, help="Fashion-MNIST directory (default: DPCORE_DATA or Debian's)")
    args = parser.parse_args()

    dp.set_logical_devices("cpu", args.num_devices)
    devices = dp.list_devices()
    print("devices:", devices)
    demos(devices)

    with dp.MirroredStrategy(devices).scope():
        net = dp.models.LeNet()
    train_iter, test_iter = dp.data.load_fashion_mnist(batch_size=args.batch_size, root=args.data)
    epoch_seconds = []
    for epoch in range(args.epochs):
        start = time.perf_counter()
        loss_sum, correct, seen = 0.0, 0, 0
        for step, (X, y) in enumerate(train_iter):
            if args.steps is not None and step >= args.steps:
                break
            batch_loss, batch_correct = train_batch(net, X, y, args.lr)
            loss_sum, correct, seen = loss_sum + batch_loss, correct + batch_correct, seen + len(y)
        epoch_seconds.append(time.perf_counter() - start)
        assert net.replicas_identical(), "the replicas drifted apart"
        print(f"epoch {epoch + 1}/{args.epochs}: loss {loss_sum / max(seen, 1):.3f}, "
              f"train acc {correct / max(seen, 1):.3f}, {seen} samples, {epoch_seconds[-1]:.1f} sec", flush=True)
    metrics = net.evaluate(test_iter)
    per_epoch = sum(epoch_seconds) / len(epoch_seconds) if epoch_seconds else 0.0
    print(f"test acc: {metrics.accuracy:.2f}, {per_epoch:.1f} sec/epoch on {net.devices}")


if __name__ == "__main__":
    main()
