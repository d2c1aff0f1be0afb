"""Every bad argument gets a clear message: a table of bad calls to the public
API, each expected to raise a given exception type with a message that names
the argument, and a table of unusual but valid calls that must succeed (NumPy
scalars for numbers, one device name for a list, ...).

Every call runs in a worker subprocess (tests/_bad_call_worker.py), one
snippet at a time: a call that crashes the interpreter (a segfault, an abort
from a library) fails its own row, with the signal named, and the worker is
started again for the next row. A call that hangs fails its row after
PER_CALL_TIMEOUT_S seconds.
"""
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_bad_call_worker.py")
PER_CALL_TIMEOUT_S = 60

T, V, K, F, D = TypeError, ValueError, KeyError, FileNotFoundError, "DataError"

# (snippet, exception, a word the message must contain: the argument's name)
BAD_CALLS = [
    # ---- the examples -------------------------------------------------------------
    ("dp.models.LeNet(threads=100000)", V, "threads"),
    ("dp.models.LeNet(threads=50000)", V, "threads"),
    ("dp.models.LeNet(threads=257)", V, "threads"),
    ("net.predict(X, batch_size=0)", V, "batch_size"),
    ("dp.models.LeNet(devices=[])", V, "devices"),
    ("dp.models.LeNet(devices='cpu:7')", V, "cpu:7"),
    ("ops.conv2d(x4, w4, stride=2**40)", V, "stride"),
    ("ops.conv2d(x4, w4, padding=2**40)", V, "padding"),
    ("dp.train(net, None)", T, "train_iter"),
    ("r.forward_backward(X, y, grad_scale=float('nan'))", V, "grad_scale"),
    ("r.sgd_step(float('inf'))", V, "lr"),
    ("net.set_weights({k: np.full(v.shape, 1e39) for k, v in net.get_weights().items()})", V, "float32"),
    # ---- the core itself enforces the limits and the SGD arguments (no Python check in front) ----
    ("dp._core.Model((1, 28, 28), [('flatten',), ('dense', 10)], 100000)", V, "threads"),
    ("dp._core.Model((1, 28, 28), [('flatten',), ('dense', 70000)])", V, "out_features"),
    ("dp._core.Model((70000, 2, 2), [('flatten',), ('dense', 10)])", V, "channels"),
    ("dp._core.sgd_update(w1, g1, v1, float('nan'), 0.0, 0.0)", V, "lr"),
    ("dp._core.sgd_update(w1, g1, v1, 0.1, float('inf'), 0.0)", V, "momentum"),
    ("dp._core.sgd_update(w1, g1, v1, 0.1, 0.0, 1e39)", V, "weight_decay"),
    ("net._model.sgd_step(float('nan'))", V, "lr"),
    ("net._model.forward_backward(X, y, float('inf'))", V, "grad_scale"),
    ("dp._core.set_logical_devices('cpu', 65)", V, "count"),
    # ---- the binding parses every integer in 64 bits: a ValueError naming it, never OverflowError ----
    ("dp._core.Model((1, 28, 28), [('flatten',), ('dense', 10)], threads=2**40)", V, "threads"),
    ("dp._core.Model((1, 28, 28), [('flatten',), ('dense', 10)], threads=2**70)", V, "threads"),
    ("dp._core.Model((1, 28, 28), [('flatten',), ('dense', 10)], threads=True)", T, "threads"),
    ("dp._core.Model((1, 28, 28), [('flatten',), ('dense', 10)], device_index=2**40)", V, "device_index"),
    ("dp._core.Model((1, 28, 28), [('flatten',), ('dense', 10)], gpu=2**33)", V, "gpu"),
    ("dp._core.Model((1, 28, 28), [('conv2d', 2, 3, True, 0), ('flatten',), ('dense', 10)])", T, "stride"),
    ("dp._core.Model((1, 28, 28), [('batchnorm', True), ('flatten',), ('dense', 10)])", T, "eps"),
    ("dp._core.Mirrored([net._model], bucket_bytes=2**70)", V, "bucket_bytes"),
    ("dp._core.all_reduce([t], 2**70)", V, "op"),
    ("dp._core.all_reduce([t], 2)", V, "op"),
    ("dp._core.shard_ranges(2**70, 2)", V, "n"),
    ("dp._core.shard_ranges(4, 2**40)", V, "k"),
    ("dp._core.allreduce_benchmark(2, 4, 2**40)", V, "iters"),
    ("dp._core.allreduce_benchmark(2**40, 4, 1)", V, "k"),
    ("dp._core.cudnn_conv_output_dim(1, 1, 28, 28, 8, 3, 3, 2**40, 0)", V, "stride"),
    ("dp._core.dist_bcast(bytearray(8), 2**40, 1.0, 'x')", V, "root"),
    ("dp._core.dist_chain_benchmark(4, 2**40, 1, 1.0)", V, "k"),
    # ---- and every real one as a double: 1e39 is refused as 1e39, not rounded to inf first ----
    ("net._model.train_step(X, y, 1e39)", V, "lr must be a finite number >= 0 (within float32's range), got 1e+39"),
    ("net._model.sgd_step(10**400)", V, "lr"),
    ("net._model.sgd_step('0.1')", T, "lr"),
    ("net._model.sgd_step(True)", T, "lr"),
    ("net._model.forward_backward(X, y, 1e39)", V, "grad_scale"),
    ("net._model.forward_backward(X, y, None)", T, "grad_scale"),
    ("dp._core.sgd_update(w1, g1, v1, 0.1, 0.0, True)", T, "weight_decay"),
    # ---- models: construction -------------------------------------------------------------
    ("dp.models.LeNet(threads=-1)", V, "threads"),
    ("dp.models.LeNet(threads=1.5)", T, "threads"),
    ("dp.models.LeNet(threads='2')", T, "threads"),
    ("dp.models.LeNet(threads=True)", T, "threads"),
    ("dp.models.LeNet(num_classes=0)", V, "num_classes"),
    ("dp.models.LeNet(num_classes=-3)", V, "num_classes"),
    ("dp.models.LeNet(num_classes=10**6)", V, "num_classes"),
    ("dp.models.LeNet(num_classes=2.0)", T, "num_classes"),
    ("dp.models.LeNet(num_classes=None)", T, "num_classes"),
    ("dp.models.LeNet(in_channels=0)", V, "in_channels"),
    ("dp.models.LeNet(in_channels=10**6)", V, "in_channels"),
    ("dp.models.LeNet(in_channels='1')", T, "in_channels"),
    ("dp.models.LeNet(seed='x')", T, "seed"),
    ("dp.models.LeNet(seed=-1)", V, "seed"),
    ("dp.models.LeNet(seed=1.5)", T, "seed"),
    ("dp.models.LeNet(devices=5)", T, "devices"),
    ("dp.models.LeNet(devices=[0])", T, "devices"),
    ("dp.models.LeNet(devices=['cpu:0', 'cpu:0'])", V, "devices"),
    ("dp.models.LeNet(devices=['gpu:0'])", V, "gpu:0"),
    ("dp.models.LeNet(devices=['cpu:0'] * 65)", V, "devices"),
    ("dp.models.LeNet(devices='')", V, "devices"),
    ("dp.models.LeNet(all_reduce='magic')", V, "all_reduce"),
    ("dp.models.LeNet(all_reduce=3)", T, "all_reduce"),
    ("dp.models.LeNet(bucket_mb=-1)", V, "bucket_mb"),
    ("dp.models.LeNet(bucket_mb='big')", T, "bucket_mb"),
    ("dp.models.LeNet(bucket_mb=float('nan'))", V, "bucket_mb"),
    ("dp.models.ResNet18(input_size=0)", V, "input_size"),
    ("dp.models.ResNet18(input_size=2.5)", T, "input_size"),
    ("dp.models.ResNet18(sync_batchnorm='yes')", T, "sync_batchnorm"),
    ("dp.models.ResNet18(num_classes=0)", V, "num_classes"),
    ("dp.models.Sequential([('dense', 10)], input_shape=(1, 28))", V, "input_shape"),
    ("dp.models.Sequential([('dense', 10)], input_shape=(0, 28, 28))", V, "input_shape"),
    ("dp.models.Sequential([('dense', 10)], input_shape=(1, -28, 28))", V, "input_shape"),
    ("dp.models.Sequential([('dense', 10)], input_shape='1x28x28')", T, "input_shape"),
    ("dp.models.Sequential([('dense', 10)], input_shape=(1.0, 28, 28))", T, "input_shape"),
    ("dp.models.Sequential([('flatten',), ('dense', 10**6)])", V, "out_features"),
    ("dp.models.Sequential([('flatten',), ('dense', 0)])", V, "out_features"),
    ("dp.models.Sequential([('conv2d', 70000, 3, 1, 0)])", V, "out_channels"),
    ("dp.models.Sequential([('conv2d', 4, 3, 0, 0)])", V, "stride"),
    ("dp.models.Sequential([('conv2d', 4, 3, 1, -1)])", V, "padding"),
    ("dp.models.Sequential([('conv2d', 4, 99, 1, 0)])", V, "kernel"),
    ("dp.models.Sequential([('unknown_kind', 3)])", V, "unknown_kind"),
    ("dp.models.Sequential([('dense',)])", V, "dense"),
    ("dp.models.Sequential('dense')", T, "layers"),
    ("dp.models.Sequential(None)", T, "layers"),
    ("dp.models.Sequential([])", V, "layers"),
    ("dp.models.Sequential([('flatten',), ('dense', 10)], init='xavier')", V, "init"),
    ("dp.models.Sequential([('flatten',), ('dense', 10)], init_std=-1.0)", V, "init_std"),
    ("dp.models.Sequential([('flatten',), ('dense', 10)], init_std=float('inf'))", V, "init_std"),
    ("dp.models.Sequential([('flatten',), ('dense', 10)], init_std='0.1')", T, "init_std"),
    ("dp.models.Sequential([('flatten',), ('dense', 10)], names=['a'] * 5)", V, "names"),
    ("dp.models.Sequential([('flatten',), ('dense', 10)], sources=[None])", V, "sources"),
    ("dp.models.Sequential([('flatten',), ('dense', 10)], sync_batchnorm=1)", T, "sync_batchnorm"),
    # ---- models: methods ------------------------------------------------------------------
    ("net.predict(X, batch_size=-5)", V, "batch_size"),
    ("net.predict(X, batch_size=2.5)", T, "batch_size"),
    ("net.predict(X, batch_size='8')", T, "batch_size"),
    ("net.predict(X, batch_size=None)", T, "batch_size"),
    ("net.predict(None)", T, "images"),
    ("net.predict('images')", T, "images"),
    ("net.predict(np.zeros((2, 3, 28, 28), np.float32))", V, "images"),
    ("net.predict(np.zeros((2, 28), np.float32))", V, "images"),
    ("net.predict(np.zeros((2, 1, 28, 28), np.complex64))", T, "images"),
    ("net.predict(np.zeros((2, 1, 28, 28), np.int32))", T, "images"),
    ("net.predict(np.zeros((2, 1, 28, 28), bool))", T, "images"),
    ("net.train_step(X, y, lr=-0.1)", V, "lr"),
    ("net.train_step(X, y, lr=float('nan'))", V, "lr"),
    ("net.train_step(X, y, lr=float('inf'))", V, "lr"),
    ("net.train_step(X, y, lr=1e39)", V, "lr"),
    ("net.train_step(X, y, lr='0.1')", T, "lr"),
    ("net.train_step(X, y, lr=None)", T, "lr"),
    ("net.train_step(X, y, lr=True)", T, "lr"),
    ("net.train_step(X, y, lr=0.1, momentum=-0.5)", V, "momentum"),
    ("net.train_step(X, y, lr=0.1, momentum=float('nan'))", V, "momentum"),
    ("net.train_step(X, y, lr=0.1, momentum='high')", T, "momentum"),
    ("net.train_step(X, y, lr=0.1, weight_decay=-1e-4)", V, "weight_decay"),
    ("net.train_step(X, y, lr=0.1, weight_decay=float('inf'))", V, "weight_decay"),
    ("net.train_step(X, y, lr=0.1, weight_decay=[0.1])", T, "weight_decay"),
    ("net.train_step(X, y[:3], lr=0.1)", V, "labels"),
    ("net.train_step(X, y.astype(np.float32), lr=0.1)", T, "labels"),
    ("net.train_step(X, np.full(4, 10), lr=0.1)", V, "label"),
    ("net.train_step(X, np.full(4, -1), lr=0.1)", V, "label"),
    ("net.train_step(X, None, lr=0.1)", T, "labels"),
    ("net.train_step(None, y, lr=0.1)", T, "images"),
    ("net.evaluate(None)", T, "data_iter"),
    ("net.evaluate(X)", T, "data_iter"),
    ("net.evaluate(5)", T, "data_iter"),
    ("net.evaluate([(X,)])", T, "data_iter"),
    ("net.evaluate([])", V, "data_iter"),
    ("net.set_weights(None)", T, "weights"),
    ("net.set_weights(5)", T, "weights"),
    ("net.set_weights({})", K, "missing"),
    ("net.set_weights({**net.get_weights(), 'extra.weight': np.zeros(3)})", K, "extra.weight"),
    ("net.set_weights([np.zeros(1)])", V, "weights"),
    ("net.set_weights({k: np.zeros((1,)) for k in net.get_weights()})", V, "shape"),
    ("net.set_weights({k: np.full(v.shape, 'a') for k, v in net.get_weights().items()})", T, "dtype"),
    ("net.set_weights({k: np.full(v.shape, np.nan) for k, v in net.get_weights().items()})", V, "finite"),
    ("net.save(None)", T, "path"),
    ("net.save(5)", T, "path"),
    ("net.save('')", V, "path"),
    ("net.save('a\\0b')", V, "path"),
    ("net.save(os.path.join(tmp, 'no', 'such', 'dir', 'x.safetensors'))", F, "x.safetensors"),
    ("net.make_resident(None, y)", T, "images"),
    ("net.make_resident(X, y[:2])", V, "labels"),
    ("net.train_step_rows(net.make_resident(X, y), [0, 9], lr=0.1)", V, "rows"),
    ("net.train_step_rows(net.make_resident(X, y), [-1], lr=0.1)", V, "rows"),
    ("net.train_step_rows(net.make_resident(X, y), [0.5], lr=0.1)", T, "rows"),
    ("net.train_step_rows(net.make_resident(X, y), [0], lr=-1.0)", V, "lr"),
    ("net.train_step_rows(None, [0], lr=0.1)", T, "residents"),
    ("r.forward_backward(X, y, grad_scale=float('inf'))", V, "grad_scale"),
    ("r.forward_backward(X, y, grad_scale=1e39)", V, "grad_scale"),
    ("r.forward_backward(X, y, grad_scale='1')", T, "grad_scale"),
    ("r.forward_backward(X, y, grad_scale=None)", T, "grad_scale"),
    ("r.sgd_step(-1.0)", V, "lr"),
    ("r.sgd_step(float('nan'))", V, "lr"),
    ("r.sgd_step(1e39)", V, "lr"),
    ("r.sgd_step('0.1')", T, "lr"),
    ("r.sgd_step(0.1, momentum=float('inf'))", V, "momentum"),
    ("r.sgd_step(0.1, weight_decay=-1.0)", V, "weight_decay"),
    ("dp.models.load(None)", T, "path"),
    ("dp.models.load(3.5)", T, "path"),
    ("dp.models.load(os.path.join(tmp, 'missing.safetensors'))", F, "missing.safetensors"),
    ("dp.models.load(tmp)", IsADirectoryError, "tmp"),
    ("dp.models.load(saved, devices=[])", V, "devices"),
    ("dp.models.load(saved, devices=7)", T, "devices"),
    ("dp.models.load(saved, allow_nonfinite='yes')", T, "allow_nonfinite"),
    # ---- dp.train ----------------------------------------------------------------------------
    ("dp.train(None, it)", T, "net"),
    ("dp.train('net', it)", T, "net"),
    ("dp.train(net, X)", T, "train_iter"),
    ("dp.train(net, 5)", T, "train_iter"),
    ("dp.train(net, [])", V, "train_iter"),
    ("dp.train(net, [(X,)], num_epochs=1, verbose=False)", T, "train_iter"),
    ("dp.train(net, it, test_iter=5, num_epochs=1, verbose=False)", T, "test_iter"),
    ("dp.train(net, it, num_epochs=-1)", V, "num_epochs"),
    ("dp.train(net, it, num_epochs=1.5)", T, "num_epochs"),
    ("dp.train(net, it, num_epochs='2')", T, "num_epochs"),
    ("dp.train(net, it, num_epochs=None)", T, "num_epochs"),
    ("dp.train(net, it, num_epochs=True)", T, "num_epochs"),
    ("dp.train(net, it, lr=0)", V, "lr"),
    ("dp.train(net, it, lr=-1)", V, "lr"),
    ("dp.train(net, it, lr=float('nan'))", V, "lr"),
    ("dp.train(net, it, lr=float('inf'))", V, "lr"),
    ("dp.train(net, it, lr='0.1')", T, "lr"),
    ("dp.train(net, it, lr=None)", T, "lr"),
    ("dp.train(net, it, lr=np.array([0.1, 0.2]))", T, "lr"),
    ("dp.train(net, it, momentum=-0.1)", V, "momentum"),
    ("dp.train(net, it, momentum=float('nan'))", V, "momentum"),
    ("dp.train(net, it, weight_decay=-1)", V, "weight_decay"),
    ("dp.train(net, it, weight_decay=float('inf'))", V, "weight_decay"),
    ("dp.train(net, it, verbose='yes')", T, "verbose"),
    ("dp.train(net, it, verbose=None)", T, "verbose"),
    ("dp.train(net, it, resident='auto')", T, "resident"),
    ("dp.train(net, [(X, y)], resident=True)", T, "resident"),
    ("dp.train(net, it, check_numerics='on')", T, "check_numerics"),
    ("dp.train(net, it, progress='yes')", T, "progress"),
    ("dp.train(net, it, profile=1)", T, "profile"),
    ("dp.train(net, it, resume='yes', checkpoint=os.path.join(tmp, 'r.safetensors'))", T, "resume"),
    ("dp.train(net, it, resume=True)", V, "checkpoint"),
    ("dp.train(net, it, checkpoint=5)", T, "checkpoint"),
    ("dp.train(net, it, checkpoint=os.path.join(tmp, 'no', 'dir', 'r.safetensors'))", F, "checkpoint"),
    ("dp.train(net, it, checkpoint=tmp)", IsADirectoryError, "checkpoint"),
    ("dp.train(net, it, checkpoint=saved, resume=True)", D, "not a training checkpoint"),
    ("dp.train(net, it, plot=3)", T, "plot"),
    ("dp.train(net, it, plot=os.path.join(tmp, 'no', 'dir', 'c.png'))", F, "plot"),
    ("dp.profile(None).__enter__()", T, "net"),
    ("dp.scaling_report(None, it)", T, "model_fn"),
    ("dp.scaling_report(dp.models.LeNet, it, steps=0)", V, "steps"),
    ("dp.scaling_report(dp.models.LeNet, it, devices=[])", V, "devices"),
    ("dp.scaling_report(dp.models.LeNet, [])", V, "train_iter"),
    ("net.evaluate(it, progress='yes')", T, "progress"),
    ("dp.train(net, it, check_numerics=None)", T, "check_numerics"),
    # ---- data ----------------------------------------------------------------------------------
    ("dp.data.from_arrays(X, y, batch_size=0)", V, "batch_size"),
    ("dp.data.from_arrays(X, y, batch_size=-1)", V, "batch_size"),
    ("dp.data.from_arrays(X, y, batch_size=2.0)", T, "batch_size"),
    ("dp.data.from_arrays(X, y, batch_size='2')", T, "batch_size"),
    ("dp.data.from_arrays(X, y, batch_size=None)", T, "batch_size"),
    ("dp.data.from_arrays(X, y, batch_size=True)", T, "batch_size"),
    ("dp.data.from_arrays(X, y[:3], batch_size=2)", V, "y"),
    ("dp.data.from_arrays(X, y.astype(np.float32), batch_size=2)", T, "y"),
    ("dp.data.from_arrays(X, -y - 1, batch_size=2)", V, "y"),
    ("dp.data.from_arrays(None, y, batch_size=2)", T, "X"),
    ("dp.data.from_arrays('X', y, batch_size=2)", T, "X"),
    ("dp.data.from_arrays(np.zeros(4), y, batch_size=2)", V, "X"),
    ("dp.data.from_arrays(X.astype(np.complex64), y, batch_size=2)", T, "X"),
    ("dp.data.from_arrays(X, y, batch_size=2, shuffle='yes')", T, "shuffle"),
    ("dp.data.from_arrays(X, y, batch_size=2, shuffle=True, seed='s')", T, "seed"),
    ("dp.data.from_arrays(X, y, batch_size=2, shuffle=True, seed=-1)", V, "seed"),
    ("dp.data.from_arrays(X, y, batch_size=2, drop_last=1)", T, "drop_last"),
    ("dp.data.load_fashion_mnist(batch_size=0)", V, "batch_size"),
    ("dp.data.load_fashion_mnist(batch_size=1.5)", T, "batch_size"),
    ("dp.data.load_fashion_mnist(batch_size='256')", T, "batch_size"),
    ("dp.data.load_fashion_mnist(256, root=5)", T, "root"),
    ("dp.data.load_fashion_mnist(256, root=os.path.join(tmp, 'nothing'))", F, "nothing"),
    ("dp.data.load_fashion_mnist(256, seed='x')", T, "seed"),
    ("dp.data.read_idx(None)", T, "path"),
    ("dp.data.read_idx(os.path.join(tmp, 'absent.idx'))", F, "absent.idx"),
    ("dp.data.read_idx(saved, max_bytes=-1)", V, "max_bytes"),
    ("dp.data.read_idx(saved, max_bytes='big')", T, "max_bytes"),
    # ---- ops -----------------------------------------------------------------------------------
    ("ops.conv2d(x4, w4, stride=0)", V, "stride"),
    ("ops.conv2d(x4, w4, stride=-1)", V, "stride"),
    ("ops.conv2d(x4, w4, stride=1.5)", T, "stride"),
    ("ops.conv2d(x4, w4, stride='1')", T, "stride"),
    ("ops.conv2d(x4, w4, padding=-1)", V, "padding"),
    ("ops.conv2d(x4, w4, padding=None)", T, "padding"),
    ("ops.conv2d(x4, np.zeros((4, 2, 3, 3), np.float32))", V, "w"),
    ("ops.conv2d(x4, w4, b=np.zeros(3, np.float32))", V, "b"),
    ("ops.conv2d(x4[0], w4)", V, "x"),
    ("ops.conv2d(None, w4)", T, "x"),
    ("ops.conv2d(x4, 'w')", T, "w"),
    ("ops.conv2d(x4, np.zeros((4, 3, 30, 30), np.float32))", V, "kernel"),
    ("ops.conv2d_backward(x4, w4, np.zeros((1, 1, 1, 1), np.float32))", V, "dy"),
    ("ops.conv2d_backward(x4, w4, np.zeros((2, 4, 6, 6), np.float32), stride=0)", V, "stride"),
    ("ops.dense(np.zeros((2, 5), np.float32), np.zeros((3, 4), np.float32))", V, "w"),
    ("ops.dense(np.zeros((2, 5), np.float32), np.zeros((3, 5), np.float32), b=np.zeros(4, np.float32))", V, "b"),
    ("ops.dense(np.zeros(5, np.float32), np.zeros((3, 5), np.float32))", V, "x"),
    ("ops.dense(None, np.zeros((3, 5), np.float32))", T, "x"),
    ("ops.dense_backward(np.zeros((2, 5), np.float32), np.zeros((3, 5), np.float32), np.zeros((2, 4), np.float32))",
     V, "dy"),
    ("ops.relu(None)", T, "x"),
    ("ops.relu(np.array(['a']))", T, "x"),
    ("ops.relu_backward(np.zeros(3, np.float32), np.zeros(4, np.float32))", V, "dy"),
    ("ops.avg_pool2d(x4, 0)", V, "kernel_size"),
    ("ops.avg_pool2d(x4, -2)", V, "kernel_size"),
    ("ops.avg_pool2d(x4, 2.0)", T, "kernel_size"),
    ("ops.avg_pool2d(x4, 2, stride=0)", V, "stride"),
    ("ops.avg_pool2d(x4, 2, stride=2**40)", V, "stride"),
    ("ops.avg_pool2d(x4, 2, padding=5)", V, "padding"),
    ("ops.avg_pool2d(x4, 99)", V, "kernel"),
    ("ops.max_pool2d(x4, 0)", V, "kernel_size"),
    ("ops.max_pool2d(x4, 'two')", T, "kernel_size"),
    ("ops.max_pool2d(x4, 2, padding=-1)", V, "padding"),
    ("ops.max_pool2d_backward(x4, np.zeros((1, 1, 1, 1), np.float32), 2)", V, "dy"),
    ("ops.avg_pool2d_backward(x4, np.zeros((1, 1, 1, 1), np.float32), 2)", V, "dy"),
    ("ops.softmax_cross_entropy(np.zeros((2, 3), np.float32), [0, 5])", V, "label"),
    ("ops.softmax_cross_entropy(np.zeros((2, 3), np.float32), [0, -1])", V, "label"),
    ("ops.softmax_cross_entropy(np.zeros((2, 3), np.float32), [0.5, 1.0])", T, "labels"),
    ("ops.softmax_cross_entropy(np.zeros((2, 3), np.float32), [0])", V, "labels"),
    ("ops.softmax_cross_entropy(np.zeros((2, 3), np.float32), [0, 1], reduction='max')", V, "reduction"),
    ("ops.softmax_cross_entropy(np.zeros((2, 3), np.float32), [0, 1], reduction=None)", T, "reduction"),
    ("ops.softmax_cross_entropy(np.zeros(3, np.float32), [0])", V, "logits"),
    ("ops.sgd_update(w1, g1, v1, lr=float('nan'))", V, "lr"),
    ("ops.sgd_update(w1, g1, v1, lr='0.1')", T, "lr"),
    ("ops.sgd_update(w1, g1, v1, lr=0.1, momentum=-1)", V, "momentum"),
    ("ops.sgd_update(w1, g1, v1, lr=0.1, weight_decay=float('inf'))", V, "weight_decay"),
    ("ops.sgd_update(w1, g1[:2], v1, lr=0.1)", V, "g"),
    ("ops.sgd_update(w1.astype(np.float64), g1, v1, lr=0.1)", T, "w"),
    ("ops.sgd_update(None, g1, v1, lr=0.1)", T, "w"),
    # ---- tensors and collectives ------------------------------------------------------------------
    ("dp.tensor(None)", T, "data"),
    ("dp.tensor(np.array(['a']))", T, "data"),
    ("dp.tensor(np.zeros(3), device='cpu:9')", V, "cpu:9"),
    ("dp.tensor(np.zeros(3), device=0)", T, "device"),
    ("dp.tensor(np.zeros(3), device=None)", T, "device"),
    ("dp.broadcast(t, [])", V, "devices"),
    ("dp.broadcast(t, ['cpu:0', 'cpu:0'])", V, "devices"),
    ("dp.broadcast(t, None)", T, "devices"),
    ("dp.broadcast(None, ['cpu:0'])", T, "t"),
    ("dp.scatter(np.float32(1.0), ['cpu:0'])", V, "data"),
    ("dp.scatter(np.zeros(4), [])", V, "devices"),
    ("dp.scatter(np.zeros(4), 3)", T, "devices"),
    ("dp.split_batch(X, y[:3], ['cpu:0'])", V, "y"),
    ("dp.split_batch(X, y, [])", V, "devices"),
    ("dp.gather([], 'cpu:0')", V, "tensors"),
    ("dp.gather(None, 'cpu:0')", T, "tensors"),
    ("dp.gather([np.zeros((2, 3)), np.zeros((2, 4))], 'cpu:0')", V, "tensors"),
    ("dp.gather([t], 'cpu:5')", V, "cpu:5"),
    ("dp.all_reduce([t], op='max')", V, "op"),
    ("dp.all_reduce([t], op=None)", T, "op"),
    ("dp.all_reduce(None)", T, "tensors"),
    ("dp.all_reduce([])", V, "tensors"),
    ("dp.all_reduce([np.zeros(3)])", T, "tensors"),
    ("dp.all_reduce([t, t])", V, "device"),
    # ---- devices, strategies, config, launch ----------------------------------------------------------
    ("dp.set_logical_devices('cpu', 0)", V, "count"),
    ("dp.set_logical_devices('cpu', -2)", V, "count"),
    ("dp.set_logical_devices('cpu', 65)", V, "count"),
    ("dp.set_logical_devices('cpu', 2.0)", T, "count"),
    ("dp.set_logical_devices('cpu', '2')", T, "count"),
    ("dp.set_logical_devices('tpu', 2)", V, "kind"),
    ("dp.set_logical_devices(None, 2)", T, "kind"),
    ("dp.MirroredStrategy(devices=[])", V, "devices"),
    ("dp.MirroredStrategy(devices=5)", T, "devices"),
    ("dp.MirroredStrategy(devices=['cpu:0', 'cpu:0'])", V, "devices"),
    ("dp.MirroredStrategy(devices=['cpu:42'])", V, "cpu:42"),
    ("dp.MirroredStrategy(all_reduce='ring')", V, "all_reduce"),
    ("dp.MirroredStrategy(bucket_mb=-0.5)", V, "bucket_mb"),
    ("dp.MirroredStrategy(bucket_mb=float('inf'))", V, "bucket_mb"),
    ("dp.set_deterministic('yes')", T, "flag"),
    ("dp.set_allow_tf32(1)", T, "flag"),
    ("dp.launch(None)", T, "fn"),
    ("dp.launch(len, num_processes=0)", V, "num_processes"),
    ("dp.launch(len, num_processes=1.5)", T, "num_processes"),
    ("dp.launch(len, num_processes='2')", T, "num_processes"),
    ("dp.launch(len, num_processes=2, args=5)", T, "args"),
    ("dp.launch(len, num_processes=2, kwargs=[1])", T, "kwargs"),
    ("dp.launch(len, num_processes=2, timeout=-1)", V, "timeout"),
    ("dp.launch(len, num_processes=2, timeout='1h')", T, "timeout"),
    ("dp.distributed.barrier(timeout=-1)", V, "timeout"),
    ("dp.distributed.barrier(timeout=float('nan'))", V, "timeout"),
    ("dp.distributed.broadcast_object(1, root=-1)", V, "root"),
    ("dp.distributed.broadcast_object(1, root=5)", V, "root"),
    ("dp.distributed.broadcast_object(1, root='0')", T, "root"),
    # ---- model parallelism ------------------------------------------------------------------
    ("dp.PipelineStrategy(devices=['cpu:0', 'cpu:0'])", V, "once"),
    ("dp.PipelineStrategy(devices=['cpu:0'], micro_batches=0)", V, "micro_batches"),
    ("dp.PipelineStrategy(devices=['cpu:0'], micro_batches=-3)", V, "micro_batches"),
    ("dp.PipelineStrategy(devices=['cpu:0'], micro_batches=True)", T, "micro_batches"),
    ("dp.PipelineStrategy(devices=['cpu:0'], micro_batches=2**70)", V, "micro_batches"),
    ("dp.PipelineStrategy(devices=['cpu:0'], schedule=None)", T, "schedule"),
    ("dp.PipelineStrategy(devices=['cpu:0'], replicas=0)", V, "replicas"),
    ("dp.PipelineStrategy(devices=['cpu:0'], split=[0, -1])", V, "split"),
    ("dp.PipelineStrategy(devices=['cpu:0'], balance='guess')", V, "balance"),
    ("dp.ModelParallelStrategy(devices=['cpu:0', 'cpu:0'])", V, "devices"),
    ("dp.ModelParallelStrategy(devices=[])", V, "devices"),
    ("dp.ModelParallelStrategy(devices=3)", T, "devices"),
    ("dp.ModelParallelStrategy(devices=['cpu:0'], replicas=0)", V, "replicas"),
    ("dp.ModelParallelStrategy(devices=['cpu:0'], replicas='2')", T, "replicas"),
    ("r._model.stage_forward(0, dp.tensor(np.zeros(3, np.int64), 'cpu:0'))", T, "float32"),
    ("r._model.stage_forward(0, dp.tensor(np.zeros((4, 3), np.float32), 'cpu:0'))", V, "values"),
    ("r._model.stage_forward(-1, X)", V, "slot"),
    ("r._model.stage_forward(10**6, X)", V, "slot"),
    ("r._model.stage_backward(0, 4, dp.tensor(np.zeros((3, 10), np.float32), 'cpu:0'))", V, "4 samples"),
    ("r._model.stage_backward(0, 0)", V, "n"),
    ("r._model.stage_backward(7, 4)", V, "activation set"),
]

