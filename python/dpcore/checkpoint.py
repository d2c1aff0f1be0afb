"""Checkpoints: the one home of dpcore's model file format.

``net.save(path)`` and ``dp.models.load(path)`` are thin calls into here.

The file is plain safetensors (PyTorch's state_dict names, float32
little-endian tensors), readable by any safetensors reader::

    8 bytes      little-endian length N of the header
    N bytes      JSON header, padded with spaces to a multiple of 8:
                   {"__metadata__": {"dpcore": ARCH, "dpcore_sha256": hex},
                    "<tensor name>": {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, ...}
    the data     the tensors' bytes, back to back, exactly covering the rest of the file

ARCH is a JSON object (a string in the metadata): ``format``
(``"dpcore-sequential-2"``), ``class`` (``Sequential``, ``LeNet`` or
``ResNet18``), ``layers``, ``input_shape``, ``sources``, ``names`` (the
arguments of :class:`dpcore.models.Sequential`) and ``sha256``: tensor name
-> SHA-256 of the tensor's bytes as stored. ``dpcore_sha256`` is the SHA-256 of
the ARCH string itself, so the architecture and the tensor digests are covered
too; the header's remaining fields (dtype, shape, offsets) are each checked
against what the architecture implies.

Checksum: SHA-256 (hashlib, OpenSSL underneath). It is a standard digest
(``sha256sum`` of a tensor's bytes gives the same), it has no length limit on
what it protects (CRC-32's guarantees weaken past 512 MB, and its 2**-32 miss
rate is per tensor), and with the SHA extensions of current x86 and ARM CPUs
it runs at about 2 GB/s, a few tens of milliseconds for ResNet-18's 45 MB.
It detects damage (bit rot, truncation, a bad copy), not tampering: anyone who
edits a file can recompute it.

Loading refuses, with a :class:`dpcore.DataError` (a ValueError) that names
the file and the problem, before any model is built or any buffer of the
file's declared sizes is allocated: a header that is not strict safetensors
(duplicate keys, offsets that leave gaps, overlap or run past the file, a
header over :data:`MAX_HEADER_BYTES`), a dtype other than F32, metadata that
is not a dpcore architecture, a layer list the layer kinds' table does not
accept, a class whose layers are not that class's, and any tensor missing,
extra, or of another shape than the architecture implies (every shape is
inferred from the layer specs by the C core's own rules,
``_core.layer_shapes``, without building a model or allocating its buffers;
after the model is built its own layout is compared once more). Then, as the
tensors are read into the model's buffers: a SHA-256 that disagrees, and
non-finite values unless ``allow_nonfinite=True``.

Files of format ``dpcore-sequential-1`` (dpcore before checksums) still load,
with every check above except the checksums; a file that says format 1 but
carries checksum fields is refused, so no single damaged byte turns a
checksummed file into one that skips them.

Writing is atomic and durable: a temporary file beside the target (mode
0666 & ~umask, like open()), fsync, rename over the target, fsync of the
directory. A writer killed mid-write leaves its temporary, named
``.<target>.dpcore-<host>-<pid>-<random>.tmp``; the next save to the same
target removes those whose writer (same host, that pid) is gone.
"""
import errno
import hashlib
import json
import math
import os
import re
import secrets
import socket
import stat
import sys
from collections import OrderedDict, namedtuple

import numpy as np

from . import _core
from .errors import DataError

__all__ = ["FORMAT", "MAX_HEADER_BYTES", "save", "load", "read"]

FORMAT = "dpcore-sequential-2"
_LEGACY_FORMAT = "dpcore-sequential-1"  # no checksums
_ARCH_KEY = "dpcore"
_ARCH_SUM_KEY = "dpcore_sha256"
# ResNet-18's header is 24 KB (62 tensors); 1 MiB holds some 2,500 tensors.
# A bound on the header bounds what parsing it can cost: its JSON's Python
# objects, and a model of that many layers (95,000 relu layers, the most a
# header at the limit can declare, load in 0.9 s and 42 MB here). save refuses
# a model whose header is larger.
MAX_HEADER_BYTES = 1 << 20
_INT_MAX = 2**31 - 1  # the C core's largest size (shapes.c)
_ARCH_KEYS = ("format", "class", "layers", "input_shape", "sources", "names")

_LAYER_KINDS = _core.layer_kinds()
# The classes a checkpoint may name ({name: class}; "Sequential" builds every
# model that load reads) and the init= value that builds one without drawing
# its weights: dpcore.models's, which imports this module and registers them
# (register_classes); this module never imports dpcore.models.
_CLASSES = {}
_SKIP_INIT = None


def register_classes(classes, skip_init):
    global _SKIP_INIT
    _CLASSES.update(classes)
    _SKIP_INIT = skip_init

