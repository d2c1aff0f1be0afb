"""The layer kinds' table (csrc/layers.c), as the binding and dp.models read
it: layer tuples parsed and refused by its argument names, tensors laid out
and named by it, parameters initialised by its rules exactly as the per-kind
code it replaced did."""
import ast
import pathlib
import re
from collections import OrderedDict

import numpy as np
import pytest

import dpcore as dp
from dpcore import _core

KINDS = dp.models.layer_kinds()


def test_every_kind_is_described():
    assert list(KINDS) == ["conv2d", "dense", "relu", "avgpool", "maxpool", "flatten", "batchnorm", "add",
                           "global_avgpool"]
    for name, info in KINDS.items():
        assert len(info["types"]) == len(info["args"])
        assert set(info["defaults"]) <= set(info["args"])
        for tensor, buffer, dims, init in info["tensors"]:
            assert buffer in ("params", "state") and dims
            assert set(init) == {"normal", "torch", "d2l"}
            assert set(init.values()) <= {"zeros", "ones", "normal", "fan_in_uniform"}
        # the docstring of Sequential is written from the table
        assert repr(name) in dp.models.Sequential.__doc__
    assert KINDS["batchnorm"]["defaults"] == {"eps": 1e-5, "momentum": 0.1}
    assert KINDS["add"]["sources"] == 2


def test_layouts_are_shaped_by_the_table():
    net = dp.models.Sequential([("conv2d", 4, 3, 2, 1), ("batchnorm",), ("relu",), ("maxpool", 2, 2, 0),
                                ("flatten",), ("dense", 5)], input_shape=(3, 9, 9))
    params = [(layer, name, shape) for layer, name, _, shape in net._model.param_layout()]
    assert params == [(0, "weight", (4, 3, 3, 3)), (0, "bias", (4,)), (1, "weight", (4,)), (1, "bias", (4,)),
                      (5, "weight", (5, 16)), (5, "bias", (5,))]
    state = [(layer, name, offset, shape) for layer, name, offset, shape in net._model.state_layout()]
    assert state == [(1, "running_mean", 0, (4,)), (1, "running_var", 4, (4,))]
    w = net.get_weights()
    np.testing.assert_array_equal(w["1.running_mean"], 0.0)
    np.testing.assert_array_equal(w["1.running_var"], 1.0)


def reference_init(net, init, init_std, seed):
    """The initialisation as dp.models wrote it per kind before the table."""
    rng = np.random.default_rng(seed)
    out, fan_in = OrderedDict(), {}
    for layer, kind, offset, shape in net._model.param_layout():
        size = int(np.prod(shape))
        name = f"{net._names[layer]}.{kind}"
        if net._specs[layer][0] == "batchnorm":
            out[name] = np.full(size, 1.0 if kind == "weight" else 0.0, np.float32)
            continue
        if kind == "weight":
            fan_in[layer] = int(np.prod(shape[1:]))
        if init == "normal":
            values = rng.normal(0.0, init_std, size) if kind == "weight" else np.zeros(size)
        elif init == "d2l" and kind == "weight":  # d2l 12.6's train(): weights re-drawn, biases PyTorch's
            values = rng.normal(0.0, init_std, size)
        else:
            bound = 1.0 / np.sqrt(fan_in[layer])
            values = rng.uniform(-bound, bound, size)
        out[name] = values.astype(np.float32)
    return out


@pytest.mark.parametrize("seed", [0, 3])
@pytest.mark.parametrize("make, init, std", [
    (lambda seed: dp.models.LeNet(seed=seed), "normal", 0.01),
    (lambda seed: dp.models.ResNet18(seed=seed), "torch", None),
    (lambda seed: dp.models.ResNet18(seed=seed, init="d2l"), "d2l", 0.01),
    (lambda seed: dp.models.Sequential([("conv2d", 4, 3, 1, 1), ("batchnorm", 1e-3, 0.2), ("relu",),
                                        ("avgpool", 2, 2, 0), ("flatten",), ("dense", 5)],
                                       seed=seed, init_std=0.5), "normal", 0.5),
], ids=["lenet", "resnet18", "resnet18-d2l", "sequential-bn-normal"])
def test_init_rules_reproduce_the_per_kind_code_bitwise(make, init, std, seed):
    net = make(seed)
    expected = reference_init(net, init, std, seed)
    got = net.get_weights()
    for name, value in expected.items():
        assert np.array_equal(got[name].ravel().view(np.uint32), value.view(np.uint32)), name


