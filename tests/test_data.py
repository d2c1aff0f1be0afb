"""Tests of dpcore.data: IDX parsing, Fashion-MNIST loading, array iterators.

dpcore.data needs only numpy, so none of these tests needs the compiled core.
"""

import gzip
import os
import re
import struct

import numpy as np
import pytest

import dpcore.data as data
from dpcore.data import FASHION_MNIST_LABELS, ArrayIterator, from_arrays, load_fashion_mnist, read_idx
from dpcore.errors import DataError

REAL_FASHION_MNIST = "/usr/share/datasets/fashion-mnist"

TYPE_CODES = {
    np.dtype("u1"): 0x08, np.dtype("i1"): 0x09, np.dtype(">i2"): 0x0B,
    np.dtype(">i4"): 0x0C, np.dtype(">f4"): 0x0D, np.dtype(">f8"): 0x0E,
}


# ---------------------------------------------------------------------------
# Helpers: build IDX files byte by byte
# ---------------------------------------------------------------------------

def idx_header(type_code, dims):
    return bytes([0, 0, type_code, len(dims)]) + struct.pack(f">{len(dims)}I", *dims)


def idx_bytes(array):
    """A well-formed IDX file holding ``array``."""
    big_endian = array.astype(array.dtype.newbyteorder(">"))
    return idx_header(TYPE_CODES[big_endian.dtype], array.shape) + big_endian.tobytes()


def write_file(path, content, gzipped=False):
    path.write_bytes(gzip.compress(content, mtime=0) if gzipped else content)
    return path


def raises_data_error(path, phrase):
    """Expect a DataError whose message names ``path`` and then matches ``phrase``."""
    return pytest.raises(DataError, match=re.escape(str(path)) + ".*" + phrase)


gzip_or_raw = pytest.mark.parametrize("gzipped", [False, True], ids=["raw", "gzip"])


# ---------------------------------------------------------------------------
# read_idx: well-formed files
# ---------------------------------------------------------------------------

@gzip_or_raw
def test_read_idx_round_trip(tmp_path, gzipped):
    images = np.random.default_rng(0).integers(0, 256, size=(5, 4, 3), dtype=np.uint8)
    path = write_file(tmp_path / "images", idx_bytes(images), gzipped)
    loaded = read_idx(path)
    assert loaded.dtype == np.uint8
    np.testing.assert_array_equal(loaded, images)


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.float32, np.float64])
def test_read_idx_other_types_come_back_in_native_byte_order(tmp_path, dtype):
    values = np.arange(-6, 6).astype(dtype).reshape(3, 4)
    loaded = read_idx(write_file(tmp_path / "values", idx_bytes(values)))
    assert loaded.dtype == np.dtype(dtype)  # native, not big-endian
    np.testing.assert_array_equal(loaded, values)


def test_read_idx_detects_gzip_by_content_not_by_name(tmp_path):
    labels = np.arange(10, dtype=np.uint8)
    compressed_without_suffix = write_file(tmp_path / "labels", idx_bytes(labels), gzipped=True)
    raw_with_suffix = write_file(tmp_path / "labels.gz", idx_bytes(labels), gzipped=False)
    np.testing.assert_array_equal(read_idx(compressed_without_suffix), labels)
    np.testing.assert_array_equal(read_idx(raw_with_suffix), labels)


@gzip_or_raw
def test_read_idx_zero_dimension_gives_empty_array(tmp_path, gzipped):
    path = write_file(tmp_path / "empty", idx_header(0x08, (0, 28, 28)), gzipped)
    loaded = read_idx(path)
    assert loaded.shape == (0, 28, 28)
    assert loaded.dtype == np.uint8


def test_read_idx_accepts_str_path(tmp_path):
    labels = np.arange(3, dtype=np.uint8)
    path = write_file(tmp_path / "labels", idx_bytes(labels))
    np.testing.assert_array_equal(read_idx(str(path)), labels)


# ---------------------------------------------------------------------------
# read_idx: malformed files, each a DataError naming the file and the problem
# ---------------------------------------------------------------------------

def test_read_idx_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-file"):
        read_idx(tmp_path / "no-such-file")


@gzip_or_raw
@pytest.mark.parametrize("content", [
    b"",
    b"\x00\x00",
    b"\x00\x00\x08\x03" + struct.pack(">I", 60000),  # rank 3 but only one dimension
], ids=["empty", "half-magic", "missing-dimensions"])
def test_read_idx_too_short_for_header(tmp_path, gzipped, content):
    path = write_file(tmp_path / "short", content, gzipped)
    with raises_data_error(path, "too short for an IDX header"):
        read_idx(path)


