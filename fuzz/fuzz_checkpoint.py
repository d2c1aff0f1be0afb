"""Coverage-guided fuzzing of dpcore's checkpoint loader, with atheris.

    .venv/bin/python fuzz/fuzz_checkpoint.py [libFuzzer options] CORPUS_DIR...
    .venv/bin/python fuzz/fuzz_checkpoint.py -max_total_time=300 /tmp/ckpt-corpus  # a copy of fuzz/corpus/checkpoint

Each input is the content of one checkpoint file, parsed by the parser
dp.models.load uses (dpcore.checkpoint._parse: the header, the architecture
against the tensors, the checksums, the finiteness check). Every input is
tried twice: as it is, and resealed (the architecture's and the tensors'
SHA-256 recomputed over the mutated bytes, as a careful forger would), so
that the fuzzer gets past the checksums into the architecture checks. A
finding is any of:

- an exception other than DataError, or a DataError whose message does not
  start with the file's name;
- an input accepted with allow_nonfinite=True that is refused without it for
  anything but non-finite values;
- an accepted input that does not round-trip: its architecture and tensors
  written again by the checkpoint writer must parse to the same architecture
  and bitwise the same tensors;
- an accepted input that dp.models.load refuses or loads differently: the
  model the C core builds from the architecture must take exactly these
  tensors (the loader infers every shape without building a model; this
  checks that inference against the core's).

See fuzz/README.md for the corpus convention and the CI run.
"""

import hashlib
import json
import os
import sys
import tempfile

import atheris
import numpy as np  # imported before the instrumentation, which then leaves it alone

with atheris.instrument_imports(include=["dpcore.checkpoint"]):
    import dpcore
    from dpcore import checkpoint
from dpcore.errors import DataError

WHERE = "<fuzz input>"


def reseal(data):
    """data with its checksums recomputed, or None when its header is not
    JSON of the expected shape (then only the input itself is tried)."""
    try:
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + n])
        meta = header["__metadata__"]
        arch = json.loads(meta["dpcore"])
        payload = data[8 + n:]
        if isinstance(arch, dict) and isinstance(arch.get("sha256"), dict):
            for name in arch["sha256"]:
                b, e = header[name]["data_offsets"]
                arch["sha256"][name] = hashlib.sha256(payload[b:e]).hexdigest()
        meta["dpcore"] = json.dumps(arch)
        meta["dpcore_sha256"] = hashlib.sha256(meta["dpcore"].encode()).hexdigest()
        raw = json.dumps(header).encode()
    except Exception:  # noqa: BLE001 -- the harness's own parsing, not the loader's
        return None
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + payload


def parse(data, allow_nonfinite):
    """The loader's verdict: (architecture, tensors), or the DataError's message."""
    try:
        return checkpoint._parse(data, WHERE, allow_nonfinite=allow_nonfinite)
    except DataError as e:
        if not str(e).startswith(WHERE + ": "):
            raise AssertionError(f"a DataError that does not name the file: {e}") from e
        return str(e)


def same(a, b):
    """Two parses' results: equal architectures, bitwise equal tensors in the same order."""
    return (a[0] == b[0] and list(a[1]) == list(b[1])
            and all(np.array_equal(a[1][k].view(np.uint32), b[1][k].view(np.uint32)) for k in a[1]))


def check(data):
    accepted = parse(data, allow_nonfinite=True)
    strict = parse(data, allow_nonfinite=False)
    if isinstance(accepted, str):
        if not isinstance(strict, str):
            raise AssertionError(f"accepted only when non-finite values are refused: {accepted}")
        return
    if isinstance(strict, str) and "non-finite values" not in strict:
        raise AssertionError(f"refused without allow_nonfinite for another reason: {strict}")
    arch, tensors = accepted
    rewritten = dict(arch, format=checkpoint.FORMAT)  # a file of format 1 is written as format 2
    head, _ = checkpoint._encode(rewritten, list(tensors.items()))
    again = parse(head + b"".join(a.tobytes() for a in tensors.values()), allow_nonfinite=True)
    if isinstance(again, str) or not same((rewritten, tensors), again):
        raise AssertionError(f"an accepted checkpoint does not round-trip through the writer: {again}")
    fd, path = tempfile.mkstemp(suffix=".safetensors")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        try:
            net = dpcore.models.load(path, allow_nonfinite=True)
        except DataError as e:
            raise AssertionError(f"_parse accepts it, dp.models.load refuses it: {e}") from e
        loaded = net.get_weights()
        if not same((arch, tensors), (arch, loaded)):
            raise AssertionError("dp.models.load gives other tensors than _parse")
    finally:
        os.unlink(path)


def TestOneInput(data: bytes) -> None:
    check(data)
    sealed = reseal(data)
    if sealed is not None and sealed != data:
        check(sealed)


def main() -> None:
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