# a tensor the header declares: its shape and where its bytes lie in the data region
_Stored = namedtuple("_Stored", ["name", "shape", "begin", "end"])
# what an architecture implies: the model's tensors, in the model's order
_Planned = namedtuple("_Planned", ["name", "buffer", "shape"])
_Header = namedtuple("_Header", ["arch", "tensors", "stored", "sha256", "data_bytes", "training"],
                     defaults=(None,))

# The optional training section (dp.train(..., checkpoint=path)): the SGD
# momentum buffer of every parameter tensor, as tensors named
# _MOMENTUM_PREFIX + the parameter's name, and the training state as a JSON
# object in the metadata, with its own SHA-256.
TRAINING_FORMAT = "dpcore-training-1"
_TRAINING_KEY = "dpcore_training"
_TRAINING_SUM_KEY = "dpcore_training_sha256"
_MOMENTUM_PREFIX = "__momentum__."
#: the prefix of the momentum tensors' names, which no model tensor may have
MOMENTUM_PREFIX = _MOMENTUM_PREFIX
_TRAINING_KEYS = ("format", "epoch", "hyper", "data", "history", "sha256")
_HISTORY_KEYS = ("train_loss", "train_acc", "test_acc", "epoch_seconds", "devices")
# a training section: its state (the JSON object) and its momentum tensors (name -> _Stored)
_Training = namedtuple("_Training", ["state", "momentum"])


def _fail(where, problem):
    raise DataError(f"{where}: {problem}")


def _type_name(value):
    return {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null",
            int: "integer", float: "number"}.get(type(value), type(value).__name__)


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


# ---- the safetensors header ---------------------------------------------------

def _pairs_without_duplicates(pairs):
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"key {dup!r} appears twice in one object")
    return dict(pairs)


def _refuse_constant(name):
    raise ValueError(f"{name} is not JSON")


def _json(text, where, what):
    """text parsed as strict JSON (no duplicate keys, no NaN/Infinity)."""
    try:
        return json.loads(text, object_pairs_hook=_pairs_without_duplicates, parse_constant=_refuse_constant)
    except RecursionError:
        _fail(where, f"{what} is nested too deeply")
    except ValueError as e:  # JSONDecodeError, and over-long integers
        _fail(where, f"{what} is not valid JSON ({e})")


def _header_length(prefix, file_bytes, where):
    """N from the first 8 bytes, checked against the file's size and the limit."""
    if len(prefix) < 8:
        _fail(where, f"not a readable safetensors file: {file_bytes} bytes, shorter than the 8-byte header length")
    n = int.from_bytes(prefix, "little")
    if n > MAX_HEADER_BYTES:
        _fail(where, f"not a readable safetensors file: header length {n} is over dpcore's limit of "
                     f"{MAX_HEADER_BYTES} bytes (a damaged or foreign file)")
    if 8 + n > file_bytes:
        _fail(where, f"not a readable safetensors file: truncated: the header needs {8 + n} bytes, the file has "
                     f"{file_bytes}")
    return n


