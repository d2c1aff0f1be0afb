"""What the examples share: the book's training options and the devices to mirror over."""
import argparse

import dpcore as dp


def parser(doc, lr):
    """Options: --epochs, --batch-size, --lr, --cpu-devices, --gpu-devices, --data, --precision, --checkpoint."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--cpu-devices", type=int, default=1, help="split the CPU into this many replicas")
    p.add_argument("--gpu-devices", type=int, default=1, help="split each GPU into this many replicas")
    p.add_argument("--data", default=None, help="Fashion-MNIST directory (default: DPCORE_DATA or Debian's)")
    p.add_argument("--precision", choices=dp.config.PRECISIONS, default="float32",
                   help="dp.set_precision: float32 (the default) or fast (larger rounding error)")
    p.add_argument("--checkpoint", default=None,
                   help="save the run after every epoch to this file and resume from it if it exists")
    return p


def set_devices(args):
    """Set the precision and the logical devices the options ask for; print what dpcore was built with."""
    dp.set_precision(args.precision)
    if dp.distributed.rank() == 0:
        print("dpcore", dp.__version__, dp.build_info()["summary"])
    dp.set_logical_devices("cpu", args.cpu_devices)
    if args.gpu_devices != 1:
        dp.set_logical_devices("cuda", args.gpu_devices)


def strategy(**options):
    """MirroredStrategy over this process's devices; under mpirun (more than one
    process) MultiWorkerMirroredStrategy over every process's devices."""
    if dp.distributed.world_size() > 1:
        return dp.MultiWorkerMirroredStrategy(**options)
    return dp.MirroredStrategy(**options)


def say(*what):
    """print, on one process of a job only."""
    if dp.distributed.rank() == 0:
        print(*what, flush=True)
