"""Chapter 12.6 ("Concise Implementation for Multiple GPUs"): ResNet-18 on
Fashion-MNIST, mirrored over every local device.

    python examples/train_resnet.py [--epochs 10] [--batch-size 256] [--lr 0.1] [--sync-batchnorm]
                                    [--cpu-devices K] [--gpu-devices K] [--bucket-mb 25]
    mpirun -np 8 --hostfile hosts python examples/train_resnet.py   # e.g. 2 hosts x 4 GPUs

On GPUs each step's gradients are all-reduced in buckets that overlap the
backward pass (NCCL across GPUs, dpcore's own kernel across logical GPUs), and
the training set is resident on every GPU. On a CPU it trains too, slowly
(about 120 images/s on 2 cores: an epoch takes 8-10 minutes). `make train-resnet`
runs it with the book's settings.
"""
import dpcore as dp
from common import parser, say, set_devices
from common import strategy as make_strategy


def main():
    p = parser(__doc__, lr=0.1)
    p.add_argument("--sync-batchnorm", action="store_true", help="normalise over the global batch")
    p.add_argument("--bucket-mb", type=float, default=25, help="gradient all-reduce bucket size")
    p.add_argument("--init", choices=("d2l", "torch"), default="d2l",
                   help="d2l: the chapter's N(0, 0.01) weights (default); torch: PyTorch's default init")
    args = p.parse_args()
    set_devices(args)
    strategy = make_strategy(bucket_mb=args.bucket_mb)
    with strategy.scope():
        # the chapter's recipe: train() re-draws every conv and dense weight from N(0, 0.01)
        net = dp.models.ResNet18(num_classes=10, in_channels=1, sync_batchnorm=args.sync_batchnorm, init=args.init)
    say(f"{strategy.num_replicas_in_sync} replica(s) in {dp.distributed.world_size()} process(es), rank 0's: "
        f"{strategy.devices}, all-reduce: {net.all_reduce}")
    train_iter, test_iter = dp.data.load_fashion_mnist(batch_size=args.batch_size, root=args.data)
    dp.train(net, train_iter, test_iter, num_epochs=args.epochs, lr=args.lr, checkpoint=args.checkpoint,
             resume=args.checkpoint is not None)


if __name__ == "__main__":
    main()