# Unusual but valid calls: each must succeed.
GOOD_CALLS = [
    "dp.models.LeNet(devices='cpu:0')",
    "dp.models.LeNet(devices='cpu')",
    "dp.models.LeNet(devices=('cpu:0',))",
    "dp.models.LeNet(threads=np.int64(1))",
    "dp.models.LeNet(num_classes=np.int32(3))",
    "dp.models.LeNet(seed=np.uint8(7))",
    "dp.models.LeNet(threads=256)",
    "net.train_step(X, y, lr=np.float32(0.1))",
    "net.train_step(X, y, lr=np.float64(0.1), momentum=np.float32(0.9), weight_decay=np.float16(0))",
    "net.train_step(X, y, lr=1)",
    "net.train_step(X, y, lr=0)",  # no update: the batch's loss, gradients and BatchNorm statistics only
    "net.train_step(X, y, lr=np.array(0.1))",
    "net.predict(X, batch_size=np.int64(2))",
    "r.forward_backward(X, y, grad_scale=np.float32(0.25))",
    "r.sgd_step(np.float32(0.1))",
    "dp.train(net, it, num_epochs=np.int64(1), lr=np.float32(0.1), verbose=False)",
    "dp.train(net, it, num_epochs=0, verbose=False)",
    "dp.train(net, it, num_epochs=1, lr=0.1, verbose=np.bool_(False))",
    "dp.data.from_arrays(X, y, batch_size=np.int64(2), shuffle=np.bool_(True), seed=np.int64(3))",
    "dp.data.from_arrays(X, y.astype(np.uint8), batch_size=2)",
    "ops.conv2d(x4, w4, stride=np.int64(1), padding=np.int32(1))",
    "ops.avg_pool2d(x4, np.int64(2))",
    "ops.sgd_update(w1, g1, v1, lr=np.float32(0.1))",
    "dp.scatter(np.zeros(4), ['cpu:0'])",
    "dp.set_logical_devices('cpu', np.int64(1))",
    "dp.MirroredStrategy(devices='cpu:0')",
    "dp.MirroredStrategy(bucket_mb=np.float32(4))",
    "dp.tensor([1.0, 2.0], device='cpu')",
    "net.set_weights({k: v.astype(np.float64) for k, v in net.get_weights().items()})",
    "dp.models.load(saved, devices='cpu:0')",
]


