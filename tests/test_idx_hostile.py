"""Hostile Fashion-MNIST roots and IDX files: every malformation gets a clear
exception naming the file and the problem, and memory stays bounded.

- Mutation tests: a synthetic Fashion-MNIST root (the four files, raw or gzip;
  12 training and 5 test images of 28x28) with one or more files damaged, each
  refused with a DataError / FileNotFoundError whose message names the file and
  the problem, or loaded bit for bit equal to the arrays it was built from.
- Peak memory, measured with the process's peak RSS (ru_maxrss) in a
  subprocess: gzip bombs and absurd declared shapes stay under
  BOMB_RSS_BOUND, valid files under their payload plus BOMB_RSS_BOUND.

The whole file runs in about 10 s.
"""

import json
import os
import pathlib
import re
import struct
import subprocess
import sys
import tempfile
import textwrap
import zlib

import numpy as np
import pytest

import dpcore.data as data
from dpcore.data import load_fashion_mnist
from dpcore.errors import DataError

from test_data import REAL_FASHION_MNIST, idx_bytes, idx_header

STEMS = data._FASHION_MNIST_FILES  # key ("train_images", ...) -> file name without .gz
GZIP_FHCRC, GZIP_FEXTRA, GZIP_FNAME, GZIP_FCOMMENT = 0x02, 0x04, 0x08, 0x10

# Growth of the peak RSS allowed beyond the declared payload. The reader holds
# at most one 1 MiB inflated chunk, one 1 MiB scratch chunk and one 64 KiB
# compressed chunk (about 2.1 MiB); the rest is allocator and interpreter slack.
BOMB_RSS_BOUND = 8 << 20


# ---------------------------------------------------------------------------
# Building IDX and gzip files byte by byte
# ---------------------------------------------------------------------------

def gzip_header(flags=0, name=b"data.idx", comment=b"a comment", extra=b"ab\x02\x00xy"):
    header = bytearray(b"\x1f\x8b\x08" + bytes([flags]) + b"\x00\x00\x00\x00\x00\xff")
    if flags & GZIP_FEXTRA:
        header += struct.pack("<H", len(extra)) + extra
    if flags & GZIP_FNAME:
        header += name + b"\x00"
    if flags & GZIP_FCOMMENT:
        header += comment + b"\x00"
    if flags & GZIP_FHCRC:
        header += struct.pack("<H", zlib.crc32(header) & 0xFFFF)
    return bytes(header)


def raw_deflate(content, level=6):
    compressor = zlib.compressobj(level, zlib.DEFLATED, -zlib.MAX_WBITS)
    return compressor.compress(content) + compressor.flush()


def gzip_bytes(content, level=6, flags=0):
    """One gzip member, written here (not by the gzip module) so every header field can be set."""
    return (gzip_header(flags) + raw_deflate(content, level)
            + struct.pack("<II", zlib.crc32(content), len(content) & 0xFFFFFFFF))


_ZERO_SEGMENT = 1 << 24