def _parse_header(raw, data_bytes, where):
    """The checked header of a file whose data region has data_bytes bytes."""
    try:
        text = bytes(raw).decode("utf-8")
    except UnicodeDecodeError as e:
        _fail(where, f"not a readable safetensors file: the header is not UTF-8 ({e})")
    header = _json(text, where, "the safetensors header")
    if not isinstance(header, dict):
        _fail(where, f"not a readable safetensors file: the header is a JSON {_type_name(header)}, not an object")
    meta = header.pop("__metadata__", None)
    stored = [_stored_tensor(name, entry, where) for name, entry in header.items()]
    _check_tiling(stored, data_bytes, where)
    if meta is None or (isinstance(meta, dict) and _ARCH_KEY not in meta):
        _fail(where, "not a dpcore model file: no 'dpcore' architecture in its metadata")
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        _fail(where, "not a readable safetensors file: __metadata__ must map strings to strings")
    arch_text = meta[_ARCH_KEY]
    if _ARCH_SUM_KEY in meta:  # before anything in the architecture is believed
        digest = hashlib.sha256(arch_text.encode("utf-8", "surrogatepass")).hexdigest()
        if meta[_ARCH_SUM_KEY] != digest:
            _fail(where, f"the architecture metadata is damaged: its SHA-256 is {digest}, the file records "
                         f"{meta[_ARCH_SUM_KEY]!r:.80}")
    arch = _json(arch_text, where, "the 'dpcore' metadata")
    if not isinstance(arch, dict):
        _fail(where, f"not a dpcore model file: the 'dpcore' metadata is a JSON {_type_name(arch)}, not an object")
    fmt = arch.get("format")
    if fmt == FORMAT:
        expected_meta, keys = {_ARCH_KEY, _ARCH_SUM_KEY}, _ARCH_KEYS + ("sha256",)
    elif fmt == _LEGACY_FORMAT:
        expected_meta, keys = {_ARCH_KEY}, _ARCH_KEYS
    else:
        _fail(where, f"not a dpcore model file: unknown format {fmt!r} (dpcore reads {FORMAT!r} and "
                     f"{_LEGACY_FORMAT!r})")
    training = None
    if fmt == FORMAT and (_TRAINING_KEY in meta or _TRAINING_SUM_KEY in meta):
        training = _training_section(meta.pop(_TRAINING_KEY, None), meta.pop(_TRAINING_SUM_KEY, None), where)
    if set(meta) != expected_meta:
        _fail(where, f"not a dpcore model file: format {fmt} has metadata keys {sorted(expected_meta)}, this file "
                     f"has {sorted(meta)}")
    optional = () if fmt == FORMAT else ("sources", "names")  # format 1 before ResNet18 had neither
    missing = [k for k in keys if k not in arch and k not in optional]
    extra = sorted(k for k in arch if k not in keys)
    if missing or extra:
        _fail(where, f"not a dpcore model file: the architecture misses {missing} and has unexpected keys {extra}")
    plan, arch = _plan(arch, where)
    sums = arch.pop("sha256", None)
    if fmt == FORMAT:
        if not isinstance(sums, dict) or not all(isinstance(v, str) for v in sums.values()):
            _fail(where, "not a dpcore model file: 'sha256' must map tensor names to hex digests")
        if set(sums) != {p.name for p in plan}:
            _fail(where, f"not a dpcore model file: 'sha256' names {sorted(sums)}, the architecture's tensors are "
                         f"{sorted(p.name for p in plan)}")
    if training is not None:
        stored, momentum = _match_momentum(plan, stored, training, where)
        training = _Training(training, momentum)
    _match(plan, stored, where)
    return _Header(arch, plan, {s.name: s for s in stored}, sums, data_bytes, training)


def _training_section(text, digest, where):
    """The checked training state of a training checkpoint's metadata."""
    def bad(problem):
        _fail(where, f"the training state is damaged: {problem}")

    if text is None or digest is None:
        bad(f"the metadata needs both {_TRAINING_KEY!r} and {_TRAINING_SUM_KEY!r}")
    actual = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
    if actual != digest:
        bad(f"its SHA-256 is {actual}, the file records {digest!r:.80}")
    state = _json(text, where, "the training state")
    if not isinstance(state, dict) or sorted(state) != sorted(_TRAINING_KEYS):
        bad(f"expected an object with keys {list(_TRAINING_KEYS)}")
    if state["format"] != TRAINING_FORMAT:
        bad(f"unknown format {state['format']!r:.80} (dpcore reads {TRAINING_FORMAT!r})")
    if not (_is_int(state["epoch"]) and state["epoch"] >= 1):
        bad(f"epoch must be an integer >= 1, got {state['epoch']!r:.80}")
    hyper, data, history = state["hyper"], state["data"], state["history"]
    if not (isinstance(hyper, dict) and sorted(hyper) == ["lr", "momentum", "weight_decay"]
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                    for v in hyper.values())):
        bad("hyper must hold the finite numbers lr, momentum and weight_decay")
    if not (isinstance(data, dict) and sorted(data) == ["batch_size", "epochs_started", "num_examples", "seed"]
            and all(v is None or (_is_int(v) and v >= 0) for v in data.values())):
        bad("data must hold seed, batch_size, num_examples and epochs_started, each an integer >= 0 or null")
    # a dp.data iterator's order (all three known) or none at all: dp.train restores all three or none
    if len({data[k] is None for k in ("batch_size", "num_examples", "epochs_started")}) != 1 or (
            data["batch_size"] is None and data["seed"] is not None) or data["batch_size"] == 0:
        bad("data must hold batch_size >= 1, num_examples and epochs_started all, or all null (and then no seed)")
    if not (isinstance(history, dict) and sorted(history) == sorted(_HISTORY_KEYS)):
        bad(f"history must hold {list(_HISTORY_KEYS)}")
    for key in _HISTORY_KEYS:
        values = history[key]
        kinds = (str,) if key == "devices" else (int, float)
        if not (isinstance(values, list) and all(isinstance(v, kinds) and not isinstance(v, bool) for v in values)):
            bad(f"history[{key!r}] must be a list of {'strings' if key == 'devices' else 'numbers'}")
    if not (len(history["train_loss"]) == len(history["train_acc"]) == len(history["epoch_seconds"])
            == state["epoch"] and len(history["test_acc"]) in (0, state["epoch"])):
        bad(f"the history does not hold {state['epoch']} epochs")
    sums = state["sha256"]
    if not (isinstance(sums, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in sums.items())):
        bad("sha256 must map momentum tensor names to hex digests")
    return state