@gzip_or_raw
def test_read_idx_bad_magic(tmp_path, gzipped):
    path = write_file(tmp_path / "not-idx", b"\x01\x00\x08\x01" + struct.pack(">I", 1) + b"\x00", gzipped)
    with raises_data_error(path, "bad magic number 0x01000801"):
        read_idx(path)


@gzip_or_raw
@pytest.mark.parametrize("type_code", [0x00, 0x0A, 0x0F, 0xFF])
def test_read_idx_unsupported_type_code(tmp_path, gzipped, type_code):
    path = write_file(tmp_path / "odd-type", idx_header(type_code, (1,)) + b"\x00" * 8, gzipped)
    with raises_data_error(path, f"unsupported IDX type code 0x{type_code:02x}"):
        read_idx(path)


@gzip_or_raw
@pytest.mark.parametrize("rank", [0, 5, 255])
def test_read_idx_unsupported_rank(tmp_path, gzipped, rank):
    path = write_file(tmp_path / "odd-rank", idx_header(0x08, (1,) * rank) + b"\x00", gzipped)
    with raises_data_error(path, f"unsupported IDX rank {rank}"):
        read_idx(path)


@gzip_or_raw
def test_read_idx_truncated_payload(tmp_path, gzipped):
    path = write_file(tmp_path / "truncated", idx_header(0x08, (2, 3, 4)) + b"\x00" * 23, gzipped)
    with raises_data_error(path, re.escape("dimensions (2, 3, 4) need 24 bytes of data but the file has 23")):
        read_idx(path)


def test_read_idx_truncated_multibyte_payload(tmp_path):
    # 3 int32 need 12 bytes; the size check counts bytes, not elements.
    path = write_file(tmp_path / "truncated", idx_header(0x0C, (3,)) + b"\x00" * 11)
    with raises_data_error(path, "need 12 bytes of data but the file has 11"):
        read_idx(path)


@gzip_or_raw
def test_read_idx_trailing_bytes(tmp_path, gzipped):
    path = write_file(tmp_path / "trailing", idx_header(0x08, (2, 3)) + b"\x00" * 7, gzipped)
    with raises_data_error(path, "trailing bytes after the 6-byte payload"):
        read_idx(path)


def test_read_idx_gzip_stops_reading_after_the_claimed_size(tmp_path):
    # 16 MiB of zeros compress to ~16 KiB; the header claims 10 bytes. Only one byte
    # past the claim is read, so this fails fast instead of inflating everything.
    path = write_file(tmp_path / "bomb", idx_header(0x08, (10,)) + bytes(16 << 20), gzipped=True)
    with raises_data_error(path, "trailing bytes"):
        read_idx(path)


@gzip_or_raw
def test_read_idx_absurd_dimensions_rejected_before_allocating(tmp_path, gzipped):
    # (2**32 - 1) ** 4 bytes overflows int64; it must be a DataError, not a MemoryError.
    dims = (2**32 - 1,) * 4
    path = write_file(tmp_path / "huge", idx_header(0x08, dims) + b"\x00" * 16, gzipped)
    with raises_data_error(path, re.escape(f"dimensions {dims} need {(2**32 - 1) ** 4} bytes")):
        read_idx(path)


def corrupt_gzip(kind):
    payload = np.random.default_rng(1).integers(0, 256, size=(4, 16, 16), dtype=np.uint8)
    compressed = bytearray(gzip.compress(idx_bytes(payload), mtime=0))
    if kind == "truncated-stream":
        return bytes(compressed[:-20])
    if kind == "bad-crc":
        compressed[-8] ^= 0xFF  # first byte of the CRC-32 trailer
    elif kind == "bad-deflate-data":
        compressed[10:30] = b"\xff" * 20  # just past the 10-byte gzip header
    elif kind == "bad-compression-method":
        compressed[2] = 0x07  # only 8 (deflate) exists
    return bytes(compressed)


@pytest.mark.parametrize("kind, phrase", [
    ("truncated-stream", "truncated gzip stream"),
    ("bad-crc", "gzip CRC-32 mismatch"),
    ("bad-deflate-data", "corrupt deflate stream"),
    ("bad-compression-method", "unsupported compression method 7"),
])
def test_read_idx_corrupted_gzip(tmp_path, kind, phrase):
    path = write_file(tmp_path / "corrupt.gz", corrupt_gzip(kind))
    with raises_data_error(path, phrase):
        read_idx(path)


