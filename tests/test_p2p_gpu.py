"""dp.distributed's point to point and collectives on GPU tensors across processes (issue 33),
under mpirun (tests/mpi_p2p.py is what each of the 2 processes runs). The descriptions still
travel over MPI, the bytes of a send / recv by NCCL from GPU to GPU (csrc/dist_nccl.c); the
collectives go through host copies and the rank-ordered MPI path.

Needs a GPU (marked ``gpu``, skipped with the reason without one) and MPI (skipped in a
DPCORE_MPI=0 build, as tests/test_distributed.py's are). NCCL refuses two ranks on one GPU, so
the GPU-to-GPU messages need two GPUs; with one, what runs is every refusal (a GPU tensor against a
host receiver, two processes on the one GPU: DistributedErrors on both ranks, the job going on)
and the collectives. The CPU twins: tests/test_p2p.py's test of the descriptions (the refusals,
the same protocol without a GPU) and tests/c/p2p_order.c (csrc/dist_nccl.c against host fakes of
CUDA and NCCL: the order of a pair's messages, NCCL's non-blocking contract, the deadlines and
aborts; tests/test_sanitizers.py runs it)."""
import numpy as np
import pytest

import dpcore as dp
from test_distributed import mpi_required  # noqa: F401  (the fixture: MPI needed, or skipped in DPCORE_MPI=0 builds)
from test_p2p import expect

BACKEND = dp.build_info().get("cuda_backend")
GPUS = dp._core.runtime_info()["cuda_device_count"] if BACKEND else 0
NO_GPU = "no usable CUDA device: " + (dp._core.runtime_info()["cuda_why"] if BACKEND
                                      else "dpcore was built without the CUDA backend")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS == 0, reason=NO_GPU)]


def test_a_gpu_tensor_to_a_host_receiver_is_an_error_on_both_ranks():
    expect("gpu_host_mismatch", [
        "rank 0: DistributedError rank 0: dp.distributed.send(to rank 1, tag 0): rank 1 expects float32[2, 3] in "
        "host memory, this rank sends float32[2, 3] in GPU memory (tag 0); nothing was sent",
        "rank 1: DistributedError rank 1: dp.distributed.recv(from rank 0, tag 0): rank 0 sends float32[2, 3] in "
        "GPU memory, this rank expects float32[2, 3] in host memory (tag 0); nothing was received",
        "rank 1: after [1.0, 1.0, 1.0, 1.0]"])


def test_two_processes_on_one_gpu_are_refused_on_both_ranks():
    expect("gpu_same_gpu", [
        "rank 0: DistributedError rank 0: dp.distributed.send(to rank 1, tag 0): rank 1 receives into the same "
        "physical GPU (GPU 0 there, GPU 0 here) that this rank sends from; NCCL refuses two ranks on one GPU",
        "rank 1: DistributedError rank 1: dp.distributed.recv(from rank 0, tag 0): rank 0 sends from the same "
        "physical GPU (GPU 0 there, GPU 0 here) that this rank receives into; NCCL refuses two ranks on one GPU",
        "rank 1: after [1.0, 1.0, 1.0, 1.0]"])


def test_collectives_on_gpu_tensors_have_the_rank_ordered_bits():
    expect("gpu_collectives", [line for r in range(2) for line in (
        f"rank {r}: gpu sum Tensor True bits True", f"rank {r}: gpu mean bits True",
        f"rank {r}: gpu broadcast True [1.0, 1.0, 1.0, 1.0]", f"rank {r}: gpu all_gather [[0, 0], [1, 1]]",
        f"rank {r}: DistributedError the processes disagree about dp.distributed.all_reduce's arguments "
        "(collective, dtype, shape, memory, op): rank 1 has ('all_reduce', 'float32', (5, 7), 'host', 'sum'), "
        "rank 0 has ('all_reduce', 'float32', (5, 7), 'GPU', 'sum')",
        f"rank {r}: after [2.0, 2.0]")])


@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs ({GPUS} here): NCCL refuses two ranks on one GPU, and a GPU "
                                     "message between two processes goes from one's GPU to the other's by NCCL")
def test_gpu_messages_arrive_exactly_by_nccl():
    expect("gpu_p2p", [
        "rank 1: gpu float32 exact Tensor True True", "rank 1: gpu int64 exact Tensor True True",
        "rank 1: gpu uint8 exact Tensor True True", "rank 0: gpu exchange True", "rank 1: gpu exchange True",
        "rank 1: gpu in order 0 1 2 3 4", "rank 1: gpu two tags 7 8", "rank 1: gpu 64 MiB exact True",
        "rank 1: gpu empty (0, 3)"], timeout=180)