def _match_momentum(plan, stored, training, where):
    """The model's tensors of `stored`, after checking that the rest are exactly
    one momentum tensor per parameter tensor, of its shape, with a digest."""
    params = {_MOMENTUM_PREFIX + p.name: p for p in plan if p.buffer == "params"}
    momentum = {s.name: s for s in stored if s.name.startswith(_MOMENTUM_PREFIX)}
    if set(momentum) != set(params) or set(training["sha256"]) != set(params):
        _fail(where, f"the training state is damaged: the momentum tensors are {sorted(momentum)} with digests for "
                     f"{sorted(training['sha256'])}, the parameters need {sorted(params)}")
    for name, s in momentum.items():
        if s.shape != params[name].shape:
            _fail(where, f"tensor {name!r} has shape {list(s.shape)}, its parameter's is {list(params[name].shape)}")
    return [s for s in stored if s.name not in momentum], momentum


def _stored_tensor(name, entry, where):
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        _fail(where, f"not a readable safetensors file: tensor {name!r} must be an object with keys dtype, shape, "
                     f"data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype != "F32":
        _fail(where, f"tensor {name!r} has dtype {dtype!r}; dpcore checkpoints hold float32 (F32) tensors")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        _fail(where, f"not a readable safetensors file: tensor {name!r} has shape {shape!r}, not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        _fail(where, f"not a readable safetensors file: tensor {name!r} has data_offsets {offsets!r}, not "
                     f"[begin, end] with 0 <= begin <= end")
    size = 4
    for d in shape:
        size *= d
    if offsets[1] - offsets[0] != size:
        _fail(where, f"not a readable safetensors file: tensor {name!r} of shape {shape} needs {size} bytes, its "
                     f"data_offsets {offsets} span {offsets[1] - offsets[0]}")
    return _Stored(name, tuple(shape), offsets[0], offsets[1])


def _check_tiling(stored, data_bytes, where):
    """The tensors cover the data region exactly: no gap, no overlap, nothing past its end."""
    at = 0
    for s in sorted(stored, key=lambda s: (s.begin, s.end)):
        if s.begin != at:
            what = "overlaps the tensor before it" if s.begin < at else f"leaves a gap of {s.begin - at} bytes"
            _fail(where, f"not a readable safetensors file: tensor {s.name!r} at bytes {s.begin}..{s.end} {what}")
        at = s.end
    if at != data_bytes:
        problem = "truncated" if at > data_bytes else "has trailing bytes"
        _fail(where, f"not a readable safetensors file: {problem}: the tensors need {at} bytes of data, the file "
                     f"holds {data_bytes}")


def _match(plan, stored, where):
    """Exactly the tensors the architecture implies, each of its shape."""
    have = {s.name: s for s in stored}
    missing = [p.name for p in plan if p.name not in have]
    extra = sorted(set(have) - {p.name for p in plan})
    if missing or extra:
        _fail(where, f"the tensors do not match the architecture: missing {missing}, unexpected {extra}")
    for p in plan:
        if have[p.name].shape != p.shape:
            _fail(where, f"tensor {p.name!r} has shape {list(have[p.name].shape)}, the architecture implies "
                         f"{list(p.shape)}")


# ---- the architecture -----------------------------------------------------------

def _plan(arch, where):
    """(tensors, architecture) of an architecture object: its values checked
    and every tensor's shape inferred from the layer specs, without building
    a model. Raises DataError naming `where`."""
    def bad(problem):
        _fail(where, f"not a dpcore model file: {problem}")

    shape = arch["input_shape"]
    if not (isinstance(shape, list) and len(shape) == 3 and all(_is_int(d) for d in shape)):
        bad(f"input_shape must be a list of 3 integers (C, H, W), got {shape!r}")
    layers = arch["layers"]
    if not isinstance(layers, list) or not layers:
        bad(f"layers must be a non-empty list, got {_type_name(layers)}")
    n = len(layers)
    sources, names = arch.get("sources"), arch.get("names")
    if sources is not None and not (isinstance(sources, list) and len(sources) == n
                                    and all(s is None or _is_int(s) for s in sources)):
        bad(f"sources must be null or a list of {n} integers or nulls")
    if names is None:
        names = [str(i) for i in range(n)]
    if not (isinstance(names, list) and len(names) == n and all(isinstance(s, str) for s in names)):
        bad(f"names must be a list of {n} strings")
    specs = [_layer_spec(i, spec, bad) for i, spec in enumerate(layers)]
    for d, label in zip(shape, ("channels", "height", "width")):
        if not 1 <= d <= _INT_MAX:
            bad(f"input_shape: {label} {d} is outside 1..{_INT_MAX}")
    _check_volume(tuple(shape), "input_shape", bad)
    for i, (kind, args) in enumerate(specs):
        label = f"layers[{i}] ({kind})"
        info = _LAYER_KINDS[kind]
        # checked even where the kind names its own sources
        reads = [] if sources is None or sources[i] is None else [("source", sources[i])]
        reads += [(info["args"][a], args[a]) for a in range(info["sources"])]
        for what, src in reads:
            if not -1 <= src < i:
                bad(f"{label}: {what} {src} is not an earlier layer (0..{i - 1}) or the input (-1)")
    try:  # the C core's shape inference, as it builds the model (its message names the layer)
        laid_out = _core.layer_shapes(tuple(shape), [(kind,) + args for kind, args in specs], sources)
    except (ValueError, TypeError) as e:
        bad(str(e))
    plan = [_Planned(f"{names[i]}.{tensor[0]}", tensor[1], tshape)
            for i, (kind, _, _, tshapes) in enumerate(laid_out)
            for tensor, tshape in zip(_LAYER_KINDS[kind]["tensors"], tshapes)]
    outs = [out for _, _, out, _ in laid_out]
    if outs[-1][1:] != (1, 1):
        bad(f"the last layer produces {outs[-1]}, not logits (classes, 1, 1)")
    seen = set()
    for p in plan:
        if p.name in seen:
            bad(f"two tensors are named {p.name!r} (names repeat)")
        seen.add(p.name)
    _check_class(dict(arch, layers=[[kind] + list(args) for kind, args in specs], sources=sources, names=names),
                 outs[-1][0], bad)
    # as stored (a layer's defaults left out, as its model has them)
    return plan, dict(arch, sources=arch.get("sources"), names=arch.get("names"))


def _layer_spec(i, spec, bad):
    """(kind, args with defaults filled) of layers[i], its types checked."""
    if not (isinstance(spec, list) and spec and isinstance(spec[0], str)):
        bad(f"layers[{i}] must be a list [kind, *args], got {spec!r:.80}")
    kind, args = spec[0], spec[1:]
    if kind not in _LAYER_KINDS:
        bad(f"layers[{i}]: unknown layer kind {kind!r:.40} (dpcore knows {', '.join(_LAYER_KINDS)})")
    info = _LAYER_KINDS[kind]
    names = info["args"]
    required = len([a for a in names if a not in info["defaults"]])
    if not required <= len(args) <= len(names):
        bad(f"layers[{i}] ({kind}) takes {required}..{len(names)} arguments ({', '.join(names)}), got {len(args)}")
    full = list(args) + [info["defaults"][a] for a in names[len(args):]]
    for name, typ, value in zip(names, info["types"], full):
        if typ == "int":
            ok = _is_int(value)
        else:  # a finite double (JSON has no infinity to save it as)
            try:
                ok = (_is_int(value) or isinstance(value, float)) and math.isfinite(float(value))
            except OverflowError:
                ok = False
        if not ok:
            bad(f"layers[{i}] ({kind}): {name} must be {'an integer' if typ == 'int' else 'a finite number'}, got "
                f"{value!r:.40}")
        if typ == "int" and not -2**63 <= value < 2**63:
            bad(f"layers[{i}] ({kind}): {name} {value} is out of range (more than 64 bits)")
    return kind, tuple(full)


def _check_volume(out, label, bad):
    c, h, w = out
    if c * h * w > _INT_MAX:
        bad(f"{label}: {out} has {c * h * w} values per sample, more than the largest supported {_INT_MAX}")


def _check_class(arch, num_classes, bad):
    """The class is one dpcore knows, and a built-in network's layers are exactly its own."""
    name = arch["class"]
    if not isinstance(name, str) or name not in _CLASSES:
        bad(f"class {name!r:.40} is not one of dpcore's ({', '.join(_CLASSES)})")
    expected = _CLASSES[name]._checkpoint_architecture(tuple(arch["input_shape"]), num_classes)
    if expected is None:
        return
    for key in ("input_shape", "layers", "sources", "names"):
        if _normal_value(key, expected[key], len(arch["layers"])) != arch[key]:
            bad(f"class {name}, but its {key} are not {name}'s")


def _normal_value(key, value, n):
    """A class's architecture value as _plan normalises a file's."""
    if key == "layers":
        def bad(problem):
            raise AssertionError(f"a dpcore class's own layers: {problem}")
        return [[spec[0]] + list(_layer_spec(i, list(spec), bad)[1]) for i, spec in enumerate(value)]
    if key == "names" and value is None:
        return [str(i) for i in range(n)]
    return None if value is None else list(value)


def architecture(net):
    """The architecture object of a model, as save writes it (without checksums)."""
    def ints(values):
        return None if values is None else [None if v is None else int(v) for v in values]

    layers = []
    for spec in net._specs:
        types = _LAYER_KINDS[spec[0]]["types"] if spec and spec[0] in _LAYER_KINDS else ()
        layers.append([str(spec[0])] + [float(v) if t == "float" else int(v) for v, t in zip(spec[1:], types)])
    arch = {"format": FORMAT, "class": "Sequential", "layers": layers, "input_shape": [int(d) for d in net.input_shape],
            "sources": ints(net._sources), "names": [str(s) for s in net._names]}
    # the first dpcore class in its MRO whose architecture it has (a subclass
    # of LeNet with other layers is saved as a Sequential)
    for cls in type(net).__mro__:
        if _CLASSES.get(cls.__name__) is cls:
            try:
                _plan(dict(arch, **{"class": cls.__name__}), "")
            except DataError:
                continue
            arch["class"] = cls.__name__
            break
    return arch


# ---- the tensors' bytes --------------------------------------------------------------

def _digest(header, name):
    """The SHA-256 the file records for a tensor (None in a file of format 1)."""
    return None if header.sha256 is None else header.sha256[name]


def _check_tensor(where, name, raw, digest, allow_nonfinite):
    """raw: a tensor's bytes as stored (float32 little-endian)."""
    if digest is not None:
        actual = hashlib.sha256(raw).hexdigest()
        if actual != digest:
            _fail(where, f"tensor {name!r} is damaged: the SHA-256 of its bytes is {actual}, the file records "
                         f"{digest}")
    if not allow_nonfinite:
        values = np.frombuffer(raw, dtype="<f4")
        step = 1 << 20  # bounded temporaries
        bad = sum(int(np.count_nonzero(~np.isfinite(values[i:i + step]))) for i in range(0, len(values), step))
        if bad:
            _fail(where, f"tensor {name!r} holds {bad} non-finite values (NaN or infinity) of {len(values)}; load "
                         f"with allow_nonfinite=True to accept them")


def _parse(data, where="<bytes>", allow_nonfinite=False):
    """(architecture, OrderedDict name -> float32 array) of a checkpoint held in
    `data` (bytes-like), every check of load made; the arrays are read-only
    views of data. Raises DataError naming `where`."""
    data = memoryview(data).cast("B")
    n = _header_length(data[:8], len(data), where)
    header = _parse_header(data[8:8 + n], len(data) - 8 - n, where)
    start = 8 + n
    out = OrderedDict()
    for p in header.tensors:
        s = header.stored[p.name]
        raw = data[start + s.begin:start + s.end]
        _check_tensor(where, p.name, raw, _digest(header, p.name), allow_nonfinite)
        out[p.name] = np.frombuffer(raw, dtype="<f4").reshape(p.shape)
    return header.arch, out


def _open_regular(where):
    """``where`` opened for reading in binary, refused unless it is a regular file:
    a FIFO or a character device would block the reader or never end.
    Opened without blocking and checked on the descriptor, so that nothing
    swapped in between a check and the open is read."""
    fd = os.open(where, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "is a directory, not a checkpoint file", where)
        if not stat.S_ISREG(mode):
            _fail(where, "not a regular file (a FIFO, device or socket); a checkpoint is a regular file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read(path, allow_nonfinite=False):
    """(architecture, OrderedDict name -> float32 array) of a checkpoint file,
    checked as :func:`load` checks it, without building a model."""
    where = os.fsdecode(path)  # a str for messages (a bytes path decodes reversibly)
    with _open_regular(where) as f:
        data = f.read()
    return _parse(data, where, allow_nonfinite)


def _read_exactly(f, offset, view, where):
    """Fill view (bytes) from the file at offset."""
    f.seek(offset)
    got = 0
    while got < len(view):
        k = f.readinto(view[got:])
        if not k:
            _fail(where, f"truncated while reading: the file ended at byte {offset + got}")
        got += k


def load(path, devices=None, allow_nonfinite=False):
    """A model saved with ``net.save(path)``; see :func:`dpcore.models.load`."""
    from . import _check
    from .devices import check_device

    where = _check.path("path", path)  # a str for messages (a bytes path decodes reversibly)
    allow_nonfinite = _check.boolean("allow_nonfinite", allow_nonfinite)
    if devices is not None:  # so that the file is not blamed for a bad argument
        devices = [check_device(d) for d in _check.device_names("devices", devices)]
    with _open_regular(where) as f:
        file_bytes = os.fstat(f.fileno()).st_size
        n = _header_length(f.read(8), file_bytes, where)
        raw = f.read(n)
        if len(raw) != n:
            _fail(where, "truncated while reading the header")
        header = _parse_header(raw, file_bytes - 8 - n, where)
        arch = header.arch
        # everything declared is now checked against the file: the model's
        # buffers are as large as the file's tensors
        try:
            net = _CLASSES["Sequential"](arch["layers"], input_shape=arch["input_shape"], devices=devices,
                             sources=arch["sources"], names=arch["names"], init=_SKIP_INIT)
        except (ValueError, TypeError, OverflowError) as e:
            if isinstance(e, DataError):
                raise
            raise DataError(f"{where}: dpcore cannot build the model it describes: {e}") from e
        entries = net._entries()
        built = [(name, tuple(shape)) for name, _, _, shape in entries]
        if built != [(p.name, p.shape) for p in header.tensors]:
            _fail(where, f"the model built from the architecture has tensors {built}, the file's architecture "
                         f"implies {[(p.name, p.shape) for p in header.tensors]}")
        buffers = {"params": np.zeros(net._model.nparams, dtype=np.float32),
                   "state": np.zeros(len(net._model.get_state()), dtype=np.float32)}
        for name, buffer, offset, shape in entries:
            s = header.stored[name]
            view = buffers[buffer][offset:offset + (s.end - s.begin) // 4]
            raw = memoryview(view).cast("B")
            _read_exactly(f, 8 + n + s.begin, raw, where)
            _check_tensor(where, name, raw, _digest(header, name), allow_nonfinite)
            if sys.byteorder == "big":
                view.byteswap(inplace=True)
    net._load_buffers(buffers["params"], buffers["state"])
    net.__class__ = _CLASSES[arch["class"]]
    return net


# ---- writing ------------------------------------------------------------------------

def _sha256(a):
    return hashlib.sha256(memoryview(a).cast("B")).hexdigest()


def _encode(arch, tensors, training=None, momentum=()):
    """The header bytes (length prefix included) for arch and [(name, '<f4' array)],
    with a training section when `training` (the state without digests) and
    `momentum` ([(tensor name, '<f4' array)]) are given."""
    arch = dict(arch, sha256={name: _sha256(a) for name, a in tensors})
    arch_text = json.dumps(arch, separators=(",", ":"), allow_nan=False)
    header = {"__metadata__": {_ARCH_KEY: arch_text,
                               _ARCH_SUM_KEY: hashlib.sha256(arch_text.encode("utf-8")).hexdigest()}}
    if training is not None:
        text = json.dumps(dict(training, format=TRAINING_FORMAT, sha256={n: _sha256(a) for n, a in momentum}),
                          separators=(",", ":"), allow_nan=False)
        header["__metadata__"][_TRAINING_KEY] = text
        header["__metadata__"][_TRAINING_SUM_KEY] = hashlib.sha256(text.encode("utf-8")).hexdigest()
        tensors = list(tensors) + list(momentum)
    at = 0
    for name, a in tensors:
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [at, at + a.nbytes]}
        at += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw, at


def save(net, path, training=None):
    """Write net's architecture and tensors to path, atomically (see the module's
    docstring); with ``training`` (a dict: epoch, hyper, data, history), also
    the momentum buffers and that state: a checkpoint dp.train can resume from."""
    where = os.fsdecode(path)  # a str for messages (a bytes path decodes reversibly)
    arch = architecture(net)
    try:
        _plan(dict(arch), where)  # what load would refuse is not written
    except DataError as e:
        raise ValueError(f"cannot save this model: {e}") from None
    tensors = [(name, np.ascontiguousarray(a, dtype="<f4")) for name, a in net.get_weights().items()]
    momentum = []
    if training is not None:
        velocity = net._model.get_velocity()
        momentum = [(_MOMENTUM_PREFIX + name, np.ascontiguousarray(
                     velocity[offset:offset + int(np.prod(shape))].reshape(shape), dtype="<f4"))
                    for name, buffer, offset, shape in net._entries() if buffer == "params"]
    head, data_bytes = _encode(arch, tensors, training, momentum)
    if len(head) - 8 > MAX_HEADER_BYTES:
        raise ValueError(f"{where}: the model's header would take {len(head) - 8} bytes, over the limit of "
                         f"{MAX_HEADER_BYTES} that load accepts (too many layers)")
    _parse_header(head[8:], data_bytes, where)  # loadable, by the loader's own checks
    atomic_write(where, [head] + [memoryview(a).cast("B") for _, a in tensors + momentum])


def load_training(net, path):
    """Restore a training checkpoint written by ``save(net, path, training)``
    into ``net`` (its architecture must be the file's): parameters, running
    statistics and momentum buffers on every replica. Returns the training
    state (epoch, hyper, data, history). Every check of :func:`load` is made;
    a file without a training section, or of another architecture, raises
    DataError."""
    where = os.fsdecode(path)
    with _open_regular(where) as f:
        data = memoryview(f.read()).cast("B")
    n = _header_length(data[:8], len(data), where)
    header = _parse_header(data[8:8 + n], len(data) - 8 - n, where)
    if header.training is None:
        _fail(where, "not a training checkpoint: it holds a model but no training state (saved by net.save, not "
                     "by dp.train(..., checkpoint=...))")
    mine = architecture(net)
    if {k: header.arch.get(k) for k in _ARCH_KEYS} != {k: mine.get(k) for k in _ARCH_KEYS}:
        _fail(where, f"the checkpoint is of another model: {header.arch['class']} with {len(header.arch['layers'])} "
                     f"layers and input {header.arch['input_shape']}; this model is {mine['class']} with "
                     f"{len(mine['layers'])} layers and input {mine['input_shape']}")
    start = 8 + n
    buffers = {"params": np.zeros(net._model.nparams, dtype=np.float32),
               "state": np.zeros(len(net._model.get_state()), dtype=np.float32),
               "velocity": np.zeros(net._model.nparams, dtype=np.float32)}
    state, momentum = header.training
    for name, buffer, offset, shape in net._entries():
        targets = [(name, buffer, header.stored[name], _digest(header, name))]
        if buffer == "params":
            tensor = _MOMENTUM_PREFIX + name
            targets.append((tensor, "velocity", momentum[tensor], state["sha256"][tensor]))
        for tensor, into, s, digest in targets:
            raw = data[start + s.begin:start + s.end]
            _check_tensor(where, tensor, raw, digest, False)
            buffers[into][offset:offset + (s.end - s.begin) // 4] = np.frombuffer(raw, dtype="<f4")
    if net._timeout:  # across processes: rank 0's weights first (a collective that zeroes the momentum), then it
        net._load_buffers(buffers["params"], buffers["state"])
        net._set_replicas(velocity=buffers["velocity"])
    else:  # all three in one call: an interruption leaves the model as it was or wholly restored
        net._set_replicas(params=buffers["params"], state=buffers["state"], velocity=buffers["velocity"])
    return {k: v for k, v in state.items() if k != "sha256"}


_HOST = hashlib.sha256(socket.gethostname().encode("utf-8", "replace")).hexdigest()[:8]


def _temp_prefix(base):
    """'.<target>.dpcore-': a temporary's name starts with its target's (hashed when long)."""
    raw = base.encode("utf-8", "surrogateescape")
    if len(raw) > 120:  # cut in bytes: the temporary's name must fit NAME_MAX (255 bytes) as the target's does
        base = raw[:60].decode("utf-8", "ignore") + "~" + hashlib.sha256(raw).hexdigest()[:16]
    return f".{base}.dpcore-"


def _pid_gone(pid):
    """True when no process (zombies count as gone) has this pid on this machine."""
    if os.name != "posix" or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError, ValueError):
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False


def _remove_stale_temps(directory, prefix):
    """Remove the temporaries of this target whose writer is gone (same host, dead pid)."""
    pattern = re.compile(re.escape(prefix) + _HOST + r"-([0-9]{1,10})-[0-9a-f]{16}\.tmp\Z")
    try:
        names = [e.name for e in os.scandir(directory) if e.name.startswith(prefix)]
    except OSError:
        return
    for name in names:
        m = pattern.match(name)
        if m and _pid_gone(int(m.group(1))):
            try:
                os.unlink(os.path.join(directory, name))
            except OSError:
                pass


def _fsync_directory(directory):
    """Make a rename in directory durable (POSIX; some file systems cannot, and say EINVAL)."""
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def atomic_write(path, chunks):
    """Write the bytes-like chunks to path atomically and durably: a temporary
    beside it (mode 0666 & ~umask), fsync, rename, fsync of the directory.
    On any error (or KeyboardInterrupt) the temporary is removed and path is
    untouched."""
    path = os.fspath(path)
    if os.path.isdir(path):  # named before a temporary is written (rename would say so, naming the temporary)
        raise IsADirectoryError(errno.EISDIR, "is a directory; give a file name", path)
    directory, base = os.path.split(os.path.abspath(path))
    prefix = _temp_prefix(base)
    _remove_stale_temps(directory, prefix)
    tmp = os.path.join(directory, f"{prefix}{_HOST}-{os.getpid()}-{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        with open(fd, "wb", closefd=True) as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_directory(directory)
