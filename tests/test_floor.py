"""benchmarks/floor.py: the GEMM floor that the training benchmarks report
against. Its SGEMM call goes through dpcore's own BLAS and must compute the
product; its FLOP counts must match counts written out by hand."""
import importlib.util
import os

import numpy as np
import pytest

import dpcore as dp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("dpcore_floor", os.path.join(ROOT, "benchmarks", "floor.py"))
floor = importlib.util.module_from_spec(spec)
spec.loader.exec_module(floor)


def test_the_blas_is_dpcores_not_numpys():
    path = floor.blas_library_path()
    assert "numpy" not in path and "scipy_openblas" not in path, path


@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 5, 7), (64, 33, 17)])
def test_sgemm_is_the_product(shape):
    m, k, n = shape
    rng = np.random.default_rng(1)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    reference = a.astype(np.float64) @ b.astype(np.float64)
    bound = k * np.finfo(np.float32).eps * (np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64)) + 1e-30
    assert np.all(np.abs(floor.sgemm(a, b) - reference) <= bound)


def test_sgemm_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="inner dimensions"):
        floor.sgemm(np.zeros((2, 3), np.float32), np.zeros((4, 2), np.float32))


def test_rate_is_positive_and_finite():
    rate = floor.sgemm_gflops(n=256, repeats=2, threads=1, min_seconds=0.02)
    assert np.isfinite(rate) and rate > 0.1


def test_lenet_count_by_hand():
    # conv3x3 1->20 on 28x28 (26x26 out), conv5x5 20->50 on 13x13 (9x9 out), dense 800->128, 128->10
    conv1 = 2 * 20 * 26 * 26 * 1 * 9
    conv2 = 2 * 50 * 9 * 9 * 20 * 25
    dense1, dense2 = 2 * 800 * 128, 2 * 128 * 10
    expected = 2 * conv1 + 3 * (conv2 + dense1 + dense2)  # no gradient for the images
    assert floor.training_flops_per_image(dp.models.LeNet()) == expected


def test_resnet18_count_by_hand():
    # 28x28 input: a 3x3 stem conv 1->64, then 4 stages of 2 basic blocks at
    # 28, 14, 7, 4 pixels (64, 128, 256, 512 channels); the first block of
    # stages 2-4 has a stride 2 and a 1x1 projection; dense 512 -> 10
    macs = 64 * 28 * 28 * 1 * 9
    channels, size = 64, 28
    for stage, out in enumerate((64, 128, 256, 512)):
        for block in range(2):
            stride = 2 if stage > 0 and block == 0 else 1
            if stride == 2:
                size = (size + 1) // 2
                macs += out * size * size * channels * 1  # the projection
            macs += out * size * size * channels * 9 + out * size * size * out * 9
            channels = out
    macs += 512 * 10
    stem = 64 * 28 * 28 * 9
    expected = 2 * (3 * macs - stem)
    assert floor.training_flops_per_image(dp.models.ResNet18()) == expected
