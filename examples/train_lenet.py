"""The main job: train the LeNet of Dive into Deep Learning 12.5 on the real
Fashion-MNIST (batch 256, lr 0.2, 10 epochs) on every local device and print
the book's closing line.

    python examples/train_lenet.py [--epochs 10] [--batch-size 256] [--lr 0.2] [--cpu-devices K] [--gpu-devices K]

MirroredStrategy() takes every GPU, else the logical CPU devices (one by
default: the whole CPU; --cpu-devices K splits it into K replicas).
--gpu-devices K splits each GPU into K logical GPUs (the all-reduce then runs
on dpcore's own kernel: NCCL refuses two ranks on one GPU).
"""
import argparse

import dpcore as dp


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--cpu-devices", type=int, default=1, help="split the CPU into this many replicas")
    parser.add_argument("--gpu-devices", type=int, default=1, help="split each GPU into this many replicas")
    parser.add_argument("--data", default=None, help="Fashion-MNIST directory (default: DPCORE_DATA or Debian's)")
    args = parser.parse_args()

    print("dpcore", dp.__version__, dp.build_info()["summary"])
    dp.set_logical_devices("cpu", args.cpu_devices)
    if args.gpu_devices != 1:
        dp.set_logical_devices("cuda", args.gpu_devices)
    strategy = dp.MirroredStrategy()
    print(f"{strategy.num_replicas_in_sync} replica(s): {strategy.devices}")
    with strategy.scope():
        net = dp.models.LeNet()
    train_iter, test_iter = dp.data.load_fashion_mnist(batch_size=args.batch_size, root=args.data)
    dp.train(net, train_iter, test_iter, num_epochs=args.epochs, lr=args.lr)


if __name__ == "__main__":
    main()
