"""The worker of tests/test_bad_calls.py: runs one snippet per line of stdin
(a JSON string) in a fresh copy of a namespace of small objects, and answers
one JSON line: {"outcome": "ok"}, or {"outcome": "raised", "type", "mro",
"message"}. A crash ends the process; the test starts another."""
import json
import os
import sys
import traceback

import numpy as np

import dpcore as dp
from dpcore import ops


def namespace(tmp):
    X = np.random.default_rng(0).random((4, 1, 28, 28), dtype=np.float32)
    y = np.array([0, 1, 2, 3], dtype=np.int64)
    net = dp.models.LeNet()
    saved = os.path.join(tmp, "lenet.safetensors")
    if not os.path.exists(saved):
        net.save(saved)
    return {
        "dp": dp, "np": np, "ops": ops, "os": os, "tmp": tmp, "saved": saved,
        "X": X, "y": y, "net": net, "r": net.replicas[0],
        "it": dp.data.from_arrays(X, y, batch_size=2),
        "x4": np.zeros((2, 3, 8, 8), np.float32), "w4": np.zeros((4, 3, 3, 3), np.float32),
        "w1": np.zeros(3, np.float32), "g1": np.zeros(3, np.float32), "v1": np.zeros(3, np.float32),
        "t": dp.tensor(np.zeros(8, np.float32)),
    }


def main():
    tmp = sys.argv[1]
    namespace(tmp)
    print("ready", flush=True)
    for line in sys.stdin:
        code = json.loads(line)
        scope = namespace(tmp)  # fresh objects: a row that changed the model must not affect the next
        try:
            exec(code, scope)
            answer = {"outcome": "ok"}
        except BaseException as e:  # noqa: B902 (the answer is what was raised)
            answer = {"outcome": "raised", "type": type(e).__name__,
                      "mro": [c.__name__ for c in type(e).__mro__], "message": str(e), "tmp": tmp,
                      "where": traceback.format_exc()[-1500:]}
        finally:
            dp.set_logical_devices("cpu", 1)  # a row may have changed them
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