def gzip_zeros_bomb(prefix, zeros, isize=None):
    """A gzip file of ``prefix`` then ``zeros`` zero bytes, built without
    compressing them all: after a full flush a deflate segment stands alone, so
    one compressed 16 MiB run of zeros (16 KB) is repeated. A correct CRC-32;
    the size field is the real one unless ``isize`` is given."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    parts = [compressor.compress(prefix) + compressor.flush(zlib.Z_FULL_FLUSH)]
    compressor = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    segment = compressor.compress(bytes(_ZERO_SEGMENT)) + compressor.flush(zlib.Z_FULL_FLUSH)
    parts += [segment] * (zeros // _ZERO_SEGMENT)
    compressor = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    parts.append(compressor.compress(bytes(zeros % _ZERO_SEGMENT)) + compressor.flush(zlib.Z_FULL_FLUSH))
    parts.append(b"\x03\x00")  # an empty final block (fixed Huffman, BFINAL set)
    crc = zlib.crc32(prefix)
    zero_segment = bytes(_ZERO_SEGMENT)
    for _ in range(zeros // _ZERO_SEGMENT):
        crc = zlib.crc32(zero_segment, crc)
    crc = zlib.crc32(bytes(zeros % _ZERO_SEGMENT), crc)
    size = len(prefix) + zeros if isize is None else isize
    return gzip_header() + b"".join(parts) + struct.pack("<II", crc, size & 0xFFFFFFFF)


def test_gzip_zeros_bomb_is_a_valid_gzip_file():
    prefix = idx_header(0x08, (3, 5))
    bomb = gzip_zeros_bomb(prefix, 2 * _ZERO_SEGMENT + 77)
    assert zlib.decompress(bomb, 16 + zlib.MAX_WBITS) == prefix + bytes(2 * _ZERO_SEGMENT + 77)


# ---------------------------------------------------------------------------
# Synthetic Fashion-MNIST roots and their damage
# ---------------------------------------------------------------------------

class Root:
    """A Fashion-MNIST root in ``path``: arrays built here, each file raw or gzip."""

    def __init__(self, path, gzipped):
        rng = np.random.default_rng(11)
        self.path = path
        self.arrays = {
            "train_images": rng.integers(0, 256, size=(12, 28, 28), dtype=np.uint8),
            "train_labels": (np.arange(12) * 7 % 10).astype(np.uint8),
            "test_images": rng.integers(0, 256, size=(5, 28, 28), dtype=np.uint8),
            "test_labels": np.array([9, 0, 3, 3, 1], np.uint8),
        }
        self.gzipped = {key: gzipped for key in STEMS}
        path.mkdir()
        for key, array in self.arrays.items():
            self.write(key, idx_bytes(array))

    def file(self, key):
        return self.path / (STEMS[key] + (".gz" if self.gzipped[key] else ""))

    def content(self, key):
        return idx_bytes(self.arrays[key])

    def write(self, key, content, gzipped=None):
        """Write ``key``'s file holding the IDX bytes ``content`` (compressed if gzip)."""
        if gzipped is not None and gzipped != self.gzipped[key]:
            self.file(key).unlink()
            self.gzipped[key] = gzipped
        self.file(key).write_bytes(gzip_bytes(content) if self.gzipped[key] else content)
        return self.file(key)

    def write_file(self, key, file_bytes):
        """Replace ``key``'s file with exactly these bytes."""
        self.file(key).write_bytes(file_bytes)
        return self.file(key)

    def gz(self, key):
        """The gzip file of ``key``'s intact content."""
        return gzip_bytes(self.content(key))


class Refused:
    def __init__(self, error, phrase, *names):
        self.error, self.phrase, self.names = error, phrase, [str(name) for name in names]


def refused(path, phrase):
    return Refused(DataError, phrase, path)


def not_found(phrase, *names):
    return Refused(FileNotFoundError, phrase, *names)


LOADS = object()
CASES = {}


def case(name, gzipped=False):
    def register(build):
        CASES[name] = (build, gzipped)
        return build
    return register


def with_bytes(content, offset, new):
    """``content`` with the bytes from ``offset`` (negative: from the end) replaced by ``new``."""
    offset %= len(content)
    return content[:offset] + new + content[offset + len(new):]


# --- one file replaced: (case, gzip root, file, its new content from the root,
# written as "idx" (compressed when the root's files are) or as the exact "file"
# bytes, the phrase the message must hold after the file's path) ----------------