@pytest.mark.parametrize("spec, exc, match", [
    (("conv2d", 4, 3, 1), ValueError, r"conv2d \(layer 0\): takes 4 arguments \(out_channels, kernel, stride, "
                                      r"padding\), got 3"),
    (("relu", 1), ValueError, r"relu \(layer 0\): takes no arguments, got 1"),
    (("batchnorm", 1e-5, 0.1, 0), ValueError, r"batchnorm \(layer 0\): takes 0 to 2 arguments \(eps, momentum\)"),
    (("maxpool", 2, 2.0, 0), TypeError, r"max_pool2d \(layer 0\): stride must be an integer, got float"),
    (("batchnorm", "x"), TypeError, r"batchnorm \(layer 0\): eps must be a real number, got str"),
    (("dense", 0), ValueError, r"dense \(layer 0\): out_features must be >= 1, got 0"),
    (("conv3d", 1), ValueError, r"unknown layer kind 'conv3d'"),
])
def test_layer_tuples_are_refused_by_argument_name(spec, exc, match):
    with pytest.raises(exc, match=match):
        dp.models.Sequential([spec, ("flatten",), ("dense", 10)])


def test_numpy_integers_are_integers_and_bools_are_not():
    net = dp.models.Sequential([("conv2d", np.int64(2), np.int32(3), np.uint8(1), 0), ("flatten",), ("dense", 3)])
    assert net._model.param_layout()[0][3] == (2, 1, 3, 3)
    # stride=True is a mistake, not a 1 (issue 11: bool is refused where a number is expected)
    with pytest.raises(TypeError, match=r"conv2d \(layer 0\): stride must be an integer, got bool"):
        dp.models.Sequential([("conv2d", 2, 3, True, 0), ("flatten",), ("dense", 3)])
    with pytest.raises(TypeError, match=r"batchnorm \(layer 0\): eps must be a real number, got bool"):
        dp.models.Sequential([("batchnorm", True), ("flatten",), ("dense", 3)])


def test_layer_kinds_is_a_fresh_copy():
    kinds = _core.layer_kinds()
    kinds["conv2d"]["defaults"]["padding"] = 0
    assert _core.layer_kinds()["conv2d"]["defaults"] == {}


# ---- what the table tells the rest of dpcore -----------------------------------------------------

NETWORKS = [
    ([("conv2d", 4, 3, 2, 1), ("batchnorm",), ("relu",), ("maxpool", 2, 2, 0), ("flatten",), ("dense", 5)],
     None, (3, 9, 9)),
    ([("conv2d", 4, 3, 1, 1), ("relu",), ("conv2d", 4, 3, 1, 1), ("add", 0, 2), ("avgpool", 2, 2, 0),
      ("global_avgpool",), ("flatten",), ("dense", 3)], None, (2, 8, 8)),
    ([("conv2d", 3, 1, 1, 0), ("relu",), ("dense", 2)], [None, -1, None], (1, 1, 1)),
]


@pytest.mark.parametrize("layers, sources, shape", NETWORKS)
def test_layer_shapes_are_a_models_layout_without_the_model(layers, sources, shape):
    shapes = _core.layer_shapes(shape, layers, sources)
    net = dp.models.Sequential(layers, input_shape=shape, sources=sources)
    assert [(kind, ins, outs) for kind, ins, outs, _ in shapes] == net._model.layers()
    laid_out = sorted(net._model.param_layout() + net._model.state_layout(), key=lambda t: t[0])
    names = [t[0] for t in KINDS[shapes[0][0]]["tensors"]]
    assert names  # a kind with tensors comes first
    assert [(i, s) for i, (_, _, _, tensors) in enumerate(shapes) for s in tensors] == \
           [(layer, s) for layer, _, _, s in laid_out]


@pytest.mark.parametrize("layers, sources", [
    ([("conv2d", 4, 99, 1, 0)], None),
    ([("conv2d", 4, 3, 0, 0)], None),
    ([("dense", 4)], None),
    ([("relu",), ("add", 0, 5)], None),
    ([("relu",)], [3]),
    ([("batchnorm", 0.0)], None),
    ([("conv3d", 1)], None),
    ([("relu", 1)], None),
    ([["relu"]], None),
])
def test_layer_shapes_refuse_what_a_model_refuses_with_its_message(layers, sources):
    with pytest.raises((ValueError, TypeError)) as built:
        _core.Model((2, 5, 5), layers, 1, 0, sources, "cpu", 0, headless=True)
    with pytest.raises(type(built.value), match="^" + re.escape(str(built.value)) + "$"):
        _core.layer_shapes((2, 5, 5), layers, sources)


def test_how_each_kind_joins_splits_and_views():
    """ModelParallelStrategy and PipelineStrategy read these, never the names."""
    assert {name: (info["split"], info["joins"], info["view"]) for name, info in KINDS.items()} == {
        "conv2d": ("output", None, False), "dense": ("output", None, False),
        "relu": ("channels", None, False), "avgpool": ("channels", None, False),
        "maxpool": ("channels", None, False), "batchnorm": ("channels", None, False),
        "global_avgpool": ("channels", None, False),
        "flatten": (None, None, True), "add": (None, "sum", False)}
    for name, info in KINDS.items():
        assert (info["joins"] is not None) == (info["sources"] > 1), name
        # a split by output channels splits the first extent of every tensor, which is its output channels
        if info["split"] == "output":
            assert info["args"][0] in ("out_channels", "out_features") and \
                all(dims[0] == "out_channels" for _, _, dims, _ in info["tensors"]), name


