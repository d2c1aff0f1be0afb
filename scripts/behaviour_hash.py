"""Hashes of what training computes, to show that a refactor changed no behaviour (issue 32's
"the suite's numbers are unchanged"): LeNet (book init, 8 steps of 64 Fashion-MNIST images, lr
0.2, momentum 0.9), ResNet-18 (chapter 12.6 init, 2 steps of 16, with its running statistics),
a BatchNorm/residual Sequential on 2 logical CPU devices (2 steps) and predict's logits; each run
in a fresh process with dpcore's GEMM kernel and again with the BLAS (DPCORE_OWN_GEMM=0).

    .venv/bin/python scripts/behaviour_hash.py          # one line per kernel set; compare before/after
"""
import hashlib
import os
import subprocess
import sys

CHILD = r"""
import hashlib, numpy as np, warnings, dpcore as dp
warnings.simplefilter("ignore")
tr_X, tr_y, te_X, _ = dp.data._load_fashion_mnist_arrays(None)
X, y, Xt = np.array(tr_X[:512]), np.array(tr_y[:512]), np.array(te_X[:64])
h = hashlib.sha256()
def take(net):
    for name, w in net.get_weights().items():
        h.update(name.encode()); h.update(np.ascontiguousarray(w).tobytes())
    h.update(np.ascontiguousarray(net.predict(Xt)).tobytes())
net = dp.models.LeNet(seed=0, devices=["cpu:0"])
for i in range(8):
    net.train_step(X[64 * i:64 * (i + 1)], y[64 * i:64 * (i + 1)], lr=0.2, momentum=0.9)
take(net)
net = dp.models.ResNet18(seed=0, init="d2l", devices=["cpu:0"])
for i in range(2):
    net.train_step(X[16 * i:16 * (i + 1)], y[16 * i:16 * (i + 1)], lr=0.1, momentum=0.9, weight_decay=1e-3)
take(net)
dp.set_logical_devices("cpu", 2)
layers = [("conv2d", 8, 3, 1, 1), ("batchnorm",), ("relu",), ("conv2d", 8, 3, 2, 1), ("batchnorm",), ("relu",),
          ("conv2d", 8, 3, 1, 1), ("batchnorm",), ("conv2d", 8, 1, 2, 0), ("add", 7, 8), ("relu",),
          ("global_avgpool",), ("flatten",), ("dense", 10)]
sources = [None] * 8 + [2] + [None] * 5
net = dp.models.Sequential(layers, input_shape=(1, 28, 28), sources=sources, devices=["cpu:0", "cpu:1"],
                           sync_batchnorm=True, seed=0)
for i in range(2):
    net.train_step(X[32 * i:32 * (i + 1)], y[32 * i:32 * (i + 1)], lr=0.1, momentum=0.9)
take(net)
print(h.hexdigest())
"""


def main():
    for label, extra in (("dpcore GEMM", {}), ("BLAS (DPCORE_OWN_GEMM=0)", {"DPCORE_OWN_GEMM": "0"})):
        env = dict(os.environ, **extra)
        out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(out.stderr)
        print(f"{label}: {out.stdout.strip()}", flush=True)


if __name__ == "__main__":
    main()
