"""Where the parts of a strategy that spans the processes of an MPI job live: its
devices named with their ranks ('rank1/cpu:0', as History and the strategies
print them), one list the same on every rank (PipelineStrategy's stages,
ModelParallelStrategy's slices)."""
import re

from . import distributed
from .devices import check_device, list_devices

RANK_DEVICE = re.compile(r"rank(\d+)/(.+)")


def spans_processes(devices):
    """Whether a strategy with these devices puts its parts in several
    processes: no devices under mpirun (a job of more than one process), or
    device names that name their rank ('rank1/cpu:0'). Starts nothing."""
    if devices is None:
        return distributed._launched_size() > 1
    names = [devices] if isinstance(devices, str) else devices
    return isinstance(names, (list, tuple)) and any(isinstance(d, str) and "/" in d for d in names)


def job_devices(who, devices, replicas, timeout):
    """[(rank, device)] of every part of the job (copy by copy: a pipeline's
    stages, a split model's slices), the same on every rank; who names the
    strategy in messages. devices None: one part per rank, on
    ``cuda:{local_rank}`` where the host has GPUs, else ``cpu:0``. A problem
    found on one rank (another list, a device it does not have) is an error on
    every rank, not a wait for the one that gave up."""
    info = distributed._join()
    W, me = info["world_size"], info["rank"]
    if devices is None:
        gpus = [d for d in list_devices() if d.startswith("cuda:")]
        mine, problem = (gpus[info["local_rank"]] if gpus else "cpu:0"), None
        if gpus and info["local_size"] > len(gpus):
            problem = (f"{info['local_size']} processes on its host share {len(gpus)} GPU(s); across processes "
                       "each part needs a GPU of its own: start one process per GPU, or pass "
                       "devices=['rank0/cuda:0', ...]")
        found = distributed.allgather_object((mine, problem), timeout, f"the devices of {who}()")
        _raise_first_problem(who, [p for _, p in found])
        placement = [(q, d) for q, (d, _) in enumerate(found)]
    else:
        names = [devices] if isinstance(devices, str) else list(devices)
        distributed.agree(f"{who}'s devices", [str(d) for d in names], timeout)
        placement = []
        for d in names:
            m = RANK_DEVICE.fullmatch(d) if isinstance(d, str) else None
            if m is None:
                raise ValueError(f"{who}: across processes every device names its rank, as 'rank1/cpu:0'; "
                                 f"got {d!r} in {names}")
            q, dev = int(m.group(1)), m.group(2)
            if q >= W:
                raise ValueError(f"{who}: {d!r} names rank {q}, but this job has {W} process(es) "
                                 f"(ranks 0..{W - 1})")
            placement.append((q, dev if ":" in dev else dev + ":0"))
        if len(set(placement)) != len(placement):
            raise ValueError(f"{who}: devices must name each device once, got {names}")
        # each rank checks its own devices; every rank hears what they found
        problem = None
        for q, dev in placement:
            try:
                if q == me:
                    check_device(dev)
            except (ValueError, TypeError) as e:
                problem = problem or str(e)
        _raise_first_problem(who, distributed.allgather_object(problem, timeout, f"the check of {who}'s devices"))
    if len(placement) % replicas:
        raise ValueError(f"{who}: replicas={replicas} must divide the job's {len(placement)} devices "
                         f"{[f'rank{q}/{d}' for q, d in placement]} (every copy has the same number of parts)")
    return placement


def _raise_first_problem(who, problems):
    """ValueError naming the first rank whose entry (a message, or None) is one."""
    for q, problem in enumerate(problems):
        if problem:
            raise ValueError(f"{who}: rank {q}: {problem}")
