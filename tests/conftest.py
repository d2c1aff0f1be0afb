"""Fixtures shared by the test files."""
import warnings

import pytest

import dpcore as dp


@pytest.fixture
def logical_cpus():
    """``logical_cpus(k)`` splits the CPU into k logical devices (silencing the
    warning that they share cores); one device again afterwards."""
    def split(k):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # more logical devices than cores
            dp.set_logical_devices("cpu", k)
    yield split
    dp.set_logical_devices("cpu", 1)