ROOT = pathlib.Path(__file__).resolve().parent.parent


def kind_sites_in_c():
    """In csrc: {(file, function)} of every `case DP_LAYER_...:` (a switch that
    must name every kind), the files that give a kind its table entry
    (`[DP_LAYER_...] =`), and {(file, function)} of every other line that names
    a kind (code for that kind alone, which a new kind need not touch)."""
    enumerator = "DP_LAYER_(?:" + "|".join(name.upper() for name in KINDS) + ")"
    cases, entries, named = set(), set(), set()
    for path in sorted((ROOT / "csrc").glob("*.[ch]")):
        function = None
        for line in path.read_text().splitlines():
            head = re.match(r"^(?:static )?[a-z_ ]+[ *]+(\w+)\(.*\{", line)
            if head:
                function = head.group(1)
            if re.search(rf"\bcase {enumerator}:", line):
                cases.add((path.name, function))
            elif re.search(rf"\[{enumerator}\]\s*=", line):
                entries.add(path.name)
            elif re.search(rf"\b{enumerator}\b", line) and path.name != "layers.h":
                named.add((path.name, function))
    return cases, entries, named


def kind_sites_in_python(files):
    """(file, line, what) of every place in `files` ({name: Python source}) that
    tells kinds apart by name: a comparison with a kind's name, a dict keyed by
    kinds, or a collection of two or more kind names. A layer tuple such as
    ('dense', 10) uses a kind and is not one; nor is a module's ``__all__``
    (dp.ops has functions named as kinds)."""
    def is_kind(node):
        return isinstance(node, ast.Constant) and node.value in KINDS

    sites = []
    for name, text in files.items():
        tree = ast.parse(text)
        exports = {id(n) for node in ast.walk(tree) if isinstance(node, ast.Assign)
                   and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
                   for n in ast.walk(node.value)}
        for node in ast.walk(tree):
            if id(node) in exports:
                continue
            if isinstance(node, ast.Compare):
                operands = [node.left] + node.comparators
                flat = [e for o in operands for e in (o.elts if isinstance(o, (ast.Tuple, ast.List, ast.Set))
                                                      else [o])]
                if any(is_kind(e) for e in flat):
                    sites.append((name, node.lineno, "compares a kind's name"))
            elif isinstance(node, ast.Dict) and any(k is not None and is_kind(k) for k in node.keys):
                sites.append((name, node.lineno, "a dict keyed by kind names"))
            elif isinstance(node, (ast.Tuple, ast.List, ast.Set)) and sum(map(is_kind, node.elts)) >= 2:
                sites.append((name, node.lineno, "a collection of kind names"))
    return sites


def test_the_dry_run_finds_a_kind_named_in_python():
    source = ('X = ("conv2d", "dense")\nif kind == "add":\n    pass\nif k in ("relu",):\n    pass\n'
              'Y = {"relu": 1}\nZ = [("flatten",), ("dense", 10)]\n__all__ = ["relu", "dense"]\n')
    assert kind_sites_in_python({"x.py": source}) == [
        ("x.py", 1, "a collection of kind names"), ("x.py", 2, "compares a kind's name"),
        ("x.py", 4, "compares a kind's name"), ("x.py", 6, "a dict keyed by kind names")]


def test_a_new_kind_touches_the_table_and_the_backends_only():
    """A dry run of adding a layer kind: every site that names each kind (so that
    a new kind must be added there) is the table (csrc/layers.h's enum,
    csrc/layers.c's entry) and the kind's forward and backward pass in
    csrc/model.c over the backends' kernels (switches that -Wswitch checks for
    a missing kind); the Python package reads the table (_core.layer_kinds,
    _core.layer_shapes) and names no kind."""
    cases, entries, named = kind_sites_in_c()
    print("sites a new layer kind touches:", "layers.h (enum dp_layer_kind)", "layers.c (kinds[])",
          *sorted(f"{f} ({fn})" for f, fn in cases), "backend.h and each backend (its kernels)", sep="\n  ")
    print("code for one existing kind (fusions, shorthands):", *sorted(f"{f} ({fn})" for f, fn in named),
          sep="\n  ")
    assert entries == {"layers.c"}
    assert cases == {("model.c", "forward"), ("model.c", "backward")}
    assert {f for f, _ in named} <= {"layers.c", "model.c"}
    header = (ROOT / "csrc" / "layers.h").read_text()
    enum = re.search(r"typedef enum dp_layer_kind \{(.*?)\} dp_layer_kind;", header, re.S).group(1)
    assert [e.lower() for e in re.findall(r"DP_LAYER_([A-Z0-9_]+)", enum)] == list(KINDS)
    package = ROOT / "python" / "dpcore"
    assert kind_sites_in_python({p.name: p.read_text() for p in sorted(package.glob("*.py"))}) == []
