"""net.save / dp.models.load: safetensors with PyTorch state_dict names, atomic writes."""
import errno
import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import dpcore as dp


def test_round_trip_keeps_weights_predictions_and_class(tmp_path):
    net = dp.models.LeNet(seed=5)
    X = np.random.default_rng(0).random((6, 1, 28, 28), dtype=np.float32)
    y = np.arange(6)
    net.train_step(X, y, lr=0.1)
    path = tmp_path / "lenet.safetensors"
    net.save(path)
    back = dp.models.load(path)
    assert type(back).__name__ == "LeNet"
    for name, w in net.get_weights().items():
        assert np.array_equal(w, back.get_weights()[name]), name
    assert np.array_equal(net.predict(X), back.predict(X))
    # the file is plain safetensors with PyTorch's names
    tensors = load_file(str(path))
    assert sorted(tensors) == sorted(["0.weight", "0.bias", "3.weight", "3.bias", "7.weight", "7.bias", "9.weight",
                                      "9.bias"])
    assert tensors["0.weight"].shape == (20, 1, 3, 3)


def test_save_is_atomic_and_leaves_no_temporary(tmp_path, monkeypatch):
    net = dp.models.LeNet(seed=1)
    path = tmp_path / "model.safetensors"
    net.save(path)
    before = path.read_bytes()

    def broken(fd):
        raise OSError(errno.ENOSPC, "disk full")

    monkeypatch.setattr(os, "fsync", broken)  # after the temporary is written in full
    with pytest.raises(OSError, match="disk full"):
        dp.models.LeNet(seed=2).save(path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["model.safetensors"]


def test_load_rejects_files_that_are_not_dpcore_models(tmp_path):
    plain = tmp_path / "plain.safetensors"
    save_file({"w": np.zeros(3, np.float32)}, str(plain))
    with pytest.raises(ValueError, match="not a dpcore model file"):
        dp.models.load(plain)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00\x01not a file")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        dp.models.load(garbage)
    with pytest.raises(FileNotFoundError):
        dp.models.load(tmp_path / "missing.safetensors")
    arch = {"format": "dpcore-sequential-1", "class": "Sequential", "input_shape": [1, 28, 28],
            "layers": [["conv2d", 20, 3, 1, 0], ["relu"], ["avgpool", 2, 2, 0], ["flatten"], ["dense", 10]]}
    wrong = tmp_path / "wrong.safetensors"
    save_file({"0.weight": np.zeros((20, 1, 3, 3), np.float32)}, str(wrong), metadata={"dpcore": json.dumps(arch)})
    with pytest.raises(dp.DataError, match=r"wrong\.safetensors: .*missing \['0\.bias', '4\.weight', '4\.bias'\]"):
        dp.models.load(wrong)