# ---------------------------------------------------------------------------
# load_fashion_mnist on small synthetic files
# ---------------------------------------------------------------------------

def make_fashion_root(root, num_train=20, num_test=7, image_size=(28, 28), gzipped=False,
                      train_labels=None):
    """Write the four Fashion-MNIST files with synthetic content into ``root``."""
    rng = np.random.default_rng(num_train)
    root.mkdir(parents=True, exist_ok=True)
    suffix = ".gz" if gzipped else ""
    if train_labels is None:
        train_labels = np.arange(num_train) % 10
    splits = {"train": (num_train, train_labels), "t10k": (num_test, np.arange(num_test) % 10)}
    for prefix, (count, labels) in splits.items():
        images = rng.integers(0, 256, size=(count, *image_size), dtype=np.uint8)
        write_file(root / f"{prefix}-images-idx3-ubyte{suffix}", idx_bytes(images), gzipped)
        write_file(root / f"{prefix}-labels-idx1-ubyte{suffix}",
                   idx_bytes(np.asarray(labels, dtype=np.uint8)), gzipped)
    return root


@gzip_or_raw
def test_load_fashion_mnist_synthetic(tmp_path, gzipped):
    root = make_fashion_root(tmp_path / "fashion", gzipped=gzipped)
    train_iter, test_iter = load_fashion_mnist(8, root=root)
    assert (train_iter.num_examples, test_iter.num_examples) == (20, 7)
    assert (len(train_iter), len(test_iter)) == (3, 1)
    assert train_iter.shuffle and not test_iter.shuffle
    assert train_iter.image_shape == (1, 28, 28)
    X, y = next(iter(test_iter))
    assert X.shape == (7, 1, 28, 28) and X.dtype == np.uint8
    assert y.dtype == np.int64
    np.testing.assert_array_equal(y, np.arange(7) % 10)
    expected_images = read_idx(root / ("t10k-images-idx3-ubyte" + (".gz" if gzipped else "")))
    np.testing.assert_array_equal(X[:, 0], expected_images)


def test_load_fashion_mnist_prefers_the_raw_file(tmp_path):
    root = make_fashion_root(tmp_path / "fashion", num_train=20)
    # A .gz beside the raw file, with other content: the raw file must win.
    write_file(root / "train-labels-idx1-ubyte.gz", idx_bytes(np.zeros(20, np.uint8)), gzipped=True)
    train_iter, _ = load_fashion_mnist(8, root=root)
    np.testing.assert_array_equal(train_iter.y, np.arange(20) % 10)


def test_load_fashion_mnist_labels_outside_0_to_9(tmp_path):
    labels = np.arange(20) % 10
    labels[13] = 10
    root = make_fashion_root(tmp_path / "fashion", train_labels=labels)
    labels_path = root / "train-labels-idx1-ubyte"
    with raises_data_error(labels_path, "label 10 at index 13 is outside 0..9"):
        load_fashion_mnist(8, root=root)


def test_load_fashion_mnist_count_mismatch(tmp_path):
    root = make_fashion_root(tmp_path / "fashion", num_train=20)
    write_file(root / "train-labels-idx1-ubyte", idx_bytes(np.zeros(19, np.uint8)))
    with pytest.raises(DataError, match="train-images-idx3-ubyte holds 20 images, .*"
                                        "train-labels-idx1-ubyte holds 19 labels"):
        load_fashion_mnist(8, root=root)


@pytest.mark.parametrize("file_name, content, phrase", [
    ("train-images-idx3-ubyte", np.zeros((20, 16), np.uint8), "images must be a rank-3"),
    ("train-images-idx3-ubyte", np.zeros((20, 28, 28), np.float32), "images must be .* unsigned bytes"),
    ("t10k-labels-idx1-ubyte", np.zeros((7, 1), np.uint8), "labels must be a rank-1"),
    ("t10k-labels-idx1-ubyte", np.zeros(7, np.int16), "labels must be .* unsigned bytes"),
])
def test_load_fashion_mnist_wrong_rank_or_type(tmp_path, file_name, content, phrase):
    root = make_fashion_root(tmp_path / "fashion")
    path = write_file(root / file_name, idx_bytes(content))
    with raises_data_error(path, phrase):
        load_fashion_mnist(8, root=root)


