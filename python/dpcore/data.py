"""Datasets as numpy minibatch iterators: IDX files, Fashion-MNIST, in-memory arrays.

This module depends only on numpy and the standard library, never on the
compiled extension, so it can be imported and tested on its own.

    train_iter, test_iter = load_fashion_mnist(batch_size=256)
    for X, y in train_iter:      # X: (256, 1, 28, 28) uint8, y: (256,) int64
        ...

Images stay uint8 all the way to the device, where the core scales them by
1/255 (what torchvision's ``ToTensor`` does), so a batch crosses to the device
at a quarter of the float32 size.
"""

from __future__ import annotations

import gzip
import math
import numbers
import os
import struct
import zlib
from typing import Dict, Iterator, Optional, Tuple, Union

import numpy as np

from .errors import DataError

__all__ = ["read_idx", "load_fashion_mnist", "from_arrays", "ArrayIterator", "FASHION_MNIST_LABELS"]

PathLike = Union[str, "os.PathLike[str]"]

#: Text labels of the Fashion-MNIST classes, indexed by class number.
FASHION_MNIST_LABELS = (
    "t-shirt", "trouser", "pullover", "dress", "coat",
    "sandal", "shirt", "sneaker", "bag", "ankle boot",
)

DEFAULT_FASHION_MNIST_ROOT = "/usr/share/datasets/fashion-mnist"

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
# Deflate cannot expand data by more than about 1032:1, so a gzip file of M bytes
# inflates to at most this many times M. Checking a header's claimed size against
# that bound rejects an absurd header before any memory is allocated for it.
_DEFLATE_MAX_RATIO = 1032


# ---------------------------------------------------------------------------
# IDX files
# ---------------------------------------------------------------------------

def read_idx(path: PathLike) -> np.ndarray:
    """Read an IDX file (raw or gzip-compressed) into a numpy array.

    IDX is the format of the MNIST and Fashion-MNIST files: a 4-byte magic
    number (two zero bytes, a type code, the rank), one big-endian uint32 per
    dimension, then the elements in C order. Gzip compression is recognised by
    the file's first two bytes, not by its name.

    Args:
        path: the file to read.

    Returns:
        An array of shape ``dims`` (as given in the header) in native byte
        order: uint8 for type code 0x08 (the only one Fashion-MNIST uses), or
        int8, int16, int32, float32, float64 for 0x09, 0x0B, 0x0C, 0x0D, 0x0E.

    Raises:
        FileNotFoundError: the file does not exist.
        DataError: the file is not a well-formed IDX file; the message names the
            file and what is wrong (short header, bad magic number, unsupported
            type code or rank, payload size that does not match the
            dimensions, corrupted gzip stream).
    """
    name = os.fspath(path)
    with open(name, "rb") as file:
        file_size = os.fstat(file.fileno()).st_size
        is_gzip = file.read(len(_GZIP_MAGIC)) == _GZIP_MAGIC
        file.seek(0)
        if not is_gzip:
            return _read_idx_stream(file, name, file_size, compressed=False)
        try:
            with gzip.GzipFile(fileobj=file, mode="rb") as stream:
                return _read_idx_stream(stream, name, file_size, compressed=True)
        except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
            raise DataError(f"{name}: corrupted or truncated gzip stream ({exc})") from exc


def _read_idx_stream(stream, name: str, file_size: int, *, compressed: bool) -> np.ndarray:
    """Parse one IDX file from ``stream``; ``file_size`` is the size on disk."""
    element_type, dims = _read_idx_header(stream, name)
    header_size = 4 + 4 * len(dims)
    # Python integers cannot overflow, so a product of four uint32s is exact.
    payload_size = math.prod(dims) * element_type.itemsize

    # Reject a claimed size the file cannot possibly hold before allocating it.
    if compressed:
        max_inflated = file_size * _DEFLATE_MAX_RATIO
        if payload_size > max_inflated:
            raise DataError(
                f"{name}: dimensions {dims} need {payload_size} bytes of data but the "
                f"file has {file_size} gzip-compressed bytes, which inflate to at most "
                f"{max_inflated}")
    else:
        available = file_size - header_size
        if payload_size > available:
            raise DataError(
                f"{name}: dimensions {dims} need {payload_size} bytes of data but the "
                f"file has {available} after its {header_size}-byte header")
        if payload_size < available:
            raise DataError(
                f"{name}: {available - payload_size} trailing bytes after the "
                f"{payload_size}-byte payload that dimensions {dims} describe")

    payload = np.empty(payload_size, dtype=np.uint8)
    received = _read_into(stream, payload)
    if received < payload_size:
        raise DataError(
            f"{name}: dimensions {dims} need {payload_size} bytes of data but the "
            f"file has {received} after its {header_size}-byte header")
    # One byte is enough to tell; reading it also makes gzip verify its checksum.
    if stream.read(1):
        raise DataError(
            f"{name}: trailing bytes after the {payload_size}-byte payload that "
            f"dimensions {dims} describe")

    array = payload.view(element_type).reshape(dims)
    return array.astype(element_type.newbyteorder("="), copy=False)


def _read_idx_header(stream, name: str) -> Tuple[np.dtype, Tuple[int, ...]]:
    """Read and check the magic number and dimensions; return (element type, dims)."""
    magic = _read_exactly(stream, 4)
    if len(magic) < 4:
        raise DataError(
            f"{name}: too short for an IDX header: {len(magic)} bytes, the magic "
            f"number alone needs 4")
    if magic[0] != 0 or magic[1] != 0:
        raise DataError(
            f"{name}: bad magic number 0x{magic.hex()}: an IDX file starts with two "
            f"zero bytes (is this an IDX file?)")
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