ONE_FILE_CASES = [
    ("bad-magic-raw-images", False, "train_images", "idx",
     lambda root: with_bytes(root.content("train_images"), 0, b"\x01"),
     r"bad magic number 0x01000803: an IDX file starts with two zero bytes"),
    ("bad-magic-gzip-labels", True, "test_labels", "idx",
     lambda root: with_bytes(root.content("test_labels"), 0, b"PK"),
     r"bad magic number 0x504b0801"),
    ("gzip-compressed-twice", True, "train_labels", "file",
     lambda root: gzip_bytes(root.gz("train_labels")),
     r"bad magic number 0x1f8b0800: .*compressed twice\?"),
    ("bad-type-code", False, "train_labels", "idx",
     lambda root: with_bytes(root.content("train_labels"), 2, b"\x0a"),
     r"unsupported IDX type code 0x0a; supported: 0x08 \(uint8\)"),
    ("int8-images", False, "train_images", "idx",
     lambda root: with_bytes(root.content("train_images"), 2, b"\x09"),
     r"images must be a rank-3 \(N, 28, 28\) array of unsigned bytes .*dtype int8"),
    ("float64-labels", True, "test_labels", "idx",
     lambda root: idx_bytes(root.arrays["test_labels"].astype(np.float64)),
     r"labels must be a rank-1 \(N,\) array of unsigned bytes .*dtype float64"),
    ("rank-0", False, "train_labels", "idx",
     lambda root: b"\x00\x00\x08\x00",
     r"unsupported IDX rank 0; supported: 1 to 4"),
    ("rank-5", True, "train_images", "idx",
     lambda root: idx_header(0x08, (12, 1, 1, 28, 28)) + root.arrays["train_images"].tobytes(),
     r"unsupported IDX rank 5"),
    ("labels-rank-2", False, "test_labels", "idx",
     lambda root: idx_bytes(root.arrays["test_labels"][:, None]),
     r"labels must be a rank-1 .*shape \(5, 1\)"),
    ("images-rank-2", False, "test_images", "idx",
     lambda root: idx_bytes(root.arrays["test_images"].reshape(5, 784)),
     r"images must be a rank-3 .*rank 2, shape \(5, 784\)"),
    ("zero-image-height", False, "test_images", "idx",
     lambda root: idx_header(0x08, (5, 0, 28)),
     r"\(N, 28, 28\) .*shape \(5, 0, 28\)"),
    ("negative-label-count", False, "train_labels", "idx",
     lambda root: idx_header(0x08, (2**32 - 1,)) + bytes(12),
     r"declares 4294967295 labels.*-1 as a signed 32-bit number"),
    ("negative-image-count", True, "test_images", "idx",
     lambda root: idx_header(0x08, (2**32 - 5, 28, 28)) + root.arrays["test_images"].tobytes(),
     r"counts differ: .* holds 4294967291 images, .* holds 5 labels.*-5 as a signed"),
    ("images-declare-32768x32768", True, "train_images", "idx",
     lambda root: idx_header(0x08, (1, 32768, 32768)) + bytes(1000),
     r"\(N, 28, 28\) .*shape \(1, 32768, 32768\)"),
    ("too-many-train-labels-declared", True, "train_labels", "idx",
     lambda root: idx_header(0x08, (60001,)) + bytes(12),
     r"declares 60001 labels; a Fashion-MNIST train split holds 1 to 60000"),
    ("truncated-header-raw", False, "train_images", "idx",
     lambda root: root.content("train_images")[:10],
     r"too short for an IDX header: rank 3 needs 16 header bytes, the file has 10"),
    ("truncated-header-gzip", True, "test_labels", "idx",
     lambda root: root.content("test_labels")[:6],
     r"too short for an IDX header: rank 1 needs 8 header bytes, the file has 6"),
    ("magic-cut-short", False, "train_labels", "idx",
     lambda root: b"\x00\x00\x08",
     r"too short for an IDX header: 3 bytes"),
    ("empty-file", False, "train_labels", "file",
     lambda root: b"",
     r"is empty \(0 bytes\), too short for an IDX header"),
    ("empty-gzip-member", True, "test_images", "idx",
     lambda root: b"",
     r"too short for an IDX header: 0 bytes"),
    ("trailing-bytes-gzip", True, "train_labels", "idx",
     lambda root: root.content("train_labels") + b"\x00\x00",
     r"trailing bytes after the 12-byte payload .*inflates to more than the header declares"),
    ("truncated-gzip-trailer", True, "test_labels", "file",
     lambda root: root.gz("test_labels")[:-3],
     r"truncated gzip stream: the file ends inside the 8-byte trailer"),
    ("corrupt-deflate-stream", True, "train_images", "file",
     lambda root: with_bytes(root.gz("train_images"), 10, b"\xff" * 30),
     r"corrupt deflate stream in the gzip data after 0 inflated bytes \(.*invalid"),
    ("bad-size-field", True, "test_images", "file",
     lambda root: with_bytes(root.gz("test_images"), -4, struct.pack("<I", 3937)),
     r"gzip size mismatch: the trailer records 3937 bytes \(mod 2\*\*32\), the data inflates to 3936"),
    ("gzip-method-7", True, "test_labels", "file",
     lambda root: with_bytes(root.gz("test_labels"), 2, b"\x07"),
     r"bad gzip header: unsupported compression method 7"),
    ("gzip-reserved-flags", True, "test_labels", "file",
     lambda root: with_bytes(root.gz("test_labels"), 3, b"\x20"),
     r"bad gzip header: reserved flag bits set \(flags 0x20\)"),
    ("gzip-header-cut", True, "train_images", "file",
     lambda root: root.gz("train_images")[:7],
     r"truncated gzip header: the file ends inside its 10-byte fixed part"),
    ("gzip-file-name-unterminated", True, "test_images", "file",
     lambda root: gzip_header(GZIP_FNAME)[:-1] + b"name-that-never-ends",
     r"truncated gzip header: the file ends inside its file name"),
    ("labels-255", True, "test_labels", "idx",
     lambda root: idx_bytes(np.array([1, 255, 2, 255, 200], np.uint8)),
     r"label 255 at index 1 is outside 0..9 \(3 labels out of range\)"),
]


