"""Checkpoints you can trust (dpcore.checkpoint, issue 11).

- 600+ damaged checkpoints made from a saved LeNet and a small Sequential
  (BatchNorm statistics, an add, named layers): truncations, byte flips in the
  header and the data, header edits (dtype, shape, offsets, class, layers,
  input_shape, format, metadata of other JSON types, missing and extra
  tensors, huge declared sizes), each one either refused with a DataError
  naming the file, or loaded bitwise equal to the original;
- the shapes the loader infers from the layer specs equal those of the model
  the C core builds, for every kind and many random architectures;
- peak memory (ru_maxrss, in a subprocess) of loading a file that declares a
  huge layer, and of loading a normal file, against stated bounds;
- 50 SIGKILLs of a process saving in a loop: the target is absent or a
  complete saved version, and the next save leaves no temporary;
- the file mode follows the umask, the directory is fsynced after the rename,
  non-finite weights are refused unless allowed, a checksum mismatch names the
  tensor, files of format 1 (no checksums) still load.
"""
import hashlib
import json
import os
import random
import re
import resource
import stat
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

import dpcore as dp
from dpcore import checkpoint
from dpcore.models import _CLASSES, _SKIP_INIT

# ---- the files the mutations start from ----------------------------------------------


def small_net():
    """Every tensor kind a checkpoint holds (conv, dense, BatchNorm weights and
    running statistics), an add reading two layers, named layers."""
    layers = [("conv2d", 4, 3, 1, 1), ("batchnorm",), ("relu",), ("conv2d", 4, 3, 1, 1), ("add", 2, 3),
              ("maxpool", 2, 2, 0), ("global_avgpool",), ("flatten",), ("dense", 3)]
    names = ["stem", "bn", "_2", "conv", "_4", "_5", "_6", "_7", "fc"]
    net = dp.models.Sequential(layers, input_shape=(2, 8, 8), names=names, init="torch", seed=3)
    rng = np.random.default_rng(0)
    net.train_step(rng.random((5, 2, 8, 8), dtype=np.float32), np.arange(5) % 3, lr=0.1)  # running stats move
    return net


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """{label: (file bytes, weights, architecture)} of a saved LeNet and the small Sequential."""
    out = {}
    directory = tmp_path_factory.mktemp("bases")
    for label, net in (("lenet", dp.models.LeNet(seed=7)), ("seq", small_net())):
        path = directory / f"{label}.safetensors"
        net.save(path)
        out[label] = (path.read_bytes(), net.get_weights(), checkpoint.architecture(net))
    return out


def split(data):
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), data[8 + n:]


def join(header, payload):
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + payload


class Raw(str):
    """Metadata text put in the file as it is (not an architecture object)."""


def comparable(header):
    """A header with its architecture text parsed, for comparing contents."""
    meta = dict(header["__metadata__"])
    meta.pop("dpcore_sha256", None)  # follows the text
    try:
        meta["dpcore"] = json.loads(meta["dpcore"])
    except (ValueError, RecursionError):
        pass
    return dict(header, __metadata__=meta)


def edit(data, fn, reseal=True):
    """data with fn(tensors, arch, meta) applied to its header; fn may return a
    new payload. reseal: recompute the architecture's SHA-256 (a careful
    forger), so that the checks behind it are reached."""
    header, payload = split(data)
    meta = header.pop("__metadata__")
    arch = json.loads(meta["dpcore"])
    box = {"arch": arch}
    new_payload = fn(header, box, meta)
    arch = box["arch"]
    if "dpcore" in meta:
        meta["dpcore"] = arch if isinstance(arch, Raw) else json.dumps(arch)
        if reseal and "dpcore_sha256" in meta:
            meta["dpcore_sha256"] = hashlib.sha256(meta["dpcore"].encode()).hexdigest()
    header = dict({"__metadata__": meta}, **header)
    if new_payload is None and comparable(header) == comparable(split(data)[0]):
        return data  # a no-op (a bias's shape reversed), left out of the mutations
    return join(header, payload if new_payload is None else new_payload)


def tensor_edit(name_index, field, value):
    def fn(tensors, box, meta):
        name = sorted(tensors)[name_index % len(tensors)]
        tensors[name][field] = value(tensors[name][field]) if callable(value) else value
    return fn


def arch_edit(change):
    def fn(tensors, box, meta):
        result = change(box["arch"])
        if result is not None:
            box["arch"] = result
    return fn


def set_layer(index, spec):
    def change(arch):
        arch["layers"][index] = spec
    return change


def last_dense_huge(arch):
    arch["layers"][-1] = ["dense", 10**6]


