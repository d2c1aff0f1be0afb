"""Write the seed corpus of fuzz/fuzz_checkpoint.py into fuzz/corpus/checkpoint (deterministic).

    .venv/bin/python fuzz/make_checkpoint_corpus.py

Checkpoints of tiny models (a few KB) over every layer kind, one of format 1
(no checksums), and a few damaged ones, so the fuzzer starts from every
branch of the loader.
"""

import json
import os

from safetensors.numpy import save_file

import dpcore as dp

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "corpus", "checkpoint")


def saved(net, name):
    path = os.path.join(CORPUS, name)
    net.save(path)
    with open(path, "rb") as f:
        return f.read()


def write(name, data):
    with open(os.path.join(CORPUS, name), "wb") as f:
        f.write(data)


def main():
    os.makedirs(CORPUS, exist_ok=True)
    for name in os.listdir(CORPUS):
        if not name.startswith("found-"):  # reproducers of fixed findings stay
            os.unlink(os.path.join(CORPUS, name))
    dense = saved(dp.models.Sequential([("flatten",), ("dense", 3)], input_shape=(1, 4, 4), seed=1),
                  "dense.safetensors")
    saved(dp.models.Sequential([("conv2d", 2, 3, 1, 1), ("batchnorm", 1e-3, 0.2), ("relu",), ("conv2d", 2, 3, 1, 1),
                                ("add", 2, 3), ("maxpool", 2, 2, 0), ("avgpool", 2, 1, 1), ("global_avgpool",),
                                ("flatten",), ("dense", 2)],
                               input_shape=(1, 6, 6), names=["c", "bn", "r", "c2", "a", "m", "p", "g", "f", "fc"],
                               init="torch"), "every-kind.safetensors")
    saved(dp.models.Sequential([("conv2d", 2, 3, 2, 0), ("relu",), ("conv2d", 2, 1, 1, 0), ("flatten",),
                                ("dense", 2)], input_shape=(2, 5, 5), sources=[None, None, 0, None, None]),
          "sources.safetensors")
    net = dp.models.Sequential([("flatten",), ("dense", 2)], input_shape=(1, 2, 2), seed=2)
    arch = {"format": "dpcore-sequential-1", "class": "Sequential", "layers": [["flatten"], ["dense", 2]],
            "input_shape": [1, 2, 2]}
    save_file(dict(net.get_weights()), os.path.join(CORPUS, "format-1.safetensors"),
              metadata={"dpcore": json.dumps(arch)})
    write("damaged-truncated.safetensors", dense[:len(dense) - 5])
    flipped = bytearray(dense)
    flipped[-3] ^= 0x40
    write("damaged-data-flipped.safetensors", bytes(flipped))
    n = int.from_bytes(dense[:8], "little")
    header = json.loads(dense[8:8 + n])
    arch = json.loads(header["__metadata__"]["dpcore"])
    arch["layers"][-1] = ["dense", 10**6]
    header["__metadata__"]["dpcore"] = json.dumps(arch)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    write("damaged-huge-layer.safetensors", len(raw).to_bytes(8, "little") + raw + dense[8 + n:])


if __name__ == "__main__":
    main()