def _register_one_file_case(name, gzipped, key, kind, make, phrase):
    def build(root):
        content = make(root)
        path = root.write(key, content) if kind == "idx" else root.write_file(key, content)
        return refused(path, phrase)
    CASES[name] = (build, gzipped)


for _one_file_case in ONE_FILE_CASES:
    _register_one_file_case(*_one_file_case)


# --- the IDX header ---------------------------------------------------------

@case("zero-examples")
def _(root):
    root.write("train_images", idx_header(0x08, (0, 28, 28)))
    path = root.write("train_labels", idx_header(0x08, (0,)))
    return refused(path, r"declares 0 labels; a Fashion-MNIST train split holds 1 to 60000")


@case("too-many-test-examples")
def _(root):
    root.write("test_images", idx_bytes(np.zeros((10001, 28, 28), np.uint8)))
    path = root.write("test_labels", idx_bytes(np.zeros(10001, np.uint8)))
    return refused(path, r"declares 10001 labels; a Fashion-MNIST test split holds 1 to 10000")


# --- the payload --------------------------------------------------------------

@case("truncated-payload-raw")
def _(root):
    path = root.write("train_images", root.content("train_images")[:-100])
    return refused(path, r"dimensions \(12, 28, 28\) need 9408 bytes of data but the file has 9308 "
                         r"after its 16-byte header")


@case("truncated-payload-gzip", gzipped=True)
def _(root):
    path = root.write("train_images", root.content("train_images")[:-100])
    return refused(path, r"dimensions \(12, 28, 28\) need 9408 bytes of data but the file has 9308 "
                         r"after its 16-byte header \(inflated\)")


@case("trailing-bytes-raw")
def _(root):
    path = root.write("train_labels", root.content("train_labels") + b"\x00\x00")
    return refused(path, r"2 trailing bytes after the 12-byte payload that dimensions \(12,\) describe")


@case("gzip-bomb-inflates-far-past-the-declared-size", gzipped=True)
def _(root):
    # Declares 5 images (7856 bytes), inflates to 256 MiB: refused after one byte too many.
    content = root.content("test_images")
    path = root.write_file("test_images", gzip_zeros_bomb(content, 256 << 20))
    return refused(path, r"trailing bytes after the 3920-byte payload .*inflates to more than the header declares")


@case("gzip-declares-more-than-deflate-can-inflate-to", gzipped=True)
def _(root):
    path = root.write("train_labels", idx_header(0x08, (60000,)) + bytes(10))
    return refused(path, r"need 60000 bytes of data but the file has \d\d gzip-compressed bytes, "
                         r"which inflate to at most \d+")


# --- the gzip container -------------------------------------------------------