def drop_tensor(payload):
    """Edit: a tensor's entry and its bytes gone (the offsets after it moved down)."""
    def fn(tensors, box, meta):
        victim = sorted(tensors)[len(tensors) // 2]
        b, e = tensors.pop(victim)["data_offsets"]
        for entry in tensors.values():
            if entry["data_offsets"][0] >= e:
                entry["data_offsets"] = [o - (e - b) for o in entry["data_offsets"]]
        return payload[:b] + payload[e:]
    return fn


def mutations(data, rng):
    """(label, damaged bytes, expectation): 'refuse:<regex>' or 'either'."""
    header, payload = split(data)
    n = int.from_bytes(data[:8], "little")
    out = []
    # truncations: every offset of the length and the header's start and end, then spread over the data
    cuts = set(range(0, 20)) | set(range(8 + n - 4, 8 + n + 5)) | {len(data) - 1, len(data) - 4}
    cuts |= {int(c) for c in rng.integers(8 + n, len(data), 45)}
    for cut in sorted(cuts):
        out.append((f"truncated at {cut}", data[:cut], "refuse:truncated|shorter than|not valid JSON|not UTF-8"))
    # byte flips in the header (the 8-byte length included) and in the data
    for pos in rng.integers(0, 8 + n, 90):
        flipped = bytearray(data)
        flipped[pos] ^= 1 << int(rng.integers(0, 8))
        out.append((f"header byte {pos} flipped", bytes(flipped), "either"))
    for pos in rng.integers(8 + n, len(data), 50):
        flipped = bytearray(data)
        flipped[pos] ^= 1 << int(rng.integers(0, 8))
        out.append((f"data byte {pos} flipped", bytes(flipped), "refuse:is damaged: the SHA-256"))
    # a tensor's bytes swapped with another's of the same size keeps every length
    sizes = {}
    for name, entry in header.items():
        if name != "__metadata__":
            b, e = entry["data_offsets"]
            sizes.setdefault(e - b, []).append((b, e))
    for spans in sizes.values():
        if len(spans) >= 2:
            (b1, e1), (b2, e2) = spans[:2]
            p = bytearray(payload)
            p[b1:e1], p[b2:e2] = payload[b2:e2], payload[b1:e1]
            if bytes(p) != payload:
                out.append(("two tensors' bytes swapped", data[:8 + n] + bytes(p), "refuse:SHA-256"))

    # header edits: a careful forger's (resealed) and a plain one's
    edits = []
    for i in range(4):
        for dtype in ("I32", "F16", "F64", "BF16", "U8", "f32", 5, None):
            edits.append((f"tensor {i} dtype {dtype!r}", tensor_edit(i, "dtype", dtype), "dtype|data_offsets"))
        edits += [
            (f"tensor {i} shape reversed", tensor_edit(i, "shape", lambda s: s[::-1]), "shape"),
            (f"tensor {i} shape + [1]", tensor_edit(i, "shape", lambda s: s + [1]), "shape|needs"),
            (f"tensor {i} shape without its first extent", tensor_edit(i, "shape", lambda s: s[1:]), "shape|needs"),
            (f"tensor {i} shape huge", tensor_edit(i, "shape", lambda s: [10**6] + s[1:]), "needs"),
            (f"tensor {i} shape [-1]", tensor_edit(i, "shape", [-1]), "shape"),
            (f"tensor {i} shape strings", tensor_edit(i, "shape", lambda s: [str(d) for d in s]), "shape"),
            (f"tensor {i} shape 2**70", tensor_edit(i, "shape", [2**70]), "needs"),
            (f"tensor {i} offsets +4", tensor_edit(i, "data_offsets", lambda o: [o[0] + 4, o[1] + 4]),
             "gap|overlaps|needs|truncated"),
            (f"tensor {i} offsets end +4", tensor_edit(i, "data_offsets", lambda o: [o[0], o[1] + 4]), "needs"),
            (f"tensor {i} offsets negative", tensor_edit(i, "data_offsets", lambda o: [-4, o[1]]), "data_offsets"),
            (f"tensor {i} offsets huge", tensor_edit(i, "data_offsets", lambda o: [o[0], o[0] + 2**62]), "needs"),
            (f"tensor {i} offsets as string", tensor_edit(i, "data_offsets", "0,4"), "data_offsets"),
        ]

    def rename_tensor(tensors, box, meta):
        name = sorted(tensors)[0]
        tensors[name + "x"] = tensors.pop(name)

    def extra_tensor(tensors, box, meta):
        end = max(e["data_offsets"][1] for e in tensors.values())
        tensors["extra.weight"] = {"dtype": "F32", "shape": [2], "data_offsets": [end, end + 8]}
        return payload + b"\0" * 8

    def entry_replaced(value):
        def fn(tensors, box, meta):
            tensors[sorted(tensors)[0]] = value
        return fn

    edits += [
        ("a tensor renamed", rename_tensor, "missing|sha256"),
        ("an extra tensor", extra_tensor, "unexpected|sha256"),
        ("a tensor entry is a list", entry_replaced([1, 2]), "must be an object"),
        ("a tensor entry is null", entry_replaced(None), "must be an object"),
        ("a tensor entry has an extra key", tensor_edit(0, "extra", 1), "must be an object"),
    ]
    for cls in ("ResNet18", "LeNet", "Foo", 5, None, ["LeNet"]):  # (a LeNet as a Sequential is legitimate)
        edits.append((f"class {cls!r}", arch_edit(lambda a, cls=cls: a.__setitem__("class", cls)), "class"))
    edits += [
        ("last layer dense 10**6", arch_edit(last_dense_huge), "out_features must be at most"),
        ("last layer dense 0", arch_edit(set_layer(-1, ["dense", 0])), "out_features"),
        ("last layer dense '10'", arch_edit(set_layer(-1, ["dense", "10"])), "integer"),
        ("last layer dense 10.0", arch_edit(set_layer(-1, ["dense", 10.0])), "integer"),
        ("last layer dense true", arch_edit(set_layer(-1, ["dense", True])), "integer"),
        ("last layer dense 2**64", arch_edit(set_layer(-1, ["dense", 2**64])), "out of range|outside"),
        ("last layer dense, two args", arch_edit(set_layer(-1, ["dense", 10, 3])), "takes"),
        ("last layer without args", arch_edit(set_layer(-1, ["dense"])), "takes"),
        ("last layer an unknown kind", arch_edit(set_layer(-1, ["densest", 10])), "unknown layer kind"),
        ("last layer a dict", arch_edit(set_layer(-1, {"dense": 10})), r"must be a list \[kind"),
        ("last layer a string", arch_edit(set_layer(-1, "dense")), r"must be a list \[kind"),
        ("last layer empty", arch_edit(set_layer(-1, [])), r"must be a list \[kind"),
        ("last layer kind a number", arch_edit(set_layer(-1, [5, 10])), r"must be a list \[kind"),
        ("first layer relu", arch_edit(set_layer(0, ["relu"])), "missing|shape|class|last layer"),
        ("first layer a huge conv", arch_edit(set_layer(0, ["conv2d", 10**6, 3, 1, 0])), "out_channels must be at most"),
        ("first layer conv kernel 99", arch_edit(set_layer(0, ["conv2d", 4, 99, 1, 0])), "larger than the padded"),
        ("first layer conv stride 0", arch_edit(set_layer(0, ["conv2d", 4, 3, 0, 0])), "stride must be >= 1"),
        ("a layer removed", arch_edit(lambda a: a["layers"].pop(1) and None), "names must|sources must|class"),
        ("a layer appended", arch_edit(lambda a: a["layers"].append(["relu"])), "names must|sources must|class"),
        ("layers empty", arch_edit(lambda a: a.__setitem__("layers", [])), "non-empty list"),
        ("layers a dict", arch_edit(lambda a: a.__setitem__("layers", {"0": ["relu"]})), "non-empty list"),
        ("layers null", arch_edit(lambda a: a.__setitem__("layers", None)), "non-empty list"),
        ("input_shape of 2", arch_edit(lambda a: a.__setitem__("input_shape", a["input_shape"][:2])), "input_shape"),
        ("input_shape with a channel more",
         arch_edit(lambda a: a["input_shape"].__setitem__(0, a["input_shape"][0] + 1)), "shape|class"),
        ("input_shape 0 channels", arch_edit(lambda a: a["input_shape"].__setitem__(0, 0)), "input_shape"),
        ("input_shape huge", arch_edit(lambda a: a.__setitem__("input_shape", [10**9, 10**9, 10**9])),
         "input_shape"),
        ("input_shape strings", arch_edit(lambda a: a.__setitem__("input_shape", ["1", "28", "28"])),
         "input_shape"),
        ("input_shape null", arch_edit(lambda a: a.__setitem__("input_shape", None)), "input_shape"),
        ("names shorter", arch_edit(lambda a: a.__setitem__("names", a["names"][1:])), "names must"),
        ("names of numbers", arch_edit(lambda a: a.__setitem__("names", list(range(len(a["layers"]))))),
         "names must"),
        ("names repeated", arch_edit(lambda a: a.__setitem__("names", ["x"] * len(a["layers"]))),
         "named .*names repeat"),
        ("sources of strings", arch_edit(lambda a: a.__setitem__("sources", ["a"] * len(a["layers"]))),
         "sources must"),
        ("sources forward", arch_edit(lambda a: a.__setitem__("sources", [5] * len(a["layers"]))),
         "not an earlier layer"),
        ("sources a number", arch_edit(lambda a: a.__setitem__("sources", 3)), "sources must"),
        ("format 1 with checksums", arch_edit(lambda a: a.__setitem__("format", "dpcore-sequential-1")),
         "metadata keys|unexpected keys"),
        ("format 3", arch_edit(lambda a: a.__setitem__("format", "dpcore-sequential-3")), "unknown format"),
        ("format missing", arch_edit(lambda a: a.pop("format") and None), "unknown format"),
        ("format a number", arch_edit(lambda a: a.__setitem__("format", 2)), "unknown format"),
        ("an extra architecture key", arch_edit(lambda a: a.__setitem__("extra", 1)), "unexpected keys"),
        ("names missing", arch_edit(lambda a: a.pop("names") and None), "misses"),
        ("sha256 missing", arch_edit(lambda a: a.pop("sha256") and None), "misses"),
        ("sha256 a list", arch_edit(lambda a: a.__setitem__("sha256", [])), "sha256"),
        ("sha256 of one tensor wrong", arch_edit(lambda a: a["sha256"].__setitem__(sorted(a["sha256"])[0], "0" * 64)),
         "is damaged: the SHA-256"),
        ("sha256 of one tensor missing", arch_edit(lambda a: a["sha256"].pop(sorted(a["sha256"])[0]) and None),
         "sha256"),
        ("metadata a JSON list", arch_edit(lambda a: Raw(json.dumps([a]))), "is a JSON list, not an object"),
        ("metadata a JSON number", arch_edit(lambda a: Raw("5")), "is a JSON integer, not an object"),
        ("metadata a JSON string", arch_edit(lambda a: Raw('"x"')), "is a JSON string, not an object"),
        ("metadata JSON null", arch_edit(lambda a: Raw("null")), "is a JSON null, not an object"),
        ("metadata garbage", arch_edit(lambda a: Raw("{not json")), "not valid JSON"),
        ("metadata with NaN", arch_edit(lambda a: Raw('{"format": NaN}')), "not valid JSON"),
        ("metadata with a duplicate key", arch_edit(lambda a: Raw('{"format": 1, "format": 2}')),
         "not valid JSON.*twice"),
        ("metadata nested too deep", arch_edit(lambda a: Raw("[" * 100000 + "]" * 100000)), "nested too deeply"),
        ("metadata an 80000-digit number", arch_edit(lambda a: Raw("9" * 80000)), "not valid JSON"),
        ("metadata empty", arch_edit(lambda a: Raw("")), "not valid JSON"),
    ]
    for label, fn, problem in edits:
        out.append((label + " (resealed)", edit(data, fn), f"refuse:{problem}"))
    for label, fn, problem in edits:
        if label.startswith(("metadata", "class", "last", "first", "layers", "input", "names", "sources", "format",
                             "sha256", "an extra arch")):
            out.append((label, edit(data, fn, reseal=False), "refuse:architecture metadata is damaged"))

    out.append(("a tensor and its bytes removed", edit(data, drop_tensor(payload)), "refuse:missing"))

    # the whole metadata: gone, of another type, with an extra or a missing key, checksum damaged
    def meta_fn(change):
        def fn(tensors, box, meta):
            change(meta)
        return fn

    out += [
        ("metadata removed", join({k: v for k, v in header.items() if k != "__metadata__"}, payload),
         "refuse:not a dpcore model file"),
        ("metadata a list", join(dict(header, __metadata__=["dpcore"]), payload), "refuse:__metadata__|dpcore"),
        ("metadata values not strings", join(dict(header, __metadata__={"dpcore": {"a": 1}}), payload),
         "refuse:__metadata__ must map"),
        ("an extra metadata key", edit(data, meta_fn(lambda m: m.__setitem__("other", "x"))), "refuse:metadata keys"),
        ("the architecture checksum removed", edit(data, meta_fn(lambda m: m.pop("dpcore_sha256"))),
         "refuse:metadata keys"),
        ("the architecture checksum wrong", edit(data, meta_fn(lambda m: m.__setitem__("dpcore_sha256", "0" * 64)),
                                                reseal=False), "refuse:architecture metadata is damaged"),
        ("the header a JSON list", join([1, 2], payload), "refuse:header is a JSON list"),
        ("the header a number", b"\x01\0\0\0\0\0\0\x005" + payload, "refuse:header is a JSON integer"),
        ("the header not UTF-8", b"\x08\0\0\0\0\0\0\0\xff\xfe{}    " + payload, "refuse:not UTF-8"),
        ("the header length 2**63", (2**63).to_bytes(8, "little") + data[8:], "refuse:over dpcore's limit"),
        ("the header length 0", bytes(8) + data[8:], "refuse:not valid JSON"),
        ("trailing bytes", data + b"\0" * 4, "refuse:trailing bytes"),
        ("empty file", b"", "refuse:shorter than"),
    ]
    return [m for m in out if m[1] != data]  # no no-ops (a bias's shape reversed)


def load_outcome(path):
    """None and the net, or the exception and None."""
    try:
        return None, dp.models.load(path)
    except Exception as e:  # noqa: BLE001 -- the test checks what it is
        return e, None


def test_damaged_checkpoints_are_refused_by_name_or_load_bitwise(bases, tmp_path):
    start = time.perf_counter()
    rng = np.random.default_rng(11)
    counts = {"refused": 0, "loaded": 0}
    for base_label, (data, weights, arch) in bases.items():
        for i, (label, damaged, expect) in enumerate(mutations(data, rng)):
            path = tmp_path / f"{base_label}-{i:04d}.safetensors"
            path.write_bytes(damaged)
            what = f"{base_label}: {label}"
            error, net = load_outcome(path)
            try:
                checkpoint._parse(damaged, where=str(path))
                parse_error = None
            except Exception as e:  # noqa: BLE001
                parse_error = e
            if error is None:
                assert expect == "either", f"{what}: loaded, expected refusal ({expect})"
                got = net.get_weights()
                assert list(got) == list(weights), what
                for name, w in weights.items():
                    assert np.array_equal(got[name].view(np.uint32), w.view(np.uint32)), f"{what}: {name} differs"
                assert checkpoint.architecture(net) == arch, what
                assert parse_error is None, f"{what}: load accepts it, _parse refuses: {parse_error}"
                counts["loaded"] += 1
                continue
            assert isinstance(error, dp.DataError), f"{what}: {type(error).__name__}: {error}"
            assert str(path) in str(error), f"{what}: the message does not name the file: {error}"
            if expect != "either":
                assert re.search(expect[len("refuse:"):], str(error)), f"{what}: unexpected message: {error}"
            assert isinstance(parse_error, dp.DataError), f"{what}: load refuses, _parse gives {parse_error!r}"
            counts["refused"] += 1
            path.unlink()
    elapsed = time.perf_counter() - start
    print(f"{counts['refused']} refused, {counts['loaded']} loaded bitwise, {elapsed:.1f} s")
    assert counts["refused"] + counts["loaded"] >= 500
    assert elapsed < 60  # about 5 s on 2 cores


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(FileNotFoundError):
        dp.models.load(tmp_path / "nothing.safetensors")
    with pytest.raises(IsADirectoryError):
        dp.models.load(tmp_path)


# ---- the checks, one by one ----------------------------------------------------------------


def saved(net, path):
    net.save(path)
    return path.read_bytes()


def test_retagged_dtype_is_refused_naming_the_tensor(tmp_path):
    path = tmp_path / "lenet.safetensors"
    data = saved(dp.models.LeNet(), path)
    path.write_bytes(edit(data, tensor_edit(0, "dtype", "I32")))
    with pytest.raises(dp.DataError, match=r"lenet\.safetensors: tensor '0\.bias' has dtype 'I32'; dpcore checkpoints "
                                           r"hold float32"):
        dp.models.load(path)


def test_a_class_over_another_class_layers_is_refused(tmp_path):
    path = tmp_path / "lenet.safetensors"
    data = saved(dp.models.LeNet(), path)
    path.write_bytes(edit(data, arch_edit(lambda a: a.__setitem__("class", "ResNet18"))))
    with pytest.raises(dp.DataError, match=r"class ResNet18, but its .* are not ResNet18's"):
        dp.models.load(path)
    # a LeNet's layers saved as a plain Sequential load as a Sequential
    path.write_bytes(edit(data, arch_edit(lambda a: a.__setitem__("class", "Sequential"))))
    assert type(dp.models.load(path)) is dp.models.Sequential


def test_a_subclass_is_saved_as_the_dpcore_class_it_is(tmp_path):
    class Mine(dp.models.LeNet):
        pass

    class Other(dp.models.Sequential):
        pass

    Mine().save(tmp_path / "mine.safetensors")
    assert type(dp.models.load(tmp_path / "mine.safetensors")) is dp.models.LeNet
    Other([("flatten",), ("dense", 2)], input_shape=(1, 2, 2)).save(tmp_path / "other.safetensors")
    assert type(dp.models.load(tmp_path / "other.safetensors")) is dp.models.Sequential


def test_checksum_mismatch_names_the_tensor(tmp_path):
    path = tmp_path / "seq.safetensors"
    net = small_net()
    data = bytearray(saved(net, path))
    header, payload = split(bytes(data))
    b, _ = header["bn.running_var"]["data_offsets"]
    data[len(data) - len(payload) + b + 1] ^= 0x10
    path.write_bytes(data)
    with pytest.raises(dp.DataError, match=r"seq\.safetensors: tensor 'bn\.running_var' is damaged: the SHA-256 of "
                                           r"its bytes is [0-9a-f]{64}, the file records [0-9a-f]{64}"):
        dp.models.load(path)
    # the digests are the SHA-256 of the tensors' bytes, as sha256sum computes them
    arch = json.loads(header["__metadata__"]["dpcore"])
    w = net.get_weights()["fc.weight"]
    assert arch["sha256"]["fc.weight"] == hashlib.sha256(w.astype("<f4").tobytes()).hexdigest()


def test_non_finite_weights_are_refused_unless_allowed(tmp_path):
    net = small_net()
    weights = net.get_weights()
    weights["conv.weight"][1, 0, 2, 2] = np.nan
    weights["conv.weight"][0, 0, 0, 0] = np.inf
    with pytest.raises(ValueError, match="conv.weight holds 2 value"):
        net.set_weights(weights)  # set_weights refuses them too, unless asked
    net.set_weights(weights, allow_nonfinite=True)
    path = tmp_path / "nan.safetensors"
    net.save(path)  # a diverged model can still be saved, for a look at it
    with pytest.raises(dp.DataError, match=r"nan\.safetensors: tensor 'conv\.weight' holds 2 non-finite values "
                                           r"\(NaN or infinity\) of 144; load with allow_nonfinite=True"):
        dp.models.load(path)
    back = dp.models.load(path, allow_nonfinite=True)
    assert np.array_equal(back.get_weights()["conv.weight"], weights["conv.weight"], equal_nan=True)


def test_format_1_files_without_checksums_still_load(tmp_path):
    """A file as dpcore wrote it before checksums (safetensors' own writer, the
    old architecture without sources and names)."""
    from safetensors.numpy import save_file

    net = dp.models.LeNet(seed=2)
    arch = {"format": "dpcore-sequential-1", "class": "LeNet",
            "layers": [list(spec) for spec in net._specs], "input_shape": [1, 28, 28]}
    path = tmp_path / "old.safetensors"
    save_file(dict(net.get_weights()), str(path), metadata={"dpcore": json.dumps(arch)})
    back = dp.models.load(path)
    assert type(back) is dp.models.LeNet
    for name, w in net.get_weights().items():
        assert np.array_equal(back.get_weights()[name], w), name
    # still checked for everything but the checksums
    save_file(dict(net.get_weights(), **{"0.bias": np.zeros(20, np.float32) * np.nan}), str(path),
              metadata={"dpcore": json.dumps(arch)})
    with pytest.raises(dp.DataError, match="'0.bias' holds 20 non-finite"):
        dp.models.load(path)


def test_the_file_is_plain_safetensors(tmp_path):
    net = small_net()
    path = tmp_path / "seq.safetensors"
    net.save(path)
    tensors = load_file(str(path))
    assert sorted(tensors) == sorted(net.get_weights())
    for name, w in net.get_weights().items():
        assert np.array_equal(tensors[name], w), name
    arch, read = checkpoint.read(path)
    assert arch == checkpoint.architecture(net) and list(read) == list(net.get_weights())


def test_save_refuses_what_load_would_refuse(tmp_path):
    # a model whose tensors' names repeat is refused where it is built (tests/test_hostile_audit.py)
    with pytest.raises(ValueError, match=r"both have a tensor named 'b\.weight'"):
        dp.models.Sequential([("flatten",), ("dense", 2), ("dense", 2)], input_shape=(1, 2, 2), names=["a", "b", "b"])
    n = 1200  # with 300-character names: some 1.5 MB of header
    many = dp.models.Sequential([("flatten",)] + [("dense", 1)] * n, input_shape=(1, 1, 1),
                                names=[f"{i:0300d}" for i in range(n + 1)])
    with pytest.raises(ValueError, match="over the limit of 1048576"):
        many.save(tmp_path / "many.safetensors")
    assert os.listdir(tmp_path) == []


# ---- the shapes the loader infers are the C core's ---------------------------------------------


# random_architecture's kinds: the loader's shapes are compared with the core's for each
RANDOM_KINDS = ("conv2d", "relu", "avgpool", "maxpool", "batchnorm", "add", "global_avgpool", "flatten", "dense")


def test_every_layer_kind_is_drawn_by_the_random_architectures():
    assert set(dp.models.layer_kinds()) == set(RANDOM_KINDS)


def random_architecture(rng):
    """A random layer list over every kind, with random sources; the C core refuses many."""
    c, h = int(rng.integers(1, 4)), int(rng.integers(1, 12))
    layers, sources = [], []
    for _ in range(int(rng.integers(1, 7))):
        kind = str(rng.choice(RANDOM_KINDS))
        if kind == "conv2d":
            spec = ("conv2d", int(rng.integers(1, 5)), int(rng.integers(1, 6)), int(rng.integers(1, 4)),
                    int(rng.integers(0, 3)))
        elif kind in ("avgpool", "maxpool"):
            spec = (kind, int(rng.integers(1, 4)), int(rng.integers(1, 4)), int(rng.integers(0, 3)))
        elif kind == "add":
            spec = ("add", int(rng.integers(-1, len(layers) + 1)), int(rng.integers(-1, len(layers) + 1)))
        elif kind == "batchnorm":
            spec = ("batchnorm",) if rng.random() < 0.5 else ("batchnorm", float(rng.choice([1e-3, 0.0, 1e-50])),
                                                              float(rng.choice([0.2, 1.0, 1.5])))
        elif kind == "dense":
            spec = ("dense", int(rng.integers(1, 4)))
        else:
            spec = (kind,)
        layers.append(spec)
        sources.append(None if rng.random() < 0.7 else int(rng.integers(-2, len(layers) + 1)))
    if rng.random() < 0.8:
        layers += [("flatten",), ("dense", int(rng.integers(1, 5)))]
        sources += [None, None]
    return layers, sources, (c, h, h)


def test_the_loader_accepts_an_architecture_exactly_when_the_core_builds_it():
    """The loader infers every shape without building a model (it checks a
    file before allocating what it declares): for random architectures it
    must accept exactly those the C core builds, with the core's shapes."""
    rng = np.random.default_rng(5)
    built = refused = 0
    for _ in range(2000):
        layers, sources, shape = random_architecture(rng)
        arch = {"format": checkpoint.FORMAT, "class": "Sequential", "layers": [list(l) for l in layers],
                "input_shape": list(shape), "sources": sources, "names": None}
        try:
            plan, _ = checkpoint._plan(arch, "x")
        except dp.DataError as e:
            plan, why = None, e
        try:
            net = dp.models.Sequential(layers, input_shape=shape, sources=sources, init=_SKIP_INIT)
        except ValueError as e:
            assert plan is None, f"{layers} {sources} {shape}: the core refuses it ({e}), the loader accepts it"
            refused += 1
            continue
        assert plan is not None, f"{layers} {sources} {shape}: the core builds it, the loader refuses it: {why}"
        assert [(p.name, p.buffer, p.shape) for p in plan] == \
               [(name, buffer, tuple(shape)) for name, buffer, _, shape in net._entries()], layers
        built += 1
    assert built >= 200 and refused >= 200, (built, refused)


# ---- memory ---------------------------------------------------------------------------------

# Linux keeps a process's ru_maxrss across exec, so a child of the (large)
# pytest process would report pytest's peak; a process forked from the fresh
# interpreter starts from that interpreter's few MB.
RSS_SCRIPT = textwrap.dedent("""
    import os
    pid = os.fork()
    if pid:
        os._exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    import json, resource, sys
    import dpcore as dp
    from dpcore import models
    what, path = sys.argv[1], sys.argv[2]
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    error = None
    if what == "build":  # the model alone, as load builds it
        net = models.Sequential([("flatten",), ("dense", 4096)], input_shape=(1, 64, 64), init=models._SKIP_INIT)
    else:
        try:
            dp.models.load(path)
        except dp.DataError as e:
            error = str(e)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"kib": peak - base, "base_kib": base, "error": error}), flush=True)
    os._exit(0)
""")


def peak_rss_kib(tmp_path, what, path=""):
    script = tmp_path / "rss.py"
    script.write_text(RSS_SCRIPT)
    out = subprocess.run([sys.executable, str(script), what, str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_peak_memory_of_a_load_is_the_file_payload_plus_a_constant(tmp_path):
    """ru_maxrss over what the process had after importing dpcore. A file that
    declares a dense layer of 10**6 features over a LeNet's 0.5 MB (3.1 GB if
    it were built) is refused for at most 16 MiB; a normal 64 MiB file costs the
    model's own buffers (measured by building the same model) plus at most
    the payload (one staging copy) and 16 MiB."""
    lenet = tmp_path / "lenet.safetensors"
    data = saved(dp.models.LeNet(), lenet)
    hostile = tmp_path / "hostile.safetensors"
    hostile.write_bytes(edit(data, arch_edit(last_dense_huge)))
    got = peak_rss_kib(tmp_path, "load", hostile)
    assert got["error"] and "hostile.safetensors" in got["error"]
    assert got["kib"] <= 16 * 1024, got

    big = tmp_path / "big.safetensors"
    net = dp.models.Sequential([("flatten",), ("dense", 4096)], input_shape=(1, 64, 64), init=_SKIP_INIT)
    net.save(big)  # zeros: the values do not matter here
    del net
    payload_kib = os.path.getsize(big) // 1024
    build = peak_rss_kib(tmp_path, "build")
    load = peak_rss_kib(tmp_path, "load", big)
    assert load["error"] is None
    print(f"payload {payload_kib} KiB; peak over import ({load['base_kib']} KiB): build {build['kib']} KiB, "
          f"load {load['kib']} KiB, hostile {got['kib']} KiB")
    assert build["kib"] >= 3 * payload_kib  # it measures: the model holds params, grads and momentum
    assert load["kib"] <= build["kib"] + payload_kib + 16 * 1024


# ---- writing -----------------------------------------------------------------------------------

KILL_SCRIPT = textwrap.dedent("""
    import glob, json, os, random, signal, sys, time
    import numpy as np
    import dpcore as dp

    # at least min_kills kills, then more (up to max_kills) until at least 5 landed inside a write and
    # 5 left a complete file: where a kill lands is chance, and on a fast machine few land inside one
    path, min_kills, max_kills = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    net = dp.models.Sequential([("flatten",), ("dense", 1024)], input_shape=(1, 32, 64), init="torch", seed=1)
    base = net.get_weights()

    def version(v):
        w = {k: a.copy() for k, a in base.items()}
        for a in w.values():
            a.flat[0] = v  # each tensor's first value says which save it is
        return w

    def temps():
        return glob.glob(os.path.join(os.path.dirname(path), "." + os.path.basename(path) + ".dpcore-*.tmp"))

    rng = random.Random(4)
    report = {"absent": 0, "complete": 0, "temps_left_by_kills": 0, "temps_after_next_save": 0, "bad": [], "kills": 0}
    t0 = time.perf_counter()
    net.set_weights(version(-1))
    net.save(path)  # one save's time, to aim the kills
    save_s = time.perf_counter() - t0
    os.unlink(path)
    v = 0
    for k in range(max_kills):
        if k >= min_kills and report["temps_left_by_kills"] >= 5 and report["complete"] >= 5:
            break
        report["kills"] += 1
        start = v
        pid = os.fork()
        if pid == 0:
            try:
                net.set_weights(version(start))
                while True:
                    net.save(path)
            finally:
                os._exit(0)
        time.sleep(rng.uniform(0, 3 * save_s))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        report["temps_left_by_kills"] += len(temps()) > 0
        if not os.path.exists(path):
            report["absent"] += 1
        else:
            got = dp.models.load(path).get_weights()
            u = got["1.weight"].flat[0]
            want = version(u)
            if not (u == int(u) and -1 <= u and all(np.array_equal(got[n].view(np.uint32), want[n].view(np.uint32))
                                                    for n in want)):
                report["bad"].append(f"kill {k}: the file is no saved version")
            v = max(v, int(u) + 1)
            report["complete"] += 1
        net.set_weights(version(-1))
        net.save(path)  # removes the temporaries of the killed writer
        report["temps_after_next_save"] += len(temps())
        v += 1
    print(json.dumps(report))
""")


def test_sigkill_during_save_leaves_the_old_file_or_a_new_one(tmp_path):
    script = tmp_path / "kill.py"
    script.write_text(KILL_SCRIPT)
    target = tmp_path / "out" / "model.safetensors"
    target.parent.mkdir()
    start = time.perf_counter()
    out = subprocess.run([sys.executable, str(script), str(target), "50", "1000"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    print(report, f"{time.perf_counter() - start:.1f} s")
    assert report["bad"] == []
    assert report["absent"] + report["complete"] == report["kills"] >= 50
    assert report["temps_after_next_save"] == 0
    # the kills did land inside writes, and after some of them a file was complete
    assert report["temps_left_by_kills"] >= 5 and report["complete"] >= 5, report
    assert os.listdir(target.parent) == ["model.safetensors"]


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_the_file_mode_follows_the_umask(tmp_path, umask, mode):
    path = tmp_path / "m.safetensors"
    old = os.umask(umask)
    try:
        dp.models.Sequential([("flatten",), ("dense", 2)], input_shape=(1, 2, 2)).save(path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == mode


def test_the_file_then_the_directory_are_fsynced_around_the_rename(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append("fsync dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        real_fsync(fd)

    def replace(src, dst):
        events.append("rename")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    dp.models.LeNet().save(tmp_path / "m.safetensors")
    assert events == ["fsync file", "rename", "fsync dir"]


def test_an_interrupted_save_removes_its_temporary(tmp_path, monkeypatch):
    path = tmp_path / "m.safetensors"
    net = small_net()
    net.save(path)
    before = path.read_bytes()
    real_fsync = os.fsync

    def interrupted(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        dp.models.LeNet().save(path)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["m.safetensors"]
    with pytest.raises(FileNotFoundError):  # a directory that is not there: nothing is left anywhere
        net.save(tmp_path / "no" / "m.safetensors")
    assert os.listdir(tmp_path) == ["m.safetensors"]


def test_only_stale_temporaries_of_the_same_target_are_removed(tmp_path):
    path = tmp_path / "m.safetensors"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        host = checkpoint._HOST
        names = {
            "dead": f".m.safetensors.dpcore-{host}-{dead.pid}-{'0' * 16}.tmp",
            "alive": f".m.safetensors.dpcore-{host}-{alive.pid}-{'1' * 16}.tmp",
            "mine": f".m.safetensors.dpcore-{host}-{os.getpid()}-{'2' * 16}.tmp",
            "other host": f".m.safetensors.dpcore-{'f' * 8 if host != 'f' * 8 else 'e' * 8}-{dead.pid}-{'3' * 16}.tmp",
            "other target": f".n.safetensors.dpcore-{host}-{dead.pid}-{'4' * 16}.tmp",
            "not ours": f".m.safetensors.dpcore-{host}-{dead.pid}-x.tmp",
        }
        for name in names.values():
            (tmp_path / name).write_bytes(b"partial")
        dp.models.Sequential([("flatten",), ("dense", 2)], input_shape=(1, 2, 2)).save(path)
        left = set(os.listdir(tmp_path))
        assert names["dead"] not in left
        assert {names[k] for k in names if k != "dead"} | {"m.safetensors"} == left
    finally:
        alive.kill()
        alive.wait()


def test_a_long_target_name_gets_an_attributable_temporary(tmp_path):
    name = "m" * 250 + ".st"
    prefix = checkpoint._temp_prefix(name)
    assert len(prefix) < 100 and prefix != checkpoint._temp_prefix("m" * 249 + "x.st")
    dp.models.Sequential([("flatten",), ("dense", 2)], input_shape=(1, 2, 2)).save(tmp_path / name)
    assert os.listdir(tmp_path) == [name]
