"""dpcore's exceptions.

The C core reports failures as status values; the binding turns them into these
(or into the built-in ValueError / TypeError / MemoryError / OSError where one
fits) in exactly one place. Ctrl-C is Python's own KeyboardInterrupt, seen
between steps: each step is one C call.
"""


class DpcoreError(RuntimeError):
    """A failure inside dpcore's core that is not a bad argument."""


class DeviceError(DpcoreError):
    """A device (CUDA runtime, cuDNN, cuBLAS, NCCL) reported an error."""


class DataError(DpcoreError, ValueError):
    """A dataset file or array is malformed; the message names the file and the problem."""


class DistributedError(DpcoreError):
    """Another process of a multi-process job failed to take part: it did not
    arrive within the strategy's timeout (stopped, hung, or running a
    different sequence of steps), disagreed about the model or the data, or
    MPI reported an error. The message names the ranks and the step."""