@case("truncated-gzip-stream", gzipped=True)
def _(root):
    gz = root.gz("train_images")
    path = root.write_file("train_images", gz[:len(gz) // 2])
    return refused(path, r"truncated gzip stream: the file ends \(\d+ bytes\) before its deflate data does")


@case("damaged-deflate-data-that-still-inflates", gzipped=True)
def _(root):
    # Stored-block data overwritten: it inflates, to the wrong bytes; the CRC-32 tells.
    gz = gzip_bytes(root.content("train_images"), level=0)
    path = root.write_file("train_images", with_bytes(gz, len(gz) // 2, bytes(range(64))))
    return refused(path, r"gzip CRC-32 mismatch: the trailer records 0x[0-9a-f]{8}, the inflated data has")


@case("bad-crc", gzipped=True)
def _(root):
    gz = root.gz("test_images")
    path = root.write_file("test_images", with_bytes(gz, -8, bytes([gz[-8] ^ 0x01])))
    return refused(path, r"gzip CRC-32 mismatch: the trailer records 0x[0-9a-f]{8}, the inflated data has")


@case("concatenated-gzip-members", gzipped=True)
def _(root):
    content = root.content("train_images")
    first = gzip_bytes(content[:5000])
    path = root.write_file("train_images", first + gzip_bytes(content[5000:]))
    return refused(path, rf"several gzip members .*a second one starts at byte {len(first)}")


@case("garbage-after-gzip-stream", gzipped=True)
def _(root):
    gz = root.gz("train_labels")
    path = root.write_file("train_labels", gz + b"\x00" * 4)
    return refused(path, rf"4 bytes of trailing garbage after the end of the gzip stream at byte {len(gz)}")


@case("gzip-bad-header-crc", gzipped=True)
def _(root):
    content = root.content("train_labels")
    header = bytearray(gzip_header(GZIP_FHCRC | GZIP_FNAME))
    header[-1] ^= 0xFF
    path = root.write_file("train_labels", bytes(header) + raw_deflate(content)
                           + struct.pack("<II", zlib.crc32(content), len(content)))
    return refused(path, r"bad gzip header: its CRC-16 does not match")


# --- labels and counts --------------------------------------------------------

@case("label-10")
def _(root):
    labels = root.arrays["train_labels"].copy()
    labels[7] = 10
    path = root.write("train_labels", idx_bytes(labels))
    return refused(path, r"label 10 at index 7 is outside 0..9 \(1 labels out of range\)")


@case("count-mismatch")
def _(root):
    labels_path = root.write("train_labels", idx_bytes(root.arrays["train_labels"][:11]))
    return Refused(DataError, r"image and label counts differ: .*holds 12 images, .*holds 11 labels",
                   root.file("train_images"), labels_path)


@case("count-mismatch-gzip", gzipped=True)
def _(root):
    images_path = root.write("test_images", idx_bytes(root.arrays["test_images"][:4]))
    return Refused(DataError, r"image and label counts differ: .*holds 4 images, .*holds 5 labels",
                   images_path, root.file("test_labels"))


# --- the file system ----------------------------------------------------------

@case("directory-instead-of-file")
def _(root):
    path = root.file("train_images")
    path.unlink()
    path.mkdir()
    return refused(path, r"is a directory, not an IDX file")


@case("fifo-instead-of-file")
def _(root):
    path = root.file("test_labels")
    path.unlink()
    os.mkfifo(path)
    return refused(path, r"is not a regular file \(a device, FIFO or socket\)")


@case("symlink-loop")
def _(root):
    path = root.file("test_images")
    path.unlink()
    os.symlink("loop-b", path)
    os.symlink(path.name, root.path / "loop-b")
    return refused(path, r"cannot read it: a loop of symbolic links")


@case("dangling-symlink")
def _(root):
    path = root.file("train_labels")
    path.unlink()
    os.symlink("/nonexistent/labels", path)
    return not_found(r"train-labels-idx1-ubyte \(or train-labels-idx1-ubyte.gz\) not found.*"
                     r"train-labels-idx1-ubyte is a symbolic link to /nonexistent/labels, which does not exist",
                     root.path)


@case("missing-one-file", gzipped=True)
def _(root):
    root.file("test_labels").unlink()
    return not_found(r"file t10k-labels-idx1-ubyte \(or t10k-labels-idx1-ubyte.gz\) not found in .* "
                     r"\(searched because of the root= argument; found: train-images-idx3-ubyte.gz, "
                     r"train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz\).*dataset-fashion-mnist",
                     root.path)


@case("missing-two-files")
def _(root):
    root.file("train_images").unlink()
    root.file("test_images").unlink()
    return not_found(r"files train-images-idx3-ubyte \(or train-images-idx3-ubyte.gz\), t10k-images-idx3-ubyte "
                     r"\(or t10k-images-idx3-ubyte.gz\) not found .*found: train-labels-idx1-ubyte, "
                     r"t10k-labels-idx1-ubyte\)", root.path)


@case("root-does-not-exist")
def _(root):
    for key in STEMS:
        root.file(key).unlink()
    root.path.rmdir()
    return not_found(r"Fashion-MNIST directory .* does not exist \(searched because of the root= argument\)",
                     root.path)


@case("root-is-a-file")
def _(root):
    for key in STEMS:
        root.file(key).unlink()
    root.path.rmdir()
    root.path.write_bytes(b"not a directory")
    return not_found(r"Fashion-MNIST directory .* is not a directory", root.path)


@case("raw-file-damaged-beside-a-good-gzip-one")
def _(root):
    (root.path / (STEMS["train_labels"] + ".gz")).write_bytes(root.gz("train_labels"))
    path = root.write("train_labels", root.content("train_labels")[:-1])
    return refused(path, r"need 12 bytes of data but the file has 11")


# --- well-formed roots: loaded bit for bit ------------------------------------

@case("valid-raw")
def _(root):
    return LOADS


@case("valid-gzip", gzipped=True)
def _(root):
    return LOADS


@case("valid-mixed-raw-and-gzip")
def _(root):
    root.write("train_images", root.content("train_images"), gzipped=True)
    root.write("test_labels", root.content("test_labels"), gzipped=True)
    return LOADS


@case("valid-gzip-with-every-header-field", gzipped=True)
def _(root):
    for key in STEMS:
        content = root.content(key)
        root.write_file(key, gzip_header(GZIP_FHCRC | GZIP_FEXTRA | GZIP_FNAME | GZIP_FCOMMENT)
                        + raw_deflate(content, level=9) + struct.pack("<II", zlib.crc32(content), len(content)))
    return LOADS


@case("valid-gzip-stored-blocks", gzipped=True)
def _(root):
    for key in STEMS:
        root.write_file(key, gzip_bytes(root.content(key), level=0))
    return LOADS


@case("valid-full-size-test-split")
def _(root):
    rng = np.random.default_rng(3)
    root.arrays["test_images"] = rng.integers(0, 256, size=(10000, 28, 28), dtype=np.uint8)
    root.arrays["test_labels"] = rng.integers(0, 10, size=10000).astype(np.uint8)
    root.write("test_images", root.content("test_images"))
    root.write("test_labels", root.content("test_labels"), gzipped=True)
    return LOADS


def test_enough_cases():
    malformed = [name for name in CASES if not name.startswith("valid-")]
    assert len(malformed) >= 40, len(malformed)


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_fashion_mnist_root(tmp_path, name):
    build, gzipped = CASES[name]
    root = Root(tmp_path / "fashion", gzipped)
    expected = build(root)
    if expected is LOADS:
        train_iter, test_iter = load_fashion_mnist(4, root=root.path)
        for X, y, split in ((train_iter.X, train_iter.y, "train"), (test_iter.X, test_iter.y, "test")):
            assert X.dtype == np.uint8 and X.shape[1:] == (1, 28, 28)
            assert X[:, 0].tobytes() == root.arrays[f"{split}_images"].tobytes()
            assert X.shape[0] == len(root.arrays[f"{split}_images"])
            assert y.dtype == np.int64
            np.testing.assert_array_equal(y, root.arrays[f"{split}_labels"].astype(np.int64))
        return
    with pytest.raises(expected.error) as info:
        load_fashion_mnist(4, root=root.path)
    if expected.error is FileNotFoundError:
        assert not isinstance(info.value, DataError)
    message = str(info.value)
    for name_in_message in expected.names:
        assert name_in_message in message, f"{name_in_message!r} not named in: {message}"
    assert re.search(expected.phrase, message), f"{expected.phrase!r} not found in: {message}"


def test_unreadable_file_is_a_data_error(tmp_path):
    """A file without read permission. Root reads any file, so as root the load
    runs in a subprocess that drops to user nobody (after importing dpcore,
    whose files nobody may not be able to read)."""
    with tempfile.TemporaryDirectory(prefix="dpcore-unreadable-") as directory:
        os.chmod(directory, 0o755)
        root = Root(pathlib.Path(directory) / "fashion", gzipped=False)
        os.chmod(root.path, 0o755)
        path = root.file("train_labels")
        os.chmod(path, 0)
        if os.geteuid() != 0:
            with pytest.raises(DataError) as info:
                load_fashion_mnist(4, root=root.path)
            message = str(info.value)
        else:
            script = textwrap.dedent(f"""
                import os
                import dpcore.data
                from dpcore.errors import DataError
                os.setgid(65534)
                os.setuid(65534)
                try:
                    dpcore.data.load_fashion_mnist(4, root={str(root.path)!r})
                    print("loaded")
                except DataError as exc:
                    print("DataError:", exc)
            """)
            result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
            assert result.returncode == 0, result.stderr
            message = result.stdout.strip()
            assert message.startswith("DataError:"), message
    assert str(path) in message and "cannot read it: permission denied" in message, message


# ---------------------------------------------------------------------------
# Peak memory, measured in a subprocess
# ---------------------------------------------------------------------------

_MEASURE = textwrap.dedent("""
    import json, resource, sys
    import dpcore.data as data
    from dpcore.errors import DataError

    def resident_now():
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * resource.getpagesize()

    def peak_resident():
        # VmHWM, the peak RSS of this process's memory. ru_maxrss would do where it
        # is reset below, but it also holds the peak of the image exec replaced,
        # which under vfork is the parent's (pytest with the bombs built).
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def reset_peak():
        # Linux resets the peak RSS to the current RSS on "5"; where it cannot,
        # the actions run in order of growing expected peak anyway.
        try:
            with open("/proc/self/clear_refs", "w") as clear_refs:
                clear_refs.write("5")
        except OSError:
            pass

    results = []
    for action in json.loads(sys.argv[1]):
        reset_peak()
        before = resident_now()  # the peak is at least this, so growth is never understated
        try:
            if action["call"] == "load":
                arrays = data._load_fashion_mnist_arrays(action["path"])
                outcome = "loaded " + " ".join(str(array.shape) for array in arrays)
                payload = sum(array.nbytes for array in arrays)
            else:
                arrays = [data.read_idx(action["path"], max_bytes=action["max_bytes"])]
                outcome, payload = f"loaded {arrays[0].shape} {arrays[0].dtype}", arrays[0].nbytes
        except DataError as exc:
            outcome, payload = f"DataError: {exc}", 0
        peak = peak_resident()
        results.append({"label": action["label"], "outcome": outcome, "payload": payload,
                        "growth": peak - before})
        arrays = None
        data._fashion_mnist_cache.clear()
    print(json.dumps(results))
""")


def measure_peak_rss(actions):
    """Run the actions one after another in a fresh process; for each, the growth
    of its peak RSS over its resident size before the action."""
    result = subprocess.run([sys.executable, "-c", _MEASURE, json.dumps(actions)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return {entry["label"]: entry for entry in json.loads(result.stdout.strip().splitlines()[-1])}


@pytest.fixture(scope="module")
def bombs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bombs")
    files = {}
    # The hostile tester's file: 1 MB of gzip whose header declares 1x32768x32768 and
    # which really inflates to those 1 GiB (zeros): valid IDX, absurd Fashion-MNIST.
    files["1MB-gzip-inflating-to-1GiB"] = gzip_zeros_bomb(idx_header(0x08, (1, 32768, 32768)), 1 << 30)
    # The same declaration over 1 MB of incompressible data: the trailer's size disagrees.
    noise = np.random.default_rng(5).integers(0, 256, size=1 << 20, dtype=np.uint8).tobytes()
    files["1MB-gzip-declaring-1GiB"] = gzip_bytes(idx_header(0x08, (1, 32768, 32768)) + noise, level=0)
    # ... with the trailer's size forged to agree, so the 1 GiB is allocated (untouched pages).
    forged = files["1MB-gzip-declaring-1GiB"]
    files["1MB-gzip-declaring-1GiB-forged-size"] = forged[:-4] + struct.pack("<I", (16 + (1 << 30)) % (1 << 32))
    # A file the size of the real training images (26 MB of gzip) declaring 26.9 GB: within
    # deflate's 1032:1 bound, so only the trailer or the limit can refuse it early.
    big_noise = np.random.default_rng(6).integers(0, 256, size=26 << 20, dtype=np.uint8).tobytes()
    files["26MB-gzip-declaring-27GB"] = gzip_bytes(idx_header(0x08, (60000, 28, 16000)) + big_noise, level=0)
    # Declares 10 images, inflates to 1 GiB.
    files["gzip-10-images-inflating-to-1GiB"] = gzip_zeros_bomb(
        idx_header(0x08, (10, 28, 28)) + bytes(7840), 1 << 30)
    files["raw-header-declaring-27GB"] = idx_header(0x08, (60000, 28, 16000)) + bytes(4096)
    # Valid files whose payload must be the only big allocation: 64 MiB of zeros in
    # 65 KB of gzip, and 32 MiB of big-endian int32 (swapped in place), raw and gzip.
    files["valid-gzip-64MiB"] = gzip_zeros_bomb(idx_header(0x08, (1, 8192, 8192)), 64 << 20)
    int32 = np.random.default_rng(7).integers(-2**31, 2**31, size=(8, 1 << 20), dtype=np.int64).astype(">i4")
    files["valid-raw-int32-32MiB"] = idx_bytes(int32)
    files["valid-gzip-int32-32MiB"] = gzip_bytes(idx_bytes(int32), level=0)
    paths = {}
    for label, content in files.items():
        paths[label] = str(directory / label)
        with open(paths[label], "wb") as file:
            file.write(content)
    # A Fashion-MNIST root whose training images are the 1 GiB bomb.
    fashion = Root(directory / "fashion-with-bomb", gzipped=True)
    fashion.write_file("train_images", files["1MB-gzip-inflating-to-1GiB"])
    paths["fashion-root-with-1GiB-bomb"] = str(fashion.path)
    fashion = Root(directory / "fashion-with-27GB", gzipped=True)
    fashion.write_file("train_images", files["26MB-gzip-declaring-27GB"])
    paths["fashion-root-with-27GB"] = str(fashion.path)
    return paths


def test_bombs_stay_within_a_small_bounded_memory(bombs):
    MiB = 1 << 20
    expectations = [
        # (label, file, call, max_bytes, expected outcome, allowed growth)
        ("fashion: 1 GiB bomb", "fashion-root-with-1GiB-bomb", "load", None,
         r"DataError: .*train-images-idx3-ubyte.gz: .*\(N, 28, 28\) .*shape \(1, 32768, 32768\)", 0),
        ("fashion: declares 27 GB", "fashion-root-with-27GB", "load", None,
         r"DataError: .*\(N, 28, 28\) .*shape \(60000, 28, 16000\)", 0),
        ("1 GiB bomb, 1 MiB limit", "1MB-gzip-inflating-to-1GiB", "read_idx", MiB,
         r"DataError: .*need 1073741824 bytes of data \(uint8\), above the limit of 1048576 bytes", 0),
        ("declares 1 GiB, holds 1 MiB", "1MB-gzip-declaring-1GiB", "read_idx", data.IDX_MAX_BYTES,
         r"DataError: .*need 1073741824 bytes of data but the file has 1048576 .*\(inflated\)", 0),
        ("declares 1 GiB, forged size", "1MB-gzip-declaring-1GiB-forged-size", "read_idx", data.IDX_MAX_BYTES,
         r"DataError: .*gzip size mismatch: the trailer records 1073741840 bytes .*inflates to 1048592", MiB),
        ("declares 27 GB, default limit", "26MB-gzip-declaring-27GB", "read_idx", data.IDX_MAX_BYTES,
         r"DataError: .*need 26880000000 bytes of data \(uint8\), above the limit of 2147483648", 0),
        ("declares 27 GB, no limit", "26MB-gzip-declaring-27GB", "read_idx", None,
         r"DataError: .*need 26880000000 bytes of data but the file has 27262976 .*\(inflated\)", 0),
        ("inflates 1 GiB past 10 images", "gzip-10-images-inflating-to-1GiB", "read_idx", data.IDX_MAX_BYTES,
         r"DataError: .*trailing bytes after the 7840-byte payload .*inflates to more", 0),
        ("raw declares 27 GB, no limit", "raw-header-declaring-27GB", "read_idx", None,
         r"DataError: .*need 26880000000 bytes of data but the file has 4096 after its 16-byte header", 0),
        ("valid 32 MiB raw int32", "valid-raw-int32-32MiB", "read_idx", data.IDX_MAX_BYTES,
         r"loaded \(8, 1048576\) int32", 32 * MiB),
        ("valid 32 MiB gzip int32", "valid-gzip-int32-32MiB", "read_idx", data.IDX_MAX_BYTES,
         r"loaded \(8, 1048576\) int32", 32 * MiB),
        ("valid 64 MiB gzip", "valid-gzip-64MiB", "read_idx", data.IDX_MAX_BYTES,
         r"loaded \(1, 8192, 8192\) uint8", 64 * MiB),
    ]
    actions = [{"label": label, "path": bombs[key], "call": call, "max_bytes": max_bytes}
               for label, key, call, max_bytes, _, _ in expectations]
    measured = measure_peak_rss(actions)
    report = []
    for label, _, _, _, outcome, payload in expectations:
        entry = measured[label]
        report.append(f"{label}: growth {entry['growth'] / MiB:.1f} MiB, {entry['outcome'][:150]}")
        assert re.search(outcome, entry["outcome"]), f"{label}: {entry['outcome']}"
        assert entry["growth"] <= payload + BOMB_RSS_BOUND, "\n".join(report)
    print("\n".join(report))


@pytest.mark.skipif(not os.path.isdir(REAL_FASHION_MNIST),
                    reason=f"Fashion-MNIST is not installed in {REAL_FASHION_MNIST} "
                           "(Debian package dataset-fashion-mnist; scripts/bootstrap.sh installs it)")
def test_real_fashion_mnist_loads_within_its_payload_plus_a_constant():
    measured = measure_peak_rss([{"label": "real", "path": REAL_FASHION_MNIST, "call": "load", "max_bytes": None}])
    entry = measured["real"]
    assert entry["outcome"] == "loaded (60000, 1, 28, 28) (60000,) (10000, 1, 28, 28) (10000,)", entry
    # 47 MB + 7.8 MB of images, 0.56 MB of int64 labels; the uint8 labels read on the way are freed.
    assert entry["payload"] == 60000 * 784 + 10000 * 784 + 70000 * 8
    assert entry["growth"] <= entry["payload"] + BOMB_RSS_BOUND, entry