def test_load_fashion_mnist_images_must_be_28_by_28(tmp_path):
    root = make_fashion_root(tmp_path / "fashion")
    path = write_file(root / "t10k-images-idx3-ubyte", idx_bytes(np.zeros((7, 28, 27), np.uint8)))
    with raises_data_error(path, re.escape("(N, 28, 28)") + ".*" + re.escape("shape (7, 28, 27)")):
        load_fashion_mnist(8, root=root)


def test_load_fashion_mnist_missing_file_says_where_and_how(tmp_path):
    root = make_fashion_root(tmp_path / "fashion")
    (root / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(FileNotFoundError) as excinfo:
        load_fashion_mnist(8, root=root)
    message = str(excinfo.value)
    for expected in ("t10k-labels-idx1-ubyte", str(root), "root= argument",
                     "dataset-fashion-mnist", "DPCORE_DATA"):
        assert expected in message


def test_load_fashion_mnist_honors_root_and_environment(tmp_path, monkeypatch):
    from_environment = make_fashion_root(tmp_path / "env", num_train=30)
    from_argument = make_fashion_root(tmp_path / "arg", num_train=40)
    monkeypatch.setenv("DPCORE_DATA", str(from_environment))
    train_iter, _ = load_fashion_mnist(8)
    assert train_iter.num_examples == 30
    train_iter, _ = load_fashion_mnist(8, root=from_argument)  # root= beats DPCORE_DATA
    assert train_iter.num_examples == 40
    monkeypatch.setenv("DPCORE_DATA", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="nowhere.*DPCORE_DATA environment variable"):
        load_fashion_mnist(8)


def test_load_fashion_mnist_default_root(monkeypatch):
    monkeypatch.delenv("DPCORE_DATA", raising=False)
    monkeypatch.setattr(data, "DEFAULT_FASHION_MNIST_ROOT", "/nonexistent/fashion-mnist")
    with pytest.raises(FileNotFoundError, match="/nonexistent/fashion-mnist .*default location"):
        load_fashion_mnist(8)


def test_load_fashion_mnist_caches_until_a_file_changes(tmp_path):
    root = make_fashion_root(tmp_path / "fashion")
    first, _ = load_fashion_mnist(8, root=root)
    second, _ = load_fashion_mnist(4, root=root)
    assert second.X is first.X  # decoded once, shared
    assert not first.X.flags.writeable  # so no caller can change what others see

    labels_path = write_file(root / "train-labels-idx1-ubyte", idx_bytes(np.full(20, 3, np.uint8)))
    later = os.stat(labels_path).st_mtime_ns + 10**9
    os.utime(labels_path, ns=(later, later))  # a new mtime even on coarse-clock file systems
    reloaded, _ = load_fashion_mnist(8, root=root)
    np.testing.assert_array_equal(reloaded.y, np.full(20, 3))


def test_load_fashion_mnist_shuffle_is_seeded(tmp_path):
    root = make_fashion_root(tmp_path / "fashion")

    def first_epoch_labels(**kwargs):
        train_iter, _ = load_fashion_mnist(8, root=root, **kwargs)
        return np.concatenate([y for _, y in train_iter])

    np.testing.assert_array_equal(first_epoch_labels(), first_epoch_labels(seed=0))
    assert not np.array_equal(first_epoch_labels(seed=0), first_epoch_labels(seed=1))


@pytest.mark.parametrize("batch_size, error", [(0, ValueError), (2.5, TypeError)])
def test_load_fashion_mnist_checks_batch_size_first(tmp_path, batch_size, error):
    with pytest.raises(error, match="batch_size"):
        load_fashion_mnist(batch_size, root=tmp_path / "nowhere")


# ---------------------------------------------------------------------------
# load_fashion_mnist on the real data set
# ---------------------------------------------------------------------------

@pytest.mark.skipif(not os.path.isdir(REAL_FASHION_MNIST),
                    reason=f"Fashion-MNIST is not installed in {REAL_FASHION_MNIST} "
                           "(Debian package dataset-fashion-mnist; scripts/bootstrap.sh installs it)")
def test_load_fashion_mnist_real_data():
    train_iter, test_iter = load_fashion_mnist(256, root=REAL_FASHION_MNIST)
    assert (train_iter.num_examples, test_iter.num_examples) == (60000, 10000)
    assert (len(train_iter), len(test_iter)) == (235, 40)
    assert train_iter.image_shape == (1, 28, 28)

    X, y = next(iter(train_iter))
    assert X.shape == (256, 1, 28, 28) and X.dtype == np.uint8 and X.flags.c_contiguous
    assert y.shape == (256,) and y.dtype == np.int64

    for labels in (train_iter.y, test_iter.y):
        assert labels.dtype == np.int64
        assert labels.min() == 0 and labels.max() == 9
    np.testing.assert_array_equal(np.bincount(train_iter.y), [6000] * 10)
    np.testing.assert_array_equal(np.bincount(test_iter.y), [1000] * 10)
    assert train_iter.X.max() == 255  # raw bytes: scaling to [0, 1] happens on the device


def test_fashion_mnist_labels():
    assert len(FASHION_MNIST_LABELS) == 10
    assert FASHION_MNIST_LABELS[0] == "t-shirt"
    assert FASHION_MNIST_LABELS[9] == "ankle boot"


# ---------------------------------------------------------------------------
# from_arrays / ArrayIterator
# ---------------------------------------------------------------------------

def numbered_examples(count, dtype=np.float32):
    """Examples (count, 1, 2, 2) whose every element is the example's index."""
    return np.broadcast_to(np.arange(count, dtype=dtype)[:, None, None, None], (count, 1, 2, 2)).copy()


@pytest.mark.parametrize("shuffle", [False, True])
def test_batches_cover_every_example_once_per_epoch(shuffle):
    X = numbered_examples(23)
    y = np.arange(23)
    batches = from_arrays(X, y, 5, shuffle=shuffle, seed=0)
    for _ in range(3):
        seen = []
        for Xb, yb in batches:
            np.testing.assert_array_equal(Xb[:, 0, 0, 0], yb)  # examples stay with their labels
            seen.append(yb)
        assert [len(yb) for yb in seen] == [5, 5, 5, 5, 3]
        assert sorted(np.concatenate(seen)) == list(range(23))


def test_len_counts_the_last_partial_batch():
    assert len(from_arrays(numbered_examples(23), np.arange(23), 5)) == 5
    assert len(from_arrays(numbered_examples(20), np.arange(20), 5)) == 4
    assert len(from_arrays(numbered_examples(3), np.arange(3), 5)) == 1
    assert len(from_arrays(numbered_examples(0), np.arange(0), 5)) == 0


@pytest.mark.parametrize("shuffle", [False, True])
def test_drop_last(shuffle):
    batches = from_arrays(numbered_examples(23), np.arange(23), 5, shuffle=shuffle, drop_last=True)
    assert len(batches) == 4
    assert [len(yb) for _, yb in batches] == [5, 5, 5, 5]


def test_unshuffled_batches_are_contiguous_views_in_order():
    X = numbered_examples(10)
    batches = from_arrays(X, np.arange(10), 4)
    assert batches.X is X  # already float32 and contiguous: not copied
    for epoch in range(2):
        labels = []
        for Xb, yb in batches:
            assert np.shares_memory(Xb, X) and Xb.flags.c_contiguous and yb.flags.c_contiguous
            labels.extend(yb)
        assert labels == list(range(10))


def test_shuffled_batches_are_contiguous():
    for Xb, yb in from_arrays(numbered_examples(10), np.arange(10), 4, shuffle=True, seed=3):
        assert Xb.flags.c_contiguous and yb.flags.c_contiguous


def test_non_contiguous_input_is_made_contiguous():
    X = np.asfortranarray(numbered_examples(6))
    batches = from_arrays(X, np.arange(12)[::2], 4)
    assert batches.X.flags.c_contiguous and batches.y.flags.c_contiguous
    np.testing.assert_array_equal(batches.y, [0, 2, 4, 6, 8, 10])


def epoch_orders(batches, num_epochs):
    return [np.concatenate([yb for _, yb in batches]) for _ in range(num_epochs)]


def test_seeded_shuffles_are_reproducible_and_differ_across_epochs():
    def make():
        return from_arrays(numbered_examples(50), np.arange(50), 8, shuffle=True, seed=7)

    first_run, second_run = epoch_orders(make(), 3), epoch_orders(make(), 3)
    for a, b in zip(first_run, second_run):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(first_run[0], first_run[1])
    assert not np.array_equal(first_run[1], first_run[2])
    np.testing.assert_array_equal(first_run[2], np.random.default_rng([7, 2]).permutation(50))

    other_seed = epoch_orders(from_arrays(numbered_examples(50), np.arange(50), 8, shuffle=True, seed=8), 1)
    assert not np.array_equal(first_run[0], other_seed[0])


def test_seed_none_draws_one_that_reproduces_the_run():
    batches = from_arrays(numbered_examples(50), np.arange(50), 8, shuffle=True)
    assert isinstance(batches.seed, int)
    replay = from_arrays(numbered_examples(50), np.arange(50), 8, shuffle=True, seed=batches.seed)
    for a, b in zip(epoch_orders(batches, 2), epoch_orders(replay, 2)):
        np.testing.assert_array_equal(a, b)
    assert from_arrays(numbered_examples(5), np.arange(5), 2).seed is None  # nothing to seed


def test_rank_3_examples_get_a_channel_axis():
    batches = from_arrays(np.zeros((6, 28, 28), np.uint8), np.arange(6), 4)
    assert batches.X.shape == (6, 1, 28, 28)
    assert batches.image_shape == (1, 28, 28)
    assert next(iter(batches))[0].shape == (4, 1, 28, 28)


@pytest.mark.parametrize("dtype", [np.float64, np.float16])
def test_other_floats_become_float32(dtype):
    X = numbered_examples(4, dtype)
    batches = from_arrays(X, np.arange(4), 2)
    assert batches.dtype == np.float32 and batches.X.dtype == np.float32
    np.testing.assert_array_equal(batches.X, X.astype(np.float32))
    assert next(iter(batches))[0].dtype == np.float32


def test_uint8_examples_are_kept():
    X = np.zeros((4, 3, 2, 2), np.uint8)
    batches = from_arrays(X, np.arange(4), 2)
    assert batches.dtype == np.uint8 and batches.X is X
    assert batches.image_shape == (3, 2, 2)


@pytest.mark.parametrize("dtype", [bool, np.int8, np.int32, np.int64, np.uint16, np.complex64, object])
def test_unsupported_example_dtypes(dtype):
    with pytest.raises(TypeError, match="X must have dtype uint8 or float32"):
        from_arrays(np.zeros((4, 1, 2, 2), dtype), np.arange(4), 2)


@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.uint32, np.int64])
def test_integer_labels_become_int64(dtype):
    batches = from_arrays(numbered_examples(4), np.arange(4, dtype=dtype), 2)
    assert batches.y.dtype == np.int64


