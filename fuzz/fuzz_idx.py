"""Coverage-guided fuzzing of dpcore's IDX reader (raw and gzip), with atheris.

    .venv/bin/python fuzz/fuzz_idx.py [libFuzzer options] CORPUS_DIR...
    .venv/bin/python fuzz/fuzz_idx.py -max_total_time=300 /tmp/idx-corpus  # a copy of fuzz/corpus/idx

Each input is the content of one file, parsed by the reader read_idx uses
(dpcore.data._read_idx_buffer). A finding is any of:

- an exception other than DataError: the reader's inputs are bounded (a raw
  file cannot declare more than it holds, a gzip one more than 1032 times its
  size), so not even MemoryError is expected;
- an accepted input that does not round-trip: for a raw file the array written
  back as IDX must be the input itself; for a gzip file it must be what zlib's
  own gzip decoder (an independent implementation) inflates the input to;
- a disagreement with zlib: a single-member gzip stream that zlib inflates to a
  well-formed IDX file must be accepted, and one zlib refuses must be refused.

An input starting with 0xFF (never an IDX or gzip file) is instead an IDX file
to compress: the rest of it, gzipped here at level ``input[1] % 10``. Its reading
must then agree exactly with the raw reading of the rest, so the fuzzer explores
IDX headers and payloads behind a valid gzip container, which mutating
compressed bytes rarely reaches.

See fuzz/README.md for the corpus convention and the CI run.
"""

import sys
import zlib

import atheris
import numpy as np  # imported before the instrumentation, which then leaves it alone

with atheris.instrument_imports(include=["dpcore.data"]):
    import dpcore.data as data
from dpcore.errors import DataError

_GZIP_MAGIC = b"\x1f\x8b"
_TYPE_CODES = {np.dtype(dtype).newbyteorder(">").str: code for code, dtype in data._IDX_DTYPES.items()}


def idx_bytes(array: np.ndarray) -> bytes:
    """``array`` written as an IDX file (the reader's inverse)."""
    big_endian = array.astype(array.dtype.newbyteorder(">"))
    code = _TYPE_CODES[big_endian.dtype.str]
    header = bytes([0, 0, code, array.ndim]) + b"".join(dim.to_bytes(4, "big") for dim in array.shape)
    return header + big_endian.tobytes()


def parse(content: bytes):
    """The reader's verdict: the array, or None for a DataError (anything else propagates)."""
    try:
        return data._read_idx_buffer(content, "<fuzz input>")
    except DataError:
        return None


def zlib_gunzip(content: bytes):
    """What zlib inflates a single-member gzip file to, None when it refuses it."""
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        inflated = inflater.decompress(content) + inflater.flush()
    except zlib.error:
        return None
    if not inflater.eof or inflater.unused_data:
        return None  # truncated, or several members / trailing bytes: refused by the reader
    return inflated


def same_array(first, second) -> bool:
    return (first.dtype == second.dtype and first.shape == second.shape
            and first.tobytes() == second.tobytes())


def check_compressed(level: int, content: bytes) -> None:
    """``content`` gzipped must read exactly as ``content`` itself does."""
    compressor = zlib.compressobj(level, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    array = parse(compressor.compress(content) + compressor.flush())
    expected = parse(content) if content[:2] != _GZIP_MAGIC else None
    if (array is None) != (expected is None):
        raise AssertionError(
            f"the gzip reading {'refused' if array is None else 'accepted'} an IDX file that the "
            f"raw reading {'accepts' if expected is not None else 'refuses'}")
    if array is not None and not same_array(array, expected):
        raise AssertionError("the gzip and the raw reading of the same IDX file differ")


def TestOneInput(content: bytes) -> None:
    if content[:1] == b"\xff":
        check_compressed(content[1] % 10 if len(content) > 1 else 6, content[2:])
        return
    array = parse(content)
    if content[:2] != _GZIP_MAGIC:
        if array is not None and idx_bytes(array) != content:
            raise AssertionError("a raw IDX file was accepted but does not round-trip")
        return
    reference = zlib_gunzip(content)
    if reference is not None and reference[:2] != _GZIP_MAGIC:
        expected = parse(reference)
    else:
        expected = None  # zlib refuses it, or it wraps a second gzip file (not an IDX file)
    if (array is None) != (expected is None):
        raise AssertionError(
            f"the reader {'refused' if array is None else 'accepted'} a gzip file that zlib "
            f"{'inflates to a well-formed' if expected is not None else 'does not inflate to any'} IDX file")
    if array is not None:
        if idx_bytes(array) != reference:
            raise AssertionError("a gzip IDX file was accepted but does not round-trip through zlib")
        if not same_array(array, expected):
            raise AssertionError("the gzip and the raw reading of the same IDX file differ")


def main() -> None:
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
