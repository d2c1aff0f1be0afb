"""Chapter 12.6 ("Concise Implementation for Multiple GPUs"): ResNet-18 on
Fashion-MNIST, mirrored over every local device.

    python examples/train_resnet.py [--epochs 10] [--batch-size 256] [--lr 0.1] [--sync-batchnorm]
                                    [--cpu-devices K] [--gpu-devices K] [--bucket-mb 25]

On GPUs each step's gradients are all-reduced in buckets that overlap the
backward pass (NCCL across GPUs, dpcore's own kernel across logical GPUs), and
the training set is resident on every GPU. On a CPU it trains too, slowly
(about 45 images/s on 2 cores: an epoch takes over 20 minutes).
"""
import argparse

import dpcore as dp


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--sync-batchnorm", action="store_true", help="normalise over the global batch")
    parser.add_argument("--cpu-devices", type=int, default=1, help="split the CPU into this many replicas")
    parser.add_argument("--gpu-devices", type=int, default=1, help="split each GPU into this many replicas")
    parser.add_argument("--bucket-mb", type=float, default=25, help="gradient all-reduce bucket size")
    parser.add_argument("--data", default=None, help="Fashion-MNIST directory (default: DPCORE_DATA or Debian's)")
    args = parser.parse_args()

    print("dpcore", dp.__version__, dp.build_info()["summary"])
    dp.set_logical_devices("cpu", args.cpu_devices)
    if args.gpu_devices != 1:
        dp.set_logical_devices("cuda", args.gpu_devices)
    strategy = dp.MirroredStrategy(bucket_mb=args.bucket_mb)
    with strategy.scope():
        net = dp.models.ResNet18(num_classes=10, in_channels=1, sync_batchnorm=args.sync_batchnorm)
    print(f"{strategy.num_replicas_in_sync} replica(s): {strategy.devices}, all-reduce: {net.all_reduce}")
    train_iter, test_iter = dp.data.load_fashion_mnist(batch_size=args.batch_size, root=args.data)
    dp.train(net, train_iter, test_iter, num_epochs=args.epochs, lr=args.lr)


if __name__ == "__main__":
    main()