@pytest.mark.parametrize("labels", [np.arange(4.0), np.array([True, False, True, False]),
                                    np.array(["0", "1", "2", "3"])])
def test_non_integer_labels(labels):
    with pytest.raises(TypeError, match="y must have an integer dtype"):
        from_arrays(numbered_examples(4), labels, 2)


@pytest.mark.parametrize("shape", [(4,), (4, 4), (4, 1, 2, 2, 1)])
def test_bad_example_shapes(shape):
    with pytest.raises(ValueError, match=re.escape(f"(N, C, H, W) or (N, H, W); got shape {shape}")):
        from_arrays(np.zeros(shape, np.float32), np.arange(4), 2)


def test_bad_label_shape():
    with pytest.raises(ValueError, match=re.escape("y must have shape (N,); got shape (4, 1)")):
        from_arrays(numbered_examples(4), np.zeros((4, 1), np.int64), 2)


def test_length_mismatch():
    with pytest.raises(ValueError, match="got 4 examples and 3 labels"):
        from_arrays(numbered_examples(4), np.arange(3), 2)


def test_negative_labels():
    with pytest.raises(ValueError, match="non-negative; got -1 at index 2"):
        from_arrays(numbered_examples(4), np.array([0, 1, -1, 2]), 2)


def test_uint64_labels_beyond_int64():
    with pytest.raises(ValueError, match="fit in int64"):
        from_arrays(numbered_examples(2), np.array([0, 2**63], np.uint64), 2)


@pytest.mark.parametrize("batch_size, error", [
    (0, ValueError), (-3, ValueError), (True, TypeError), (2.0, TypeError), ("4", TypeError), (None, TypeError),
])
def test_bad_batch_size(batch_size, error):
    with pytest.raises(error, match="batch_size"):
        from_arrays(numbered_examples(4), np.arange(4), batch_size)


def test_numpy_integer_batch_size():
    assert from_arrays(numbered_examples(4), np.arange(4), np.int64(3)).batch_size == 3


@pytest.mark.parametrize("seed, error", [(-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_bad_seed(seed, error):
    with pytest.raises(error, match="seed"):
        from_arrays(numbered_examples(4), np.arange(4), 2, shuffle=True, seed=seed)


def test_from_arrays_returns_an_array_iterator():
    batches = from_arrays(numbered_examples(4), np.arange(4), 2)
    assert isinstance(batches, ArrayIterator)
    assert batches.num_examples == 4 and batches.batch_size == 2
    assert "num_examples=4" in repr(batches)
