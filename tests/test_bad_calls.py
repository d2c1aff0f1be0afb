"""Every bad argument a clear message (issue 11).

A table of bad calls to the public API, each with the exception it must
raise (TypeError for the wrong kind of value, ValueError for a value out of
range) and the argument its message must name; and a table of good calls that
must succeed (NumPy scalars where numbers go, a single device name, ...).

Each snippet runs in a worker subprocess, so that a crash (a segfault, an
abort, libgomp ending the process) fails that row, naming the signal, instead
of the test run: the worker is started again for the next row. One worker
serves the rows in turn; the whole file takes a few seconds.
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading

import pytest

from dpcore import DataError

# the names every snippet may use; made once per worker
PRELUDE = textwrap.dedent("""
    import math
    import numpy as np
    import dpcore as dp
    X = np.zeros((4, 1, 28, 28), np.float32)
    y = np.array([0, 1, 2, 3])
    net = dp.models.LeNet(threads=1)
    rep = net.replicas[0]
    it = dp.data.from_arrays(X, y, 2)
    t = dp.tensor(np.ones(3))
    x4 = np.ones((1, 1, 8, 8), np.float32)
    w4 = np.ones((2, 1, 3, 3), np.float32)
    W = net.get_weights()
    def far(value):  # the weights with one tensor set to value
        w = dict(W)
        w['0.weight'] = np.full(W['0.weight'].shape, value)
        return w
    small = [('flatten',), ('dense', 10)]
    sgd = (np.zeros(4, np.float32), np.zeros(4, np.float32), np.zeros(4, np.float32))
""")

# reads one JSON snippet per line, answers one JSON line: {"ok": true} or
# {"type": ..., "message": ...}; the snippet's own prints go to stderr
WORKER = textwrap.dedent("""
    import json, os, sys
    answers = os.fdopen(os.dup(1), "w")
    sys.stdout = sys.stderr
    names = {}
    exec(compile(sys.argv[1], "<prelude>", "exec"), names)
    answers.write("ready\\n"); answers.flush()
    for line in sys.stdin:
        code = json.loads(line)
        scope = dict(names)
        try:
            exec(compile(code, "<snippet>", "exec"), scope)
            answer = {"ok": True}
        except BaseException as e:
            answer = {"ok": False, "type": type(e).__name__, "message": str(e)}
        answers.write(json.dumps(answer) + "\\n"); answers.flush()
