"""The main job: train the LeNet of Dive into Deep Learning 12.5 on the real
Fashion-MNIST (batch 256, lr 0.2, 10 epochs) on every local device and print
the book's closing line.

    python examples/train_lenet.py [--epochs 10] [--batch-size 256] [--lr 0.2] [--cpu-devices K] [--gpu-devices K]
    mpirun -np 2 python examples/train_lenet.py      # 2 processes (make train-mpi NP=2)

MirroredStrategy() takes every GPU, else the logical CPU devices (one by
default: the whole CPU; --cpu-devices K splits it into K replicas).
--gpu-devices K splits each GPU into K logical GPUs (the all-reduce then runs
on dpcore's own kernel: NCCL refuses two ranks on one GPU). Under mpirun each
process mirrors over its own devices (MultiWorkerMirroredStrategy) and the
job trains as one process with all their replicas would.
"""
import dpcore as dp
from common import parser, say, set_devices
from common import strategy as make_strategy


def main():
    args = parser(__doc__, lr=0.2).parse_args()
    set_devices(args)
    strategy = make_strategy()
    say(f"{strategy.num_replicas_in_sync} replica(s) in {dp.distributed.world_size()} process(es); "
        f"rank 0's: {strategy.devices}")
    with strategy.scope():
        net = dp.models.LeNet()
    train_iter, test_iter = dp.data.load_fashion_mnist(batch_size=args.batch_size, root=args.data)
    dp.train(net, train_iter, test_iter, num_epochs=args.epochs, lr=args.lr, checkpoint=args.checkpoint,
             resume=args.checkpoint is not None)


if __name__ == "__main__":
    main()
