"""dp.launch: run a function in several MPI processes from a notebook.

    def work(epochs):
        strategy = dp.MultiWorkerMirroredStrategy()
        with strategy.scope():
            net = dp.models.LeNet()
        train_iter, test_iter = dp.data.load_fashion_mnist(batch_size=256)
        return dp.train(net, train_iter, test_iter, num_epochs=epochs, lr=0.2)

    history = dp.launch(work, num_processes=2, args=(10,))   # rank 0's History

The function and its arguments travel by cloudpickle, so a function defined
in the notebook itself works. Each process runs ``fn(*args, **kwargs)`` under
``mpirun``; the processes' output appears in the notebook as it comes; rank
0's return value comes back. An exception on any rank ends the job (MPI_Abort)
and is raised here as :class:`dpcore.DistributedError` with that rank's
traceback.
"""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

from .errors import DistributedError

__all__ = ["launch"]


def _open_mpi(mpirun):
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "Open MPI" in out or "OpenRTE" in out


def _check_root(mpirun):
    """Open MPI refuses root unless both of its variables are set: say so here,
    with the fix, rather than through mpirun's wall of text. dpcore never sets
    them itself (running MPI as root is the user's call)."""
    if os.geteuid() != 0 or not _open_mpi(mpirun):
        return
    needed = ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")
    if not all(os.environ.get(v) == "1" for v in needed):
        raise DistributedError("dp.launch: Open MPI refuses to run as root unless OMPI_ALLOW_RUN_AS_ROOT=1 and "
                               "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 are set in the environment (Open MPI's rule; set "
                               "them with os.environ if running as root is what you want)")


def _stream(pipe, sink):
    for line in iter(pipe.readline, ""):
        sink.write(line)
        sink.flush()
    pipe.close()


def launch(fn, num_processes=2, args=(), kwargs=None, timeout=None, mpirun="mpirun", mpirun_args=()):
    """Run ``fn(*args, **kwargs)`` in ``num_processes`` MPI processes on this
    machine and return rank 0's result.

    timeout: seconds for the whole job (None: no limit); the job is killed and
    DistributedError raised past it. mpirun_args: more arguments for mpirun
    (e.g. ``['--hostfile', 'hosts']``). With Open MPI, more processes than
    cores are allowed (``--oversubscribe``) and the processes are not bound to
    cores (``--bind-to none``): dpcore sizes its threads for the cores they
    share.
    """
    import cloudpickle

    from . import _check

    fn = _check.function("fn", fn)
    num_processes = _check.integer("num_processes", num_processes, 1, 4096)
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple, got {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"kwargs must be a dict, got {type(kwargs).__name__}")
    if timeout is not None:
        timeout = _check.real("timeout", timeout, 0.0, exclusive_minimum=True)
    if isinstance(mpirun_args, str):
        raise TypeError("mpirun_args must be a list of strings, e.g. ['--hostfile', 'hosts']")
    path = shutil.which(mpirun)
    if path is None:
        raise DistributedError(f"dp.launch needs {mpirun!r} on PATH (Debian: apt-get install openmpi-bin)")
    _check_root(path)
    from . import info

    if not info.build_flags().get("mpi_linked"):
        raise DistributedError("dp.launch: dpcore was built without MPI (" + str(info.build_flags().get("mpi_why"))
                               + "); install libopenmpi-dev and reinstall dpcore")
    with tempfile.TemporaryDirectory(prefix="dpcore-launch-") as work:
        payload = os.path.join(work, "fn.pkl")
        with open(payload, "wb") as f:
            cloudpickle.dump((fn, tuple(args), dict(kwargs or {})), f)
        cmd = [path, "-np", str(num_processes)]
        if _open_mpi(path):
            cmd += ["--oversubscribe", "--bind-to", "none"]
        cmd += list(mpirun_args) + [sys.executable, "-m", "dpcore._launch_worker", payload, work]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        readers = [threading.Thread(target=_stream, args=(proc.stdout, sys.stdout), daemon=True),
                   threading.Thread(target=_stream, args=(proc.stderr, sys.stderr), daemon=True)]
        for t in readers:
            t.start()
        try:
            rc = proc.wait(timeout=timeout)
        except BaseException:
            # a timeout or Ctrl-C in the notebook: the whole job goes
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            if sys.exc_info()[0] is subprocess.TimeoutExpired:
                raise DistributedError(f"dp.launch: the job did not finish within {timeout} s and was killed") \
                    from None
            raise
        finally:
            for t in readers:
                t.join(timeout=5)
        errors = sorted(e for e in os.listdir(work) if e.startswith("error-"))
        if errors:
            with open(os.path.join(work, errors[0])) as f:
                text = f.read()
            rank = errors[0][len("error-"):-len(".txt")]
            raise DistributedError(f"dp.launch: rank {rank} raised an exception, which ended the job:\n{text}")
        result = os.path.join(work, "result.pkl")
        if rc != 0 or not os.path.exists(result):
            raise DistributedError(f"dp.launch: mpirun exited with status {rc} without a result from rank 0 "
                                   "(a process was killed or ended early; its output is above)")
        with open(result, "rb") as f:
            return cloudpickle.load(f)