""")

ROW_TIMEOUT = 60  # seconds for one snippet (a hang fails the row)


class Worker:
    """The subprocess that runs snippets; started again after a crash."""

    def __init__(self):
        self.proc = None
        self.log = tempfile.TemporaryFile()

    def _start(self):
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        self.log.seek(0)
        self.log.truncate()
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, PRELUDE], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        line = self._read_line()
        if line != "ready\n":
            raise RuntimeError("the worker did not start: " + (self._death() if self.proc else "it hung"))

    def _read_line(self):
        out = []
        reader = threading.Thread(target=lambda: out.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(ROW_TIMEOUT)
        if reader.is_alive():  # a hang: the next row gets a new worker
            self.proc.kill()
            self.proc.wait()
            self.proc = None
            return None
        return out[0]

    def _death(self):
        rc = self.proc.wait()
        why = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc}"
        self.log.seek(0)
        tail = self.log.read().decode(errors="replace").strip().splitlines()[-5:]
        self.proc = None
        return f"the worker died ({why}): " + " | ".join(tail)

    def run(self, code):
        """{'ok': True}, {'ok': False, 'type', 'message'}, or {'crash': why}."""
        if self.proc is None:
            self._start()
        try:
            self.proc.stdin.write(json.dumps(code) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            return {"crash": self._death()}
        line = self._read_line()
        if not line:
            return {"crash": self._death() if line is not None else f"no answer within {ROW_TIMEOUT} s"}
        return json.loads(line)

    def close(self):
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    yield w
    w.close()


T, V = TypeError, ValueError


def family(template, arg, cases):
    """Rows template.format(v) for each (value text, exception type)."""
    return [(template.format(v), kind, arg) for v, kind in cases]


# bad values of an int argument, of a real one, of a flag
NOT_INTS = [("True", T), ("1.5", T), ("'3'", T), ("np.float64(2.0)", T), ("[1]", T)]
NOT_REALS = [("'0.1'", T), ("True", T), ("[0.1]", T), ("1j", T), ("np.bool_(True)", T)]
NOT_FINITE = [("float('nan')", V), ("float('inf')", V), ("-math.inf", V)]
NOT_BOOLS = [("1", T), ("'yes'", T), ("np.bool_(True)", T), ("0.0", T)]

BAD = [
    # ---- the examples, as reported ----
    ("net = dp.models.LeNet(threads=100000); net.train_step(X, y, 0.1)", V, "threads"),
    ("net = dp.models.LeNet(threads=50000); net.train_step(X, y, 0.1)", V, "threads"),
    ("dp.models.LeNet().predict(X, batch_size=0)", V, "batch_size"),
    ("dp.models.LeNet(devices=[])", V, "devices"),
    ("dp.ops.conv2d(x4, w4, stride=2**40)", V, "stride"),
    ("dp.train(net, None)", T, "train_iter"),
    ("rep.forward_backward(X, y, grad_scale=float('nan'))", V, "grad_scale"),
    ("rep.sgd_step(float('inf'))", V, "lr"),
    ("net.set_weights(far(1e300))", V, "weights"),
    # ---- models ----
    *family("dp.models.LeNet(num_classes={})", "num_classes",
            NOT_INTS + [("None", T), ("0", V), ("-3", V), ("65537", V), ("2**64", V)]),
    *family("dp.models.LeNet(in_channels={})", "in_channels", [("True", T), ("1.5", T), ("0", V), ("65537", V)]),
    *family("dp.models.LeNet(seed={})", "seed", [("-1", V), ("1.5", T), ("'0'", T), ("True", T)]),
    *family("dp.models.LeNet(threads={})", "threads",
            [("257", V), ("-1", V), ("2**40", V), ("1.0", T), ("True", T), ("'2'", T), ("None", T)]),
    *family("dp.models.ResNet18(input_size={})", "input_size", [("0", V), ("'28'", T), ("2.5", T)]),
    ("dp.models.ResNet18(num_classes=0)", V, "num_classes"),
    ("dp.models.ResNet18(sync_batchnorm=1)", T, "sync_batchnorm"),
    *family("dp.models.LeNet(devices={})", "devices",
            [("'cpu:7'", V), ("5", T), ("[5]", T), ("['cpu:0', 'cpu:0']", V), ("['gpu:0']", V),
             ("['cpu:0'] * 65", V), ("{'cpu:0'}", T), ("('cpu:0', None)", T), ("''", V)]),
    *family("dp.models.LeNet(all_reduce={})", "all_reduce", [("'ring'", V), ("3", T)]),
    *family("dp.models.LeNet(bucket_mb={})", "bucket_mb",
            [("-1", V), ("float('nan')", V), ("'25'", T), ("True", T), ("2**50", V)]),
    *family("dp.models.Sequential({})", "layers",
            [("None", T), ("5", T), ("[]", V), ("[5]", T), ("[('conv3d', 1)]", V), ("[(3,)]", T), ("[()]", T),
             ("'dense'", T)]),
    *family("dp.models.Sequential(small, input_shape={})", "input_shape",
            [("None", T), ("(1, 28)", V), ("(0, 28, 28)", V), ("(1, 28, 28.0)", T), ("'abc'", T),
             ("(65537, 1, 1)", V), ("(1, -5, 28)", V), ("(True, 28, 28)", T)]),
    *family("dp.models.Sequential(small, init={})", "init", [("'xavier'", V), ("3", T)]),
    *family("dp.models.Sequential(small, init_std={})", "init_std", [("-1", V), ("float('nan')", V), ("'a'", T)]),
    ("dp.models.Sequential(small, names=[1, 2])", T, "names"),
    ("dp.models.Sequential(small, names=['a'])", V, "names"),
    ("dp.models.Sequential(small, sources=5)", T, "sources"),
    ("dp.models.Sequential(small, sources=[None])", V, "sources"),
    ("dp.models.Sequential(small, sync_batchnorm='no')", T, "sync_batchnorm"),
    # layer arguments: checked by the C core, which names the layer and the argument
    *family("dp.models.Sequential([('flatten',), ('dense', {})])", "out_features",
            [("0", V), ("65537", V), ("True", T), ("2**70", V)]),
    *[(f"dp.models.Sequential([{spec}, ('flatten',), ('dense', 2)])", kind, arg) for spec, kind, arg in [
        ("('conv2d', 65537, 1, 1, 0)", V, "out_channels"), ("('conv2d', 4, 3, 2**40, 0)", V, "stride"),
        ("('conv2d', 4, 3, 1, -1)", V, "padding"), ("('maxpool', 2, 2.0, 0)", T, "stride"),
        ("('batchnorm', 'x')", T, "eps"), ("('batchnorm', 1e-5, 2.0)", V, "momentum"),
        ("('batchnorm', float('nan'))", V, "eps")]],
    # predict / evaluate / train_step / set_weights / save / load
    *family("net.predict(X, batch_size={})", "batch_size",
            NOT_INTS + [("0", V), ("-1", V), ("None", T), ("2**31", V), ("np.float32(4)", T)]),
    *family("net.predict({})", "X", [("None", T), ("'abc'", T), ("np.zeros((4, 3, 28, 28))", V),
                                      ("np.zeros((4, 1, 28, 28), bool)", T), ("np.zeros((4, 1, 28, 28), np.int32)", T),
                                      ("np.full((1, 1, 28, 28), 1e300)", V), ("[[1], [1, 2]]", V)]),
    *family("net.evaluate({})", "data_iter",
            [("None", T), ("X", T), ("5", T), ("[]", V), ("[X]", T), ("[(X, y.astype(float))]", T),
             ("[(X, y[:3])]", V)]),
    *family("net.train_step(X, y, lr={})", "lr",
            NOT_REALS + NOT_FINITE + [("-1", V), ("None", T), ("1e300", V)]),
    *family("net.train_step(X, y, 0.1, momentum={})", "momentum", [("2.0", V), ("-0.1", V), ("float('nan')", V),
                                                                  ("'0.9'", T)]),
    *family("net.train_step(X, y, 0.1, weight_decay={})", "weight_decay", [("-1", V), ("float('inf')", V),
                                                                          ("'0'", T)]),
    *family("net.train_step({}, y, 0.1)", "X", [("None", T), ("'abc'", T), ("np.zeros((4, 3, 28, 28))", V),
                                                ("np.zeros((4, 1, 28, 28), bool)", T)]),
    *family("net.train_step(X, {}, 0.1)", "y", [("y[:3]", V), ("y.astype(float)", T), ("None", T),
                                                ("'abcd'", T)]),
    *family("rep.forward_backward(X, y, grad_scale={})", "grad_scale",
            NOT_REALS + NOT_FINITE + [("1e300", V), ("None", T)]),
    *family("rep.sgd_step({})", "lr", NOT_REALS + NOT_FINITE + [("-1", V), ("None", T), ("1e39", V)]),
    ("rep.sgd_step(0.1, momentum=5)", V, "momentum"),
    ("rep.sgd_step(0.1, weight_decay=float('nan'))", V, "weight_decay"),
    *family("net.set_weights({})", "weights",
            [("None", T), ("5", T), ("'abc'", T), ("{}", KeyError), ("far(-1e39)", V), ("far('x')", T),
             ("{**W, '0.weight': np.zeros(3)}", V), ("list(W.values())[:3]", V), ("far(None)", T)]),
    *family("net.save({})", "path", [("None", T), ("5", T), ("''", V)]),
    *family("dp.models.load({})", "path", [("None", T), ("3.5", T), ("''", V)]),
    ("dp.models.load('x.safetensors', devices=[])", V, "devices"),
    ("dp.models.load('x.safetensors', devices=['cpu:5'])", V, "devices"),
    ("dp.models.load('x.safetensors', allow_nonfinite=1)", T, "allow_nonfinite"),
    # a checkpoint whose 'dpcore' metadata is a JSON list: the file is blamed, not a crash
    ("import json, os, struct, tempfile; p = os.path.join(tempfile.mkdtemp(), 'm.safetensors');"
     " h = json.dumps({'__metadata__': {'dpcore': '[1]'}}).encode();"
     " open(p, 'wb').write(struct.pack('<Q', len(h)) + h); dp.models.load(p)", DataError, "metadata"),
    ("net.make_resident(None, y)", T, "X"),
    ("net.train_step_rows(None, [0], 0.1)", T, "residents"),
    ("net.train_step_rows(net.make_resident(X, y), [0.5], 0.1)", T, "rows"),
    ("net.train_step_rows(net.make_resident(X, y), [0], float('nan'))", V, "lr"),
    # ---- dp.train ----
    *family("dp.train(net, it, num_epochs={}, verbose=False)", "num_epochs",
            NOT_INTS + [("-1", V), ("None", T)]),
    *family("dp.train(net, it, lr={}, verbose=False)", "lr",
            NOT_REALS + NOT_FINITE + [("0", V), ("-0.1", V), ("None", T), ("1e39", V)]),
    *family("dp.train(net, it, momentum={}, verbose=False)", "momentum",
            [("-0.5", V), ("1.5", V), ("float('nan')", V), ("'0.9'", T), ("True", T)]),
    *family("dp.train(net, it, weight_decay={}, verbose=False)", "weight_decay",
            [("-1", V), ("float('inf')", V), ("'0'", T)]),
    *family("dp.train(net, it, verbose={})", "verbose", NOT_BOOLS + [("None", T)]),
    *family("dp.train(net, it, resident={}, verbose=False)", "resident", [("1", T), ("'no'", T)]),
    *family("dp.train(net, it, check_numerics={}, verbose=False)", "check_numerics", [("1", T), ("None", T)]),
    *family("dp.train({}, it)", "net", [("None", T), ("5", T), ("'LeNet'", T)]),
    *family("dp.train(net, {})", "train_iter", [("5", T), ("X", T), ("'abc'", T), ("[]", V)]),
    ("dp.train(net, it, test_iter=5, verbose=False)", T, "test_iter"),
    # ---- dp.ops ----
    *family("dp.ops.conv2d(x4, w4, stride={})", "stride",
            NOT_INTS + [("0", V), ("-1", V), ("None", T), ("2**31", V), ("2**70", V)]),
    *family("dp.ops.conv2d(x4, w4, padding={})", "padding", [("-1", V), ("2**31", V), ("0.5", T), ("True", T)]),
    *family("dp.ops.conv2d({}, w4)", "x", [("None", T), ("'abc'", T), ("x4.astype(bool)", T),
                                           ("x4.astype(complex)", T), ("[[1], [1, 2]]", V)]),
    *family("dp.ops.conv2d(x4, {})", "w", [("None", T), ("[[1, 2], [3]]", V), ("np.full((2, 1, 3, 3), 1e300)", V)]),
    ("dp.ops.conv2d(x4, w4, b='b')", T, "b"),
    ("dp.ops.conv2d_backward(x4, w4, np.ones((1, 2, 6, 6)), stride=0)", V, "stride"),
    ("dp.ops.conv2d_backward(x4, w4, None)", T, "dy"),
    ("dp.ops.dense(None, np.ones((2, 3)))", T, "x"),
    ("dp.ops.dense(np.ones((1, 3)), 'w')", T, "w"),
    ("dp.ops.dense_backward(np.ones((1, 3)), np.ones((2, 3)), 'dy')", T, "dy"),
    ("dp.ops.relu(None)", T, "x"),
    ("dp.ops.relu(np.array([1j]))", T, "x"),
    ("dp.ops.relu_backward(None, np.ones(3))", T, "y"),
    *family("dp.ops.avg_pool2d(x4, {})", "kernel_size", [("0", V), ("2.0", T), ("2**40", V), ("None", T)]),
    ("dp.ops.avg_pool2d(x4, 2, stride=0)", V, "stride"),
    ("dp.ops.avg_pool2d(x4, 2, padding=-1)", V, "padding"),
    ("dp.ops.avg_pool2d_backward(x4, x4, 2, padding='1')", T, "padding"),
    ("dp.ops.max_pool2d(x4, True)", T, "kernel_size"),
    ("dp.ops.max_pool2d_backward(x4, x4, 2, stride='2')", T, "stride"),
    *family("dp.ops.softmax_cross_entropy(np.ones((2, 3)), [0, 1], reduction={})", "reduction",
            [("'avg'", V), ("None", T)]),
    ("dp.ops.softmax_cross_entropy(np.ones((2, 3)), [0.5, 1.0])", T, "labels"),
    ("dp.ops.softmax_cross_entropy(None, [0, 1])", T, "logits"),
    *family("dp.ops.sgd_update(*sgd, lr={})", "lr", NOT_FINITE + [("'x'", T), ("1e39", V), ("-1", V)]),
    ("dp.ops.sgd_update(*sgd, lr=0.1, momentum=2)", V, "momentum"),
    ("dp.ops.sgd_update(*sgd, lr=0.1, weight_decay=-1)", V, "weight_decay"),
    ("dp.ops.sgd_update([0.0], sgd[1], sgd[2], 0.1)", T, "w"),
    # ---- dp.parallel ----
    *family("dp.tensor(np.ones(3), device={})", "device", [("'gpu:9'", V), ("0", T), ("None", T), ("'cpu:3'", V)]),
    *family("dp.tensor({})", "data", [("None", T), ("'abc'", T), ("np.array([1e300])", V), ("[True]", T),
                                      ("[[1], [1, 2]]", V)]),
    *family("dp.scatter(np.ones(4), {})", "devices", [("[]", V), ("5", T), ("['cpu:0', 'cpu:0']", V), ("[None]", T)]),
    ("dp.scatter(5.0, ['cpu:0'])", V, "data"),
    ("dp.scatter(None, 'cpu:0')", T, "data"),
    ("dp.broadcast(t, [])", V, "devices"),
    ("dp.broadcast(t, 3)", T, "devices"),
    ("dp.broadcast(None, ['cpu:0'])", T, "t"),
    ("dp.split_batch(X, y[:3], ['cpu:0'])", V, "X"),
    ("dp.split_batch(X, y.astype(float), ['cpu:0'])", T, "y"),
    ("dp.split_batch(X, y, 'tpu')", V, "devices"),
    ("dp.gather([], 'cpu:0')", V, "tensors"),
    ("dp.gather(5, 'cpu:0')", T, "tensors"),
    ("dp.gather([t], 'cpu:9')", V, "device"),
    ("dp.gather([t], None)", T, "device"),
    ("dp.gather([None], 'cpu:0')", T, "tensors[0]"),
    ("dp.all_reduce([t], op='max')", V, "op"),
    ("dp.all_reduce([t], op=None)", T, "op"),
    ("dp.all_reduce(5)", T, "tensors"),
    ("dp.all_reduce([np.ones(3)])", T, "tensors[0]"),
    # ---- strategies, devices, settings ----
    *family("dp.MirroredStrategy(devices={})", "devices", [("[]", V), ("5", T), ("['tpu:0']", V), ("'cpu:4'", V)]),
    *family("dp.MirroredStrategy(all_reduce={})", "all_reduce", [("'x'", V), ("None", T)]),
    *family("dp.MirroredStrategy(bucket_mb={})", "bucket_mb", [("-1", V), ("'1'", T), ("float('nan')", V)]),
    *family("dp.MultiWorkerMirroredStrategy(timeout={})", "timeout",
            [("-1", V), ("'5'", T), ("0", V), ("float('inf')", V)]),
    *family("dp.set_logical_devices({}, 2)", "kind", [("'tpu'", V), ("None", T), ("2", T)]),
    *family("dp.set_logical_devices('cpu', {})", "count",
            NOT_INTS + [("0", V), ("65", V), ("2**70", V), ("-1", V), ("None", T)]),
    *family("dp.set_deterministic({})", "flag", NOT_BOOLS + [("None", T)]),
    *family("dp.set_allow_tf32({})", "flag", NOT_BOOLS + [("None", T)]),
    # ---- dp.launch, dp.distributed ----
    ("dp.launch(5)", T, "fn"),
    *family("dp.launch(print, num_processes={})", "num_processes", [("0", V), ("1.5", T), ("True", T), ("None", T)]),
    ("dp.launch(print, args=5)", T, "args"),
    ("dp.launch(print, kwargs=[])", T, "kwargs"),
    *family("dp.launch(print, timeout={})", "timeout", [("-1", V), ("float('nan')", V), ("'1'", T)]),
    ("dp.launch(print, mpirun=5)", T, "mpirun"),
    ("dp.launch(print, mpirun_args='--x')", T, "mpirun_args"),
    ("dp.launch(print, mpirun_args=[1])", T, "mpirun_args"),
    *family("dp.distributed.barrier(timeout={})", "timeout",
            [("-1", V), ("'1'", T), ("float('nan')", V), ("float('inf')", V), ("True", T)]),
    ("dp.distributed.barrier(what=5)", T, "what"),
    ("dp.distributed.allgather_object(1, timeout=0)", V, "timeout"),
    *family("dp.distributed.broadcast_object(1, root={})", "root",
            [("1", V), ("-1", V), ("'0'", T), ("1.0", T), ("True", T)]),
    # ---- dp.data ----
    *family("dp.data.from_arrays(X, y, {})", "batch_size",
            NOT_INTS + [("0", V), ("-2", V), ("None", T), ("2**40", V)]),
    *family("dp.data.from_arrays(X, y, 2, seed={})", "seed", [("-1", V), ("0.5", T), ("'1'", T)]),
    *family("dp.data.from_arrays(X, y, 2, shuffle={})", "shuffle", [("1", T), ("'yes'", T), ("None", T)]),
    *family("dp.data.from_arrays(X, y, 2, drop_last={})", "drop_last", [("0", T), ("np.bool_(True)", T)]),
    *family("dp.data.load_fashion_mnist({})", "batch_size", [("0", V), ("'256'", T), ("None", T), ("True", T)]),
    ("dp.data.load_fashion_mnist(8, seed=-1)", V, "seed"),
    ("dp.data.load_fashion_mnist(8, root=5)", T, "root"),
    ("dp.data.ArrayIterator(X, y, 0)", V, "batch_size"),
    ("dp.data.read_idx(5)", T, "path"),
    ("dp.data.read_idx('x', max_bytes=-1)", V, "max_bytes"),
    ("dp.data.read_idx('x', max_bytes='1')", T, "max_bytes"),
    # ---- the C core beneath: the same limits, never a crash ----
    *family("dp._core.Model((1, 28, 28), small, threads={})", "threads",
            [("100000", V), ("2**40", V), ("2**70", V), ("-1", V), ("1.5", T), ("257", V)]),
    ("net._model.sgd_step(float('nan'))", V, "lr"),
    ("net._model.sgd_step(1e300)", V, "lr"),
    ("net._model.sgd_step(0.1, 1.5)", V, "momentum"),
    ("net._model.sgd_step(0.1, 0.0, -1.0)", V, "weight_decay"),
    ("net._model.forward_backward(X, y, 1e300)", V, "grad_scale"),
    ("net._model.forward_backward(X, y, float('inf'))", V, "grad_scale"),
    ("net._model.train_step(X, y, 0.1, 5.0)", V, "momentum"),
    ("net._model.train_step(X, y, float('nan'))", V, "lr"),
    ("dp._core.sgd_update(*sgd, float('nan'), 0.0, 0.0)", V, "lr"),
    ("dp._core.set_logical_devices('cpu', 2**70)", V, "count"),
    ("dp._core.conv2d_forward(x4, w4, None, 2**40, 0)", V, "stride"),
    ("dp._core.conv2d_forward(x4, w4, None, True, 0)", T, "stride"),
    ("dp._core.Model((65537, 1, 1), small)", V, "channels"),
    ("dp._core.Model((1, 28, 28), small, device_index=2**40)", V, "device_index"),
    ("dp._core.Model((1, 28, 28), small, gpu=2**33)", V, "gpu"),
    ("dp._core.all_reduce([t], 2**70)", V, "op"),
    ("dp.checkpoint.save(None, 'x.safetensors')", T, "net"),
    ("dp._core.shard_ranges(2**70, 2)", V, "n"),
    ("dp._core.shard_ranges(4, 2**40)", V, "k"),
    ("dp._core.Mirrored([net._model], bucket_bytes=2**70)", V, "bucket_bytes"),
    ("dp._core.allreduce_benchmark(2, 4, 2**40)", V, "iters"),
    ("dp.checkpoint.read(None)", T, "path"),
]

GOOD = [
    "dp.models.LeNet(devices='cpu:0', threads=1)",
    "dp.models.LeNet(devices=('cpu',), threads=1)",
    "dp.models.LeNet(num_classes=np.int64(5), in_channels=np.int32(1), seed=np.uint8(3), threads=np.int16(1))",
    "dp.models.LeNet(threads=np.array(1), bucket_mb=np.float32(1.5))",
    "dp.models.Sequential(small, input_shape=(np.int64(1), 28, 28), init_std=np.float32(0.1), seed=np.int64(0))",
    "dp.models.Sequential(small, input_shape=[1, 28, 28], init='torch', sync_batchnorm=False)",
    "dp.train(net, it, num_epochs=np.int64(1), lr=np.float32(0.1), verbose=False)",
    "dp.train(net, it, num_epochs=1, lr=np.float64(0.1), momentum=np.float32(0.9), weight_decay=np.float16(0),"
    " verbose=False)",
    "dp.train(net, it, test_iter=it, num_epochs=1, lr=np.array(0.05), verbose=False, resident=False)",
    "assert net.predict(X, batch_size=np.int64(3)).shape == (4, 10)",
    "assert len(dp.data.from_arrays(X, y, np.int16(2), shuffle=True, seed=np.int64(1))) == 2",
    "net.train_step(X, y, np.float32(0.05), momentum=np.float64(0.5), weight_decay=np.int64(0))",
    "rep.forward_backward(X, y, np.float32(0.25)); rep.sgd_step(np.float64(0.1))",
    "assert dp.ops.conv2d(x4, w4, stride=np.int64(2), padding=np.uint8(1)).shape == (1, 2, 4, 4)",
    "assert dp.ops.avg_pool2d(x4, np.int8(2)).shape == (1, 1, 4, 4)",
    "dp.ops.sgd_update(*sgd, lr=np.float32(0.1), momentum=np.float64(0.9))",
    "dp.set_logical_devices('cpu', np.int64(2)); assert len(dp.list_devices()) >= 2;"
    " dp.set_logical_devices('cpu', 1)",
    "assert dp.MirroredStrategy(devices='cpu:0').devices == ['cpu:0']",
    "assert dp.MirroredStrategy(devices=['cpu'], bucket_mb=np.float32(1.5)).bucket_mb == 1.5",
    "assert len(dp.scatter(np.ones(4), 'cpu:0')) == 1",
    "assert dp.tensor(np.ones(3), device='cpu').device == 'cpu:0'",
    "assert dp.broadcast(t, 'cpu:0')[0].device == 'cpu:0'",
    "net.set_weights(net.get_weights()); net.set_weights({k: v.astype(np.float64) for k, v in W.items()})",
    "dp.distributed.barrier(timeout=np.float32(5))",
    "assert dp.distributed.broadcast_object(3, root=np.int64(0)) == 3",
    "dp.set_deterministic(True); dp.set_allow_tf32(False)",
    "assert (dp._core.MAX_THREADS, dp._core.MAX_CHANNELS, dp._core.MAX_DEVICES, dp._core.MAX_PARAMS,"
    " dp._core.MAX_BATCH) == (256, 65536, 64, 2**31 - 1, 2**31 - 1)",
]


def _row_id(code):
    return code if len(code) <= 70 else code[:67] + "..."


@pytest.mark.parametrize("code, kind, argument", BAD, ids=[_row_id(r[0]) for r in BAD])
def test_a_bad_call_names_its_argument(worker, code, kind, argument):
    answer = worker.run(code)
    assert "crash" not in answer, f"{code}: {answer.get('crash')}"
    assert not answer["ok"], f"{code} was accepted"
    assert answer["type"] == kind.__name__, f"{code}: {answer['type']}: {answer['message']}"
    assert argument in answer["message"], f"{code}: the message does not name {argument!r}: {answer['message']}"


@pytest.mark.parametrize("code", GOOD, ids=[_row_id(c) for c in GOOD])
def test_a_good_call_succeeds(worker, code):
    answer = worker.run(code)
    assert "crash" not in answer, f"{code}: {answer.get('crash')}"
    assert answer["ok"], f"{code}: {answer.get('type')}: {answer.get('message')}"


def test_the_table_is_large():
    assert len(BAD) >= 150 and len(GOOD) >= 25


def test_a_crash_fails_only_its_row(worker):
    """The worker dies with the snippet's process; the next row gets a new one."""
    answer = worker.run("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    assert "SIGSEGV" in answer["crash"]
    assert worker.run("x = 1")["ok"]


def test_a_hang_fails_only_its_row(worker, monkeypatch):
    assert worker.run("x = 1")["ok"]  # started, with the usual time to start
    monkeypatch.setattr(sys.modules[__name__], "ROW_TIMEOUT", 0.5)
    assert "no answer" in worker.run("import time; time.sleep(30)")["crash"]
    monkeypatch.undo()
    assert worker.run("x = 1")["ok"]
