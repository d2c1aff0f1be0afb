"""Datasets as numpy minibatch iterators: IDX files, Fashion-MNIST, in-memory arrays.

This module depends only on numpy and the standard library, never on the
compiled extension, so it can be imported and tested on its own.

    train_iter, test_iter = load_fashion_mnist(batch_size=256)
    for X, y in train_iter:      # X: (256, 1, 28, 28) uint8, y: (256,) int64
        ...

Images stay uint8 all the way to the device, where the core scales them by
1/255 (what torchvision's ``ToTensor`` does), so a batch crosses to the device
at a quarter of the float32 size.

Reading a file never needs more memory than the payload its header declares
plus a constant (about 2 MiB): a declared size is checked against the file (its
length, the gzip trailer, deflate's expansion limit) and against a limit
before anything is allocated, and gzip data is inflated in bounded chunks
straight into the result.
"""

from __future__ import annotations

import errno
import io
import math
import os
import stat
import struct
import zlib
from typing import Callable, Dict, Iterator, Optional, Tuple, Union

import numpy as np

from . import _check
from .errors import DataError

__all__ = ["read_idx", "load_fashion_mnist", "from_arrays", "ArrayIterator", "FASHION_MNIST_LABELS",
           "IDX_MAX_BYTES"]

PathLike = Union[str, "os.PathLike[str]"]

#: Text labels of the Fashion-MNIST classes, indexed by class number.
FASHION_MNIST_LABELS = (
    "t-shirt", "trouser", "pullover", "dress", "coat",
    "sandal", "shirt", "sneaker", "bag", "ankle boot",
)

DEFAULT_FASHION_MNIST_ROOT = "/usr/share/datasets/fashion-mnist"

#: Largest payload (bytes) :func:`read_idx` accepts unless told otherwise
#: (``max_bytes``): 2 GiB, three times the largest IDX data set in use
#: (EMNIST ByClass, 814,255 images of 28x28 = 638 MB).
IDX_MAX_BYTES = 2 << 30