def _read_into(stream, buffer: np.ndarray) -> int:
    """Fill the uint8 ``buffer`` from ``stream``; return how many bytes arrived."""
    view = memoryview(buffer)
    received = 0
    while received < len(view):
        count = stream.readinto(view[received:])
        if not count:
            break
        received += count
    return received


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
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
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
    X = np.asarray(X)
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
    y = np.asarray(y)
    if y.dtype.kind not in "iu":
        raise TypeError(f"y must have an integer dtype; got {y.dtype}")
    if y.ndim != 1:
        raise ValueError(f"y must have shape (N,); got shape {y.shape}")
    if y.dtype.kind == "i":
        negative = np.flatnonzero(y < 0)
        if negative.size:
            index = int(negative[0])
            raise ValueError(f"labels must be non-negative; got {y[index]} at index {index}")
    elif y.dtype == np.uint64:
        # Checked before the int64 conversion, which would wrap these to negative.
        too_large = np.flatnonzero(y > np.iinfo(np.int64).max)
        if too_large.size:
            index = int(too_large[0])
            raise ValueError(f"labels must fit in int64; got {y[index]} at index {index}")
    return np.ascontiguousarray(y, dtype=np.int64)


def _check_batch_size(batch_size) -> int:
    # bool is an int subclass, but batch_size=True is a mistake, not a 1.
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral):
        raise TypeError(f"batch_size must be an int; got {type(batch_size).__name__}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1; got {batch_size}")
    return int(batch_size)


def _check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an int or None; got {type(seed).__name__}")
    if seed < 0:
        raise ValueError(f"seed must be non-negative; got {seed}")
    return int(seed)


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
        FileNotFoundError: a file is missing; the message says where it was
            looked for and how to provide it.
        DataError: a file is malformed, labels are outside 0..9, or image and
            label counts differ.
    """
    _check_batch_size(batch_size)
    train_X, train_y, test_X, test_y = _load_fashion_mnist_arrays(root)
    train_iter = ArrayIterator(train_X, train_y, batch_size, shuffle=True, seed=seed)
    test_iter = ArrayIterator(test_X, test_y, batch_size, shuffle=False)
    return train_iter, test_iter


def _load_fashion_mnist_arrays(root: Optional[PathLike]) -> Tuple[np.ndarray, ...]:
    """Return (train images, train labels, test images, test labels), cached."""
    root_dir, root_source = _resolve_fashion_mnist_root(root)
    paths = {key: _find_idx_file(root_dir, root_source, stem)
             for key, stem in _FASHION_MNIST_FILES.items()}
    signature = tuple(_file_signature(path) for path in paths.values())
    cache_key = os.path.realpath(root_dir)
    cached = _fashion_mnist_cache.get(cache_key)
    if cached is not None and cached[0] == signature:
        return cached[1]

    train_X, train_y = _read_fashion_mnist_split(paths["train_images"], paths["train_labels"])
    test_X, test_y = _read_fashion_mnist_split(paths["test_images"], paths["test_labels"])
    if train_X.shape[1:] != test_X.shape[1:]:
        raise DataError(
            f"{paths['train_images']} holds images of shape {train_X.shape[2:]} but "
            f"{paths['test_images']} holds {test_X.shape[2:]}")
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


def _find_idx_file(root_dir: str, root_source: str, stem: str) -> str:
    """Path of ``stem`` or ``stem.gz`` in ``root_dir``, preferring the raw file."""
    for name in (stem, stem + ".gz"):
        path = os.path.join(root_dir, name)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"Fashion-MNIST file {stem} (or {stem}.gz) not found in {root_dir} "
        f"(searched because of {root_source}). Debian's dataset-fashion-mnist package "
        f"installs the four files in {DEFAULT_FASHION_MNIST_ROOT}; otherwise pass "
        f"root= or set DPCORE_DATA to a directory that holds them.")


def _read_fashion_mnist_split(images_path: str, labels_path: str) -> Tuple[np.ndarray, np.ndarray]:
    """Read and check one split: images (N, 1, H, W) uint8, labels (N,) int64."""
    images = read_idx(images_path)
    if images.ndim != 3 or images.dtype != np.uint8:
        raise DataError(
            f"{images_path}: Fashion-MNIST images must be a rank-3 (N, H, W) array of "
            f"unsigned bytes (IDX type 0x08); got rank {images.ndim}, shape "
            f"{images.shape}, dtype {images.dtype}")
    labels = read_idx(labels_path)
    if labels.ndim != 1 or labels.dtype != np.uint8:
        raise DataError(
            f"{labels_path}: Fashion-MNIST labels must be a rank-1 (N,) array of "
            f"unsigned bytes (IDX type 0x08); got rank {labels.ndim}, shape "
            f"{labels.shape}, dtype {labels.dtype}")
    out_of_range = np.flatnonzero(labels >= _NUM_FASHION_MNIST_CLASSES)
    if out_of_range.size:
        index = int(out_of_range[0])
        raise DataError(
            f"{labels_path}: label {labels[index]} at index {index} is outside "
            f"0..{_NUM_FASHION_MNIST_CLASSES - 1} ({out_of_range.size} labels out of range)")
    if len(images) != len(labels):
        raise DataError(
            f"image and label counts differ: {images_path} holds {len(images)} images, "
            f"{labels_path} holds {len(labels)} labels")
    return images[:, np.newaxis], labels.astype(np.int64)