class Worker:
    """The worker subprocess, started again after a crash or a hang."""

    def __init__(self, tmp):
        self.tmp = tmp
        self.proc = None

    def start(self):
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, WORKER, self.tmp], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        ready = self.proc.stdout.readline()
        assert ready.strip() == "ready", ready + self.proc.stderr.read()

    def run(self, code):
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        self.proc.stdin.write(json.dumps(code) + "\n")
        self.proc.stdin.flush()
        import selectors

        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(PER_CALL_TIMEOUT_S):
                self.proc.kill()
                self.proc.wait()
                return {"outcome": "hang", "detail": f"no answer in {PER_CALL_TIMEOUT_S} s"}
        line = self.proc.stdout.readline()
        if not line:
            status = self.proc.wait()
            err = self.proc.stderr.read()[-2000:]
            return {"outcome": "crash", "detail": f"the worker died (status {status}): {err}"}
        return json.loads(line)

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    w = Worker(str(tmp_path_factory.mktemp("bad_calls")))
    yield w
    w.close()


def test_the_table_is_large_and_unique():
    snippets = [row[0] for row in BAD_CALLS]
    assert len(snippets) >= 150
    assert len(set(snippets)) == len(snippets), [s for s in snippets if snippets.count(s) > 1]


@pytest.mark.parametrize("code,expected,word", BAD_CALLS, ids=[row[0][:70] for row in BAD_CALLS])
def test_bad_call(worker, code, expected, word):
    answer = worker.run(code)
    assert answer["outcome"] == "raised", f"{code}: {answer}"
    name = expected if isinstance(expected, str) else expected.__name__
    assert name in answer["mro"], f"{code}: expected {name}, got {answer['type']}: {answer['message']}"
    if word == "tmp":
        word = answer["tmp"]
    assert word.lower() in answer["message"].lower(), (
        f"{code}: the message does not name {word!r}: {answer['type']}: {answer['message']}")
    assert len(answer["message"]) < 2000, answer["message"]


@pytest.mark.parametrize("code", GOOD_CALLS)
def test_good_call(worker, code):
    answer = worker.run(code)
    assert answer["outcome"] == "ok", f"{code}: {answer}"


def test_a_crash_fails_only_its_row(worker):
    """The worker protocol itself: a worker killed by a signal is reported as a
    crash, and the next call runs in a fresh worker. (SIGKILL rather than a
    real segfault: under make test-asan a segfault is a sanitizer report, which
    fails the run by design.)"""
    answer = worker.run("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert answer["outcome"] == "crash" and "status -9" in answer["detail"], answer
    assert worker.run("1 + 1")["outcome"] == "ok"
