"""Write the seed corpus of fuzz/fuzz_idx.py into fuzz/corpus/idx (deterministic).

    .venv/bin/python fuzz/make_idx_corpus.py

Valid tiny IDX files of every type code, raw and gzip (each deflate block
kind, every optional gzip header field), and a few damaged ones, so the
fuzzer starts from every branch of the reader.
"""

import os
import struct
import zlib

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "corpus", "idx")
TYPE_CODES = {"u1": 0x08, "i1": 0x09, ">i2": 0x0B, ">i4": 0x0C, ">f4": 0x0D, ">f8": 0x0E}
FTEXT, FHCRC, FEXTRA, FNAME, FCOMMENT = 0x01, 0x02, 0x04, 0x08, 0x10


def idx_bytes(values, dtype):
    array = np.asarray(values).astype(dtype)
    header = bytes([0, 0, TYPE_CODES[dtype], array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.tobytes()


def gzip_bytes(content, level=6, flags=0, strategy=zlib.Z_DEFAULT_STRATEGY):
    """A single-member gzip file, with the optional header fields that ``flags`` names."""
    header = bytearray(b"\x1f\x8b\x08" + bytes([flags]) + b"\x00\x00\x00\x00\x00\xff")
    if flags & FEXTRA:
        extra = b"dp\x04\x00idx!"
        header += struct.pack("<H", len(extra)) + extra
    if flags & FNAME:
        header += b"seed.idx\x00"
    if flags & FCOMMENT:
        header += b"a dpcore fuzz seed\x00"
    if flags & FHCRC:
        header += struct.pack("<H", zlib.crc32(header) & 0xFFFF)
    compressor = zlib.compressobj(level, zlib.DEFLATED, -zlib.MAX_WBITS, 9, strategy)
    deflate = compressor.compress(content) + compressor.flush()
    return bytes(header) + deflate + struct.pack("<II", zlib.crc32(content), len(content) & 0xFFFFFFFF)


def seeds():
    rng = np.random.default_rng(11)
    images = rng.integers(0, 256, size=(2, 3, 4))
    yield "u1-rank3.idx", idx_bytes(images, "u1")
    yield "u1-labels.idx", idx_bytes(np.arange(10), "u1")
    yield "u1-empty-dim.idx", idx_bytes(np.zeros((0, 3)), "u1")
    yield "i1-rank4.idx", idx_bytes(rng.integers(-128, 128, size=(1, 2, 2, 2)), "i1")
    yield "i2.idx", idx_bytes([[-2, 300], [7, -32768]], ">i2")
    yield "i4.idx", idx_bytes([1, -70000, 2**31 - 1], ">i4")
    yield "f4.idx", idx_bytes([[0.5, -1.25, np.inf]], ">f4")
    yield "f8.idx", idx_bytes([np.pi, -0.0, np.nan], ">f8")
    for dtype in TYPE_CODES:
        values = np.arange(-3, 3).reshape(2, 3) if dtype != "u1" else np.arange(6).reshape(2, 3)
        yield f"{dtype.strip('>')}.idx.gz", gzip_bytes(idx_bytes(values, dtype))
    labels = idx_bytes(np.arange(40) % 10, "u1")
    yield "stored-block.idx.gz", gzip_bytes(labels, level=0)
    yield "fixed-huffman.idx.gz", gzip_bytes(labels, level=1, strategy=zlib.Z_FIXED)
    yield "dynamic-huffman.idx.gz", gzip_bytes(idx_bytes(images, "u1"), level=9)
    yield "all-header-fields.idx.gz", gzip_bytes(labels, flags=FTEXT | FHCRC | FEXTRA | FNAME | FCOMMENT)
    yield "zeros-bomb-small.idx.gz", gzip_bytes(idx_bytes(np.zeros((4, 28, 28)), "u1"), level=9)
    # 0xFF, a level, then an IDX file the harness compresses itself.
    yield "to-compress-u1.bin", b"\xff\x06" + idx_bytes(images, "u1")
    yield "to-compress-f8-stored.bin", b"\xff\x00" + idx_bytes([[1.5, -2.0]], ">f8")
    yield "to-compress-truncated.bin", b"\xff\x09" + idx_bytes(np.arange(30), "u1")[:-4]
    # Damaged: each is refused with a DataError.
    good = gzip_bytes(labels)
    yield "damaged-raw-truncated.idx", labels[:-3]
    yield "damaged-raw-trailing.idx", labels + b"\x00"
    yield "damaged-raw-bad-magic.idx", b"\x01" + labels[1:]
    yield "damaged-raw-huge-dims.idx", bytes([0, 0, 8, 3]) + struct.pack(">3I", 1, 32768, 32768) + b"\x00" * 16
    yield "damaged-gz-truncated.idx.gz", good[:-5]
    yield "damaged-gz-bad-crc.idx.gz", good[:-8] + bytes([good[-8] ^ 0xFF]) + good[-7:]
    yield "damaged-gz-bad-size.idx.gz", good[:-4] + struct.pack("<I", len(labels) + 1)
    yield "damaged-gz-two-members.idx.gz", gzip_bytes(labels[:20]) + gzip_bytes(labels[20:])
    yield "damaged-gz-trailing-garbage.idx.gz", good + b"\x00\x00"
    yield "damaged-gz-declares-more.idx.gz", gzip_bytes(bytes([0, 0, 8, 1]) + struct.pack(">I", 1 << 20) + b"\x05" * 64)


def main():
    os.makedirs(CORPUS, exist_ok=True)
    for name, content in seeds():
        with open(os.path.join(CORPUS, name), "wb") as file:
            file.write(content)
    print(f"wrote {len(list(seeds()))} seeds to {CORPUS}")


if __name__ == "__main__":
    main()