# IDX type code (third header byte) -> element type; multi-byte types are big-endian.
_IDX_DTYPES = {
    0x08: np.dtype("u1"),
    0x09: np.dtype("i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_IDX_MAX_RANK = 4
_GZIP_MAGIC = b"\x1f\x8b"
# Deflate cannot expand data by more than 1032:1 (a 258-byte match coded in 2
# bits), so a gzip file of M bytes inflates to at most this many times M.
_DEFLATE_MAX_RATIO = 1032
# gzip header flags (RFC 1952, 2.3.1); the top three bits are reserved, must be zero.
_GZIP_FHCRC, _GZIP_FEXTRA, _GZIP_FNAME, _GZIP_FCOMMENT, _GZIP_RESERVED = 0x02, 0x04, 0x08, 0x10, 0xE0
# Bounded chunks: compressed bytes read per step, inflated bytes produced per step.
_INFLATE_INPUT_CHUNK = 1 << 16
_INFLATE_OUTPUT_CHUNK = 1 << 20

# Called with (element type, dims) once a header is read and before its payload
# is allocated; raises DataError to refuse the file (load_fashion_mnist's checks).
HeaderCheck = Callable[[np.dtype, Tuple[int, ...]], None]


# ---------------------------------------------------------------------------
# IDX files
# ---------------------------------------------------------------------------

def read_idx(path: PathLike, *, max_bytes: Optional[int] = IDX_MAX_BYTES) -> np.ndarray:
    """Read an IDX file (raw or gzip-compressed) into a numpy array.

    IDX is the format of the MNIST and Fashion-MNIST files: a 4-byte magic
    number (two zero bytes, a type code, the rank), one big-endian uint32 per
    dimension, then the elements in C order. Gzip compression is recognised by
    the file's first two bytes, not by its name; the file must hold one gzip
    member (``cat a.gz b.gz`` is refused).

    Memory: at most the declared payload plus about 2 MiB. The declared size
    is checked against ``max_bytes``, the file's length (raw), deflate's
    1032:1 expansion limit and the size in the gzip trailer before the payload
    is allocated; gzip data is inflated in 1 MiB chunks straight into it.

    Args:
        path: the file to read.
        max_bytes: refuse a payload the header declares larger than this many
            bytes (default :data:`IDX_MAX_BYTES`, 2 GiB); None for no limit.

    Returns:
        An array of shape ``dims`` (as given in the header) in native byte
        order: uint8 for type code 0x08 (the only one Fashion-MNIST uses), or
        int8, int16, int32, float32, float64 for 0x09, 0x0B, 0x0C, 0x0D, 0x0E.

    Raises:
        FileNotFoundError: the file does not exist.
        DataError: the file cannot be read (a directory, no permission, a
            symlink loop) or is not a well-formed IDX file; the message names
            the file and what is wrong (short header, bad magic number,
            unsupported type code or rank, a declared size above ``max_bytes``
            or not matching the data, a truncated or corrupt gzip stream, a
            gzip CRC mismatch, several gzip members, trailing bytes).
    """
    path = _check.path("path", path)
    if max_bytes is not None:
        max_bytes = _check.integer("max_bytes", max_bytes, 1)
    return _read_idx_path(path, max_bytes, None)


def _read_idx_path(name: str, max_bytes: Optional[int], check_header: Optional[HeaderCheck]) -> np.ndarray:
    """read_idx, plus a check of the header before the payload is allocated."""
    try:
        _check_regular_file(name)
        with open(name, "rb") as file:
            return _read_idx_file(file, name, os.fstat(file.fileno()).st_size, max_bytes, check_header)
    except FileNotFoundError as exc:
        if os.path.islink(name):
            raise FileNotFoundError(
                exc.errno, f"{name}: is a symbolic link to {os.readlink(name)}, which does not exist",
                name) from exc
        raise
    except OSError as exc:
        raise DataError(f"{name}: cannot read it: {_describe_os_error(exc)}") from exc


def _check_regular_file(name: str) -> None:
    """A DataError unless ``name`` is a regular file (FileNotFoundError when it does not exist)."""
    try:
        status = os.stat(name)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise DataError(f"{name}: cannot read it: {_describe_os_error(exc)}") from exc
    if stat.S_ISDIR(status.st_mode):
        raise DataError(f"{name}: is a directory, not an IDX file")
    if not stat.S_ISREG(status.st_mode):
        raise DataError(f"{name}: is not a regular file (a device, FIFO or socket), not an IDX file")


def _describe_os_error(exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return "a loop of symbolic links (or too many levels of them)"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    return exc.strerror or str(exc)


def _read_idx_buffer(data: bytes, name: str = "<buffer>", max_bytes: Optional[int] = IDX_MAX_BYTES,
                     check_header: Optional[HeaderCheck] = None) -> np.ndarray:
    """read_idx on bytes already in memory (the fuzz harness's entry point)."""
    return _read_idx_file(io.BytesIO(data), name, len(data), max_bytes, check_header)


def _read_idx_file(file, name: str, file_size: int, max_bytes: Optional[int],
                   check_header: Optional[HeaderCheck]) -> np.ndarray:
    """Parse one IDX file from the binary ``file`` (positioned at its start) of ``file_size`` bytes."""
    if file_size == 0:
        raise DataError(f"{name}: is empty (0 bytes), too short for an IDX header")
    if file.read(len(_GZIP_MAGIC)) != _GZIP_MAGIC:
        file.seek(0)
        return _read_idx_stream(file, name, file_size, max_bytes, check_header, gzip_trailer_size=None)
    file.seek(max(file_size - 4, 0))
    trailer_size = int.from_bytes(file.read(4), "little")
    file.seek(0)
    member = _GzipMember(file, name, file_size)
    return _read_idx_stream(member, name, file_size, max_bytes, check_header, gzip_trailer_size=trailer_size)


def _read_idx_stream(stream, name: str, file_size: int, max_bytes: Optional[int],
                     check_header: Optional[HeaderCheck], gzip_trailer_size: Optional[int]) -> np.ndarray:
    """Parse the IDX header and payload from ``stream``: the file itself (raw,
    ``gzip_trailer_size`` None) or a :class:`_GzipMember` of it (the size its
    trailer records, the last 4 bytes of the file, given)."""
    element_type, dims = _read_idx_header(stream, name)
    header_size = 4 + 4 * len(dims)
    # Python integers cannot overflow, so a product of four uint32s is exact.
    payload_size = math.prod(dims) * element_type.itemsize
    if check_header is not None:
        check_header(element_type, dims)
    if max_bytes is not None and payload_size > max_bytes:
        raise DataError(
            f"{name}: dimensions {dims} need {payload_size} bytes of data ({element_type.name}), "
            f"above the limit of {max_bytes} bytes (read_idx's max_bytes)"
            f"{_signed_hint(dims)}")

    # numpy refuses a shape whose non-zero dimensions multiply past its index
    # range even when a zero dimension makes the array empty.
    shape_bytes = math.prod(dim for dim in dims if dim) * element_type.itemsize
    if payload_size == 0 and shape_bytes > np.iinfo(np.intp).max:
        raise DataError(
            f"{name}: dimensions {dims} describe an empty array that numpy cannot represent: "
            f"its non-zero dimensions span {shape_bytes} bytes, above {np.iinfo(np.intp).max}")

    compressed = gzip_trailer_size is not None
    if compressed:
        max_inflated = file_size * _DEFLATE_MAX_RATIO
        if payload_size > max_inflated:
            raise DataError(
                f"{name}: dimensions {dims} need {payload_size} bytes of data but the "
                f"file has {file_size} gzip-compressed bytes, which inflate to at most "
                f"{max_inflated}{_signed_hint(dims)}")
        # The trailer records the inflated length mod 2**32. When it disagrees with
        # the header the payload is not allocated: the data is inflated into a
        # scratch chunk to find out what is wrong (truncated, corrupt, too long).
        consistent = (header_size + payload_size) % (1 << 32) == gzip_trailer_size
    else:
        available = file_size - header_size
        if payload_size > available:
            raise DataError(
                f"{name}: dimensions {dims} need {payload_size} bytes of data but the "
                f"file has {available} after its {header_size}-byte header{_signed_hint(dims)}")
        if payload_size < available:
            raise DataError(
                f"{name}: {available - payload_size} trailing bytes after the "
                f"{payload_size}-byte payload that dimensions {dims} describe")
        consistent = True

    payload = np.empty(payload_size, dtype=np.uint8) if consistent else None
    received = _read_payload(stream, payload, payload_size)
    if received < payload_size:
        raise DataError(
            f"{name}: dimensions {dims} need {payload_size} bytes of data but the "
            f"file has {received} after its {header_size}-byte header"
            f"{' (inflated)' if compressed else ''}{_signed_hint(dims)}")
    # One byte is enough to tell; reading it also makes gzip verify its trailer.
    # (A raw file has been sized already: it only gets here if it grew while read.)
    if stream.read(1):
        if compressed:
            raise DataError(
                f"{name}: trailing bytes after the {payload_size}-byte payload that dimensions "
                f"{dims} describe: the gzip data inflates to more than the header declares")
        raise DataError(
            f"{name}: trailing bytes after the {payload_size}-byte payload that "
            f"dimensions {dims} describe")
    if payload is None:
        # Unreachable unless the file changed while being read: the stream ended
        # cleanly after exactly the declared payload, so the trailer agreed.
        raise DataError(f"{name}: its gzip trailer disagrees with its IDX header (was it modified while read?)")

    array = payload.view(element_type)
    if not element_type.isnative:
        array.byteswap(inplace=True)  # in place: no second copy of the payload
        array = array.view(element_type.newbyteorder("="))
    return array.reshape(dims)


def _signed_hint(dims: Tuple[int, ...]) -> str:
    """A hint for a dimension that reads as negative in two's complement."""
    negative = [dim for dim in dims if dim >= 1 << 31]
    if not negative:
        return ""
    return (f" (dimension {negative[0]} is {negative[0] - (1 << 32)} as a signed 32-bit "
            f"number: was the header written from a negative size?)")


def _read_idx_header(stream, name: str) -> Tuple[np.dtype, Tuple[int, ...]]:
    """Read and check the magic number and dimensions; return (element type, dims)."""
    magic = _read_exactly(stream, 4)
    if len(magic) < 4:
        raise DataError(
            f"{name}: too short for an IDX header: {len(magic)} bytes, the magic "
            f"number alone needs 4")
    if magic[0] != 0 or magic[1] != 0:
        hint = ("its inflated data is gzip again: compressed twice?" if magic[:2] == _GZIP_MAGIC
                else "is this an IDX file?")
        raise DataError(
            f"{name}: bad magic number 0x{magic.hex()}: an IDX file starts with two "
            f"zero bytes ({hint})")
    type_code, rank = magic[2], magic[3]
    element_type = _IDX_DTYPES.get(type_code)
    if element_type is None:
        supported = ", ".join(f"0x{code:02x} ({dtype.name})" for code, dtype in _IDX_DTYPES.items())
        raise DataError(f"{name}: unsupported IDX type code 0x{type_code:02x}; supported: {supported}")
    if not 1 <= rank <= _IDX_MAX_RANK:
        raise DataError(f"{name}: unsupported IDX rank {rank}; supported: 1 to {_IDX_MAX_RANK}")
    dim_bytes = _read_exactly(stream, 4 * rank)
    if len(dim_bytes) < 4 * rank:
        raise DataError(
            f"{name}: too short for an IDX header: rank {rank} needs {4 + 4 * rank} "
            f"header bytes, the file has {4 + len(dim_bytes)}")
    return element_type, struct.unpack(f">{rank}I", dim_bytes)


def _read_exactly(stream, size: int) -> bytes:
    """Read ``size`` bytes, fewer only at end of file (one ``read`` may return less)."""
    chunks = []
    remaining = size
    while remaining > 0:
        chunk = stream.read(remaining)
        if not chunk:
            break
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def _read_payload(stream, payload: Optional[np.ndarray], size: int) -> int:
    """Fill the uint8 ``payload`` (``size`` bytes) from ``stream``, or with None
    read ``size`` bytes into a scratch chunk and drop them; return how many arrived."""
    if payload is not None:
        view = memoryview(payload)
    else:
        scratch = memoryview(bytearray(min(size, _INFLATE_OUTPUT_CHUNK)))
    received = 0
    while received < size:
        if payload is not None:
            count = stream.readinto(view[received:])
        else:
            count = stream.readinto(scratch[:min(size - received, len(scratch))])
        if not count:
            break
        received += count
    return received


class _GzipMember:
    """The inflated content of a single-member gzip file, read in bounded chunks.

    ``read`` and ``readinto`` never inflate more than they are asked for (plus
    at most one 64 KiB chunk of compressed input held), so memory stays bounded
    whatever the stream would inflate to. At the end of the deflate data the
    trailer's CRC-32 and size are checked, and anything after it is refused.
    Every problem is a DataError naming the file.
    """

    def __init__(self, file, name: str, file_size: int):
        self._file = file
        self._name = name
        self._file_size = file_size
        self._read_header()
        self._inflater = zlib.decompressobj(-zlib.MAX_WBITS)  # raw deflate
        self._pending = b""  # compressed bytes read but not yet consumed
        self._input_ended = False
        self._crc = 0
        self._inflated = 0
        self._ended = False

    def read(self, size: int) -> bytes:
        buffer = bytearray(size)
        return bytes(buffer[:self.readinto(buffer)])

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        filled = 0
        while filled < len(view) and not self._ended:
            chunk = self._inflate(min(len(view) - filled, _INFLATE_OUTPUT_CHUNK))
            view[filled:filled + len(chunk)] = chunk
            filled += len(chunk)
        return filled

    def _inflate(self, limit: int) -> bytes:
        """Inflate up to ``limit`` bytes (possibly none, when zlib only consumed input)."""
        if not self._pending and not self._input_ended:
            self._pending = self._file.read(_INFLATE_INPUT_CHUNK)
            self._input_ended = not self._pending
        try:
            chunk = self._inflater.decompress(self._pending, limit)
        except zlib.error as exc:
            raise DataError(
                f"{self._name}: corrupt deflate stream in the gzip data after {self._inflated} "
                f"inflated bytes ({exc}): the file is damaged") from None
        self._pending = self._inflater.unconsumed_tail
        self._crc = zlib.crc32(chunk, self._crc)
        self._inflated += len(chunk)
        if self._inflater.eof:
            self._read_trailer(self._inflater.unused_data)
        elif not chunk and not self._pending and self._input_ended:
            raise DataError(
                f"{self._name}: truncated gzip stream: the file ends ({self._file_size} bytes) "
                f"before its deflate data does, after {self._inflated} inflated bytes")
        return chunk

    def _take(self, size: int, what: str) -> bytes:
        data = _read_exactly(self._file, size)
        if len(data) < size:
            raise DataError(f"{self._name}: truncated gzip header: the file ends inside its {what}")
        return data

    def _read_header(self) -> None:
        """Check the gzip header (RFC 1952, 2.3) and skip past it."""
        header = bytearray(self._take(10, "10-byte fixed part"))
        method, flags = header[2], header[3]
        if method != 8:
            raise DataError(
                f"{self._name}: bad gzip header: unsupported compression method {method} "
                f"(gzip defines only 8, deflate)")
        if flags & _GZIP_RESERVED:
            raise DataError(f"{self._name}: bad gzip header: reserved flag bits set (flags 0x{flags:02x})")
        if flags & _GZIP_FEXTRA:
            extra_length = self._take(2, "extra field length")
            header += extra_length + self._take(int.from_bytes(extra_length, "little"), "extra field")
        for flag, what in ((_GZIP_FNAME, "file name"), (_GZIP_FCOMMENT, "comment")):
            if flags & flag:
                while True:  # a zero-terminated string
                    byte = self._take(1, what)
                    header += byte
                    if byte == b"\x00":
                        break
        if flags & _GZIP_FHCRC:
            recorded = int.from_bytes(self._take(2, "header CRC"), "little")
            if recorded != zlib.crc32(header) & 0xFFFF:
                raise DataError(f"{self._name}: bad gzip header: its CRC-16 does not match (damaged header)")

    def _read_trailer(self, after_deflate: bytes) -> None:
        """Check CRC-32 and size after the deflate data; refuse anything after them."""
        self._ended = True
        trailer = after_deflate[:8] + _read_exactly(self._file, max(0, 8 - len(after_deflate)))
        if len(trailer) < 8:
            raise DataError(
                f"{self._name}: truncated gzip stream: the file ends inside the 8-byte trailer "
                f"(CRC-32 and size) after the deflate data")
        recorded_crc, recorded_size = struct.unpack("<II", trailer)
        if recorded_crc != self._crc:
            raise DataError(
                f"{self._name}: gzip CRC-32 mismatch: the trailer records 0x{recorded_crc:08x}, "
                f"the inflated data has 0x{self._crc:08x}: the file is damaged")
        if recorded_size != self._inflated % (1 << 32):
            raise DataError(
                f"{self._name}: gzip size mismatch: the trailer records {recorded_size} bytes "
                f"(mod 2**32), the data inflates to {self._inflated}: the file is damaged")
        rest = after_deflate[8:]
        end = self._file.tell() - len(rest)  # where the member ends in the file
        if end < self._file_size:
            following = (rest + self._file.read(2))[:2]
            if following == _GZIP_MAGIC:
                raise DataError(
                    f"{self._name}: holds several gzip members (files concatenated, as by "
                    f"`cat a.gz b.gz`); a second one starts at byte {end}. Only single-member "
                    f"files are read: recompress it (gzip -dc FILE | gzip > NEW)")
            raise DataError(
                f"{self._name}: {self._file_size - end} bytes of trailing garbage after the "
                f"end of the gzip stream at byte {end}")


# ---------------------------------------------------------------------------
# Minibatch iterator over in-memory arrays
# ---------------------------------------------------------------------------

class ArrayIterator:
    """Minibatches ``(X, y)`` over in-memory arrays, one epoch per ``iter()``.

    Attributes:
        X: examples, shape (N, C, H, W), dtype uint8 or float32, C-contiguous.
        y: labels, shape (N,), int64, C-contiguous.
        batch_size: examples per batch; the last batch of an epoch may be
            smaller (unless ``drop_last``).
        shuffle: whether each epoch visits the examples in a new random order.
        seed: the seed of the shuffles (None when not shuffling). Epoch ``e``
            uses the permutation of ``np.random.default_rng([seed, e])``, so a
            run is reproducible from this attribute alone.
        drop_last: whether an incomplete last batch is left out.
        num_examples: N.

    Batches are C-contiguous: views into ``X`` and ``y`` when not shuffling,
    copies of the gathered rows when shuffling.
    """

    def __init__(self, X, y, batch_size: int, shuffle: bool = False,
                 seed: Optional[int] = None, drop_last: bool = False):
        self.X = _as_examples(X)
        self.y = _as_labels(y)
        if len(self.X) != len(self.y):
            raise ValueError(
                f"X and y must have the same length; got {len(self.X)} examples "
                f"and {len(self.y)} labels")
        self.batch_size = _check_batch_size(batch_size)
        self.shuffle = _check.boolean("shuffle", shuffle)
        self.drop_last = _check.boolean("drop_last", drop_last)
        # a drawn seed differs between the processes of a job: dp.train gives
        # them rank 0's (a seed the user chose is theirs to keep equal)
        self.seed_drawn = seed is None and self.shuffle
        if seed is not None:
            seed = _check_seed(seed)
        elif self.shuffle:
            # Drawn once, so the shuffles stay reproducible through self.seed.
            seed = int(np.random.SeedSequence().entropy)
        self.seed = seed
        self.num_examples = len(self.X)
        self._epochs_started = 0

    @property
    def image_shape(self) -> Tuple[int, int, int]:
        """Shape of one example, (C, H, W)."""
        return tuple(self.X.shape[1:])

    @property
    def dtype(self) -> np.dtype:
        """Element type of the examples (uint8 or float32)."""
        return self.X.dtype

    def __len__(self) -> int:
        """Number of batches per epoch."""
        if self.drop_last:
            return self.num_examples // self.batch_size
        return -(-self.num_examples // self.batch_size)

    def __iter__(self) -> Iterator[Tuple[np.ndarray, np.ndarray]]:
        """Start the next epoch: yield ``len(self)`` batches ``(X, y)``."""
        # The epoch number advances here, not lazily on the first next(), so that
        # every iter() call is one epoch whether or not it is consumed.
        epoch = self._epochs_started
        self._epochs_started += 1
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)
            return self._shuffled_batches(order)
        return self._sequential_batches()

    def index_batches(self) -> Iterator[np.ndarray]:
        """Start the next epoch as ``iter()`` does, yielding each batch's example
        indices (int64) instead of the examples: the same batches in the same
        order. For data resident on a device (``dp.train(..., resident=True)``),
        where only the indices need to travel."""
        epoch = self._epochs_started
        self._epochs_started += 1
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_examples).astype(np.int64)
            return (order[start:start + self.batch_size] for start in self._batch_starts())
        return (np.arange(start, min(start + self.batch_size, self.num_examples), dtype=np.int64)
                for start in self._batch_starts())

    def _batch_starts(self) -> range:
        return range(0, len(self) * self.batch_size, self.batch_size)

    def _sequential_batches(self) -> Iterator[Tuple[np.ndarray, np.ndarray]]:
        for start in self._batch_starts():
            stop = start + self.batch_size
            yield self.X[start:stop], self.y[start:stop]

    def _shuffled_batches(self, order: np.ndarray) -> Iterator[Tuple[np.ndarray, np.ndarray]]:
        for start in self._batch_starts():
            indices = order[start:start + self.batch_size]
            yield np.take(self.X, indices, axis=0), np.take(self.y, indices)

    def __repr__(self) -> str:
        return (
            f"ArrayIterator(num_examples={self.num_examples}, image_shape={self.image_shape}, "
            f"dtype={self.dtype}, batch_size={self.batch_size}, shuffle={self.shuffle}, "
            f"seed={self.seed}, drop_last={self.drop_last})")


def from_arrays(X, y, batch_size: int, shuffle: bool = False, seed: Optional[int] = None,
                drop_last: bool = False) -> ArrayIterator:
    """Minibatches over in-memory arrays (the book's ``load_array``).

    Args:
        X: examples, shape (N, C, H, W), or (N, H, W) which gets a channel axis
            (N, 1, H, W). dtype uint8 or float32 is kept; float16 and float64
            are converted to float32 once, here.
        y: labels, shape (N,), any integer dtype, non-negative; kept as int64.
        batch_size: positive int.
        shuffle: visit the examples in a new random order each epoch.
        seed: non-negative int seeding the shuffles; None draws one (stored in
            the iterator's ``seed``).
        drop_last: leave out an incomplete last batch.

    Returns:
        An :class:`ArrayIterator`; each ``iter()`` of it is one epoch.

    Raises:
        TypeError: a dtype or argument type that is not accepted.
        ValueError: a wrong shape, mismatched lengths, a negative label, a
            batch size below 1.
    """
    return ArrayIterator(X, y, batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last)


_KEPT_EXAMPLE_DTYPES = (np.dtype(np.uint8), np.dtype(np.float32))
_FLOAT32_CONVERTED_DTYPES = (np.dtype(np.float16), np.dtype(np.float64))


def _as_examples(X) -> np.ndarray:
    """Check the examples and return them as a C-contiguous (N, C, H, W) array."""
    if X is None or isinstance(X, (str, bytes)):
        raise TypeError(f"X must be an array of examples, got {type(X).__name__} {_check.shown(X)}")
    X = np.asarray(X)
    if X.dtype.kind == "f" and not X.dtype.isnative:  # big-endian float32 is float32: kept, in native order
        X = X.astype(X.dtype.newbyteorder("="))
    if X.dtype in _FLOAT32_CONVERTED_DTYPES:
        X = X.astype(np.float32)
    elif X.dtype not in _KEPT_EXAMPLE_DTYPES:
        raise TypeError(
            f"X must have dtype uint8 or float32 (float16 and float64 are converted "
            f"to float32); got {X.dtype}")
    if X.ndim == 3:
        X = X[:, np.newaxis]
    elif X.ndim != 4:
        raise ValueError(f"X must have shape (N, C, H, W) or (N, H, W); got shape {X.shape}")
    return np.ascontiguousarray(X)


def _as_labels(y) -> np.ndarray:
    """Check the labels and return them as a C-contiguous int64 (N,) array."""
    if y is None or isinstance(y, (str, bytes)):
        raise TypeError(f"y must be an array of integer labels, got {type(y).__name__} {_check.shown(y)}")
    y = np.asarray(y)
    if y.dtype.kind not in "iu":
        raise TypeError(f"y must have an integer dtype; got {y.dtype}")
    if y.ndim != 1:
        raise ValueError(f"y must have shape (N,); got shape {y.shape}")
    if y.dtype.kind == "i":
        negative = np.flatnonzero(y < 0)
        if negative.size:
            index = int(negative[0])
            raise ValueError(f"y: labels must be non-negative; got {y[index]} at index {index}")
    elif y.dtype == np.uint64:
        # Checked before the int64 conversion, which would wrap these to negative.
        too_large = np.flatnonzero(y > np.iinfo(np.int64).max)
        if too_large.size:
            index = int(too_large[0])
            raise ValueError(f"y: labels must fit in int64; got {y[index]} at index {index}")
    return np.ascontiguousarray(y, dtype=np.int64)


def _check_batch_size(batch_size) -> int:
    return _check.integer("batch_size", batch_size, 1, _check.MAX_BATCH)


def _check_seed(seed) -> int:
    return _check.integer("seed", seed, 0)


# ---------------------------------------------------------------------------
# Fashion-MNIST
# ---------------------------------------------------------------------------

_FASHION_MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
_NUM_FASHION_MNIST_CLASSES = len(FASHION_MNIST_LABELS)
#: Shape of a Fashion-MNIST image, and the examples in each split of the data set.
FASHION_MNIST_IMAGE_SHAPE = (28, 28)
FASHION_MNIST_SPLIT_SIZES = {"train": 60000, "test": 10000}

# Decoded arrays per real root path: (files signature, (train X, train y, test X, test y)).
# The signature (paths, mtimes, sizes) makes a changed file reload; keying by root
# alone keeps one entry per root instead of one per version of its files.
_fashion_mnist_cache: Dict[str, Tuple[tuple, Tuple[np.ndarray, ...]]] = {}


def load_fashion_mnist(batch_size: int, root: Optional[PathLike] = None, *,
                       seed: int = 0) -> Tuple[ArrayIterator, ArrayIterator]:
    """Fashion-MNIST as minibatch iterators (the book's ``load_data_fashion_mnist``).

    The files are looked up in ``root``, else in the directory named by the
    ``DPCORE_DATA`` environment variable, else in
    ``/usr/share/datasets/fashion-mnist`` (Debian's ``dataset-fashion-mnist``
    package). Each of the four IDX files may be raw or ``.gz``; the raw one is
    used when both exist. Decoded arrays are cached per root (reloaded when a
    file changes), so a second call is instant; they are shared read-only by
    the iterators of all calls.

    The files must have Fashion-MNIST's layout: images of 28x28 unsigned
    bytes, labels unsigned bytes in 0..9, as many labels as images, at least
    one and at most 60000 examples for training and 10000 for testing (a
    subset of the data set is accepted). Each header is checked before its
    payload is read, so a damaged file costs no more memory than a real one.

    Args:
        batch_size: examples per batch (positive int).
        root: directory holding the four IDX files.
        seed: seed of the training set's shuffles (epoch ``e`` uses
            ``np.random.default_rng([seed, e])``); fixed by default so runs
            are reproducible.

    Returns:
        ``(train_iter, test_iter)``: :class:`ArrayIterator` s yielding images
        (batch, 1, 28, 28) uint8 and labels (batch,) int64 in 0..9. The
        training iterator shuffles every epoch, the test iterator does not.
        Neither drops the last, smaller batch.

    Raises:
        FileNotFoundError: the directory or files are missing; the message
            names every missing file, where it was looked for and how to
            provide it.
        DataError: a file is unreadable or malformed (see :func:`read_idx`),
            or does not have Fashion-MNIST's layout: a wrong rank, type or
            image size, too many or no examples, labels outside 0..9, image
            and label counts that differ. The message names the file.
    """
    _check_batch_size(batch_size)
    _check_seed(seed)
    if root is not None:
        root = _check.path("root", root)
    train_X, train_y, test_X, test_y = _load_fashion_mnist_arrays(root)
    train_iter = ArrayIterator(train_X, train_y, batch_size, shuffle=True, seed=seed)
    test_iter = ArrayIterator(test_X, test_y, batch_size, shuffle=False)
    return train_iter, test_iter


def _load_fashion_mnist_arrays(root: Optional[PathLike]) -> Tuple[np.ndarray, ...]:
    """Return (train images, train labels, test images, test labels), cached."""
    root_dir, root_source = _resolve_fashion_mnist_root(root)
    paths = _find_fashion_mnist_files(root_dir, root_source)
    signature = tuple(_file_signature(path) for path in paths.values())
    cache_key = os.path.realpath(root_dir)
    cached = _fashion_mnist_cache.get(cache_key)
    if cached is not None and cached[0] == signature:
        return cached[1]

    train_X, train_y = _read_fashion_mnist_split("train", paths["train_images"], paths["train_labels"])
    test_X, test_y = _read_fashion_mnist_split("test", paths["test_images"], paths["test_labels"])
    arrays = (train_X, train_y, test_X, test_y)
    # Read-only, since every iterator of every call shares these arrays.
    for array in arrays:
        array.flags.writeable = False
    _fashion_mnist_cache[cache_key] = (signature, arrays)
    return arrays


def _resolve_fashion_mnist_root(root: Optional[PathLike]) -> Tuple[str, str]:
    """Return the data directory and where it came from (for error messages)."""
    if root is not None:
        return os.fspath(root), "the root= argument"
    from_environment = os.environ.get("DPCORE_DATA")
    if from_environment:
        return from_environment, "the DPCORE_DATA environment variable"
    return DEFAULT_FASHION_MNIST_ROOT, "the default location"


def _file_signature(path: str) -> Tuple[str, int, int]:
    """(path, mtime, size): changes when the file is replaced or rewritten."""
    status = os.stat(path)
    return path, status.st_mtime_ns, status.st_size


def _find_fashion_mnist_files(root_dir: str, root_source: str) -> Dict[str, str]:
    """Path of each Fashion-MNIST file (raw preferred over .gz) in ``root_dir``."""
    how_to_provide = (
        f"Debian's dataset-fashion-mnist package installs the four files in "
        f"{DEFAULT_FASHION_MNIST_ROOT}; otherwise pass root= or set DPCORE_DATA to a "
        f"directory that holds them.")
    if not os.path.isdir(root_dir):
        what = "is not a directory" if os.path.exists(root_dir) else "does not exist"
        raise FileNotFoundError(
            f"Fashion-MNIST directory {root_dir} {what} (searched because of {root_source}). "
            f"{how_to_provide}")
    paths, missing, notes = {}, [], []
    for key, stem in _FASHION_MNIST_FILES.items():
        path = _find_idx_file(root_dir, stem, notes)
        if path is None:
            missing.append(f"{stem} (or {stem}.gz)")
        else:
            paths[key] = path
    if missing:
        found = ", ".join(os.path.basename(path) for path in paths.values()) or "none of the four"
        raise FileNotFoundError(
            f"Fashion-MNIST file{'s' if len(missing) > 1 else ''} {', '.join(missing)} not found "
            f"in {root_dir} (searched because of {root_source}; found: {found})"
            f"{''.join('; ' + note for note in notes)}. {how_to_provide}")
    return paths


def _find_idx_file(root_dir: str, stem: str, notes: list) -> Optional[str]:
    """Path of ``stem`` or ``stem.gz`` in ``root_dir`` (the raw one first), None
    when neither exists; a dangling symbolic link adds a line to ``notes``.
    Something there that is not a readable regular file is a DataError."""
    for name in (stem, stem + ".gz"):
        path = os.path.join(root_dir, name)
        try:
            _check_regular_file(path)
        except FileNotFoundError:
            if os.path.islink(path):
                notes.append(f"{name} is a symbolic link to {os.readlink(path)}, which does not exist")
            continue
        return path
    return None


def _read_fashion_mnist_split(split: str, images_path: str, labels_path: str) -> Tuple[np.ndarray, np.ndarray]:
    """Read and check one split: images (N, 1, 28, 28) uint8, labels (N,) int64.

    The labels are read first; the images' header must then declare as many
    images as there are labels, before any image is allocated."""
    max_count = FASHION_MNIST_SPLIT_SIZES[split]
    height, width = FASHION_MNIST_IMAGE_SHAPE

    def check_labels(element_type, dims):
        if len(dims) != 1 or element_type != np.uint8:
            raise DataError(
                f"{labels_path}: Fashion-MNIST labels must be a rank-1 (N,) array of "
                f"unsigned bytes (IDX type 0x08); the header declares rank {len(dims)}, "
                f"shape {dims}, dtype {element_type.name}")
        if not 1 <= dims[0] <= max_count:
            raise DataError(
                f"{labels_path}: declares {dims[0]} labels; a Fashion-MNIST {split} split holds "
                f"1 to {max_count}{_signed_hint(dims)}")

    labels = _read_idx_path(labels_path, None, check_labels)
    out_of_range = np.flatnonzero(labels >= _NUM_FASHION_MNIST_CLASSES)
    if out_of_range.size:
        index = int(out_of_range[0])
        raise DataError(
            f"{labels_path}: label {labels[index]} at index {index} is outside "
            f"0..{_NUM_FASHION_MNIST_CLASSES - 1} ({out_of_range.size} labels out of range)")

    def check_images(element_type, dims):
        if len(dims) != 3 or element_type != np.uint8 or dims[1:] != FASHION_MNIST_IMAGE_SHAPE:
            raise DataError(
                f"{images_path}: Fashion-MNIST images must be a rank-3 (N, {height}, {width}) array "
                f"of unsigned bytes (IDX type 0x08); the header declares rank {len(dims)}, "
                f"shape {dims}, dtype {element_type.name}{_signed_hint(dims)}")
        if dims[0] != len(labels):
            raise DataError(
                f"image and label counts differ: {images_path} holds {dims[0]} images, "
                f"{labels_path} holds {len(labels)} labels{_signed_hint(dims)}")

    images = _read_idx_path(images_path, None, check_images)
    return images[:, np.newaxis], labels.astype(np.int64)
