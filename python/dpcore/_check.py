"""The one checking layer of dpcore's public API.

Every public function checks its arguments through these helpers, so that a bad
argument always gets the same kind of answer: TypeError for a value of the
wrong type, ValueError for a value of the right type out of range, and a
message that names the argument, shows the value and says what is allowed,
e.g. ``batch_size must be an int >= 1, got 0``.

Numbers accept Python's and NumPy's scalars alike (``np.float32(0.1)``,
``np.int64(256)``, a 0-d array) but never a bool, which is almost always a
mistake where a number is expected. Real numbers must be finite unless a
caller says otherwise.

The documented limits (the C core enforces the same ones, from csrc/limits.h,
and reports them as ValueError too):
"""
import math
import numbers
import os

import numpy as np

from . import _core

#: threads one device's replica may use
MAX_THREADS = _core.MAX_THREADS
#: channels of a convolution, features of a dense layer, classes
MAX_FEATURES = _core.MAX_FEATURES
#: parameters of a model (the flat buffer is indexed with an int)
MAX_PARAMS = _core.MAX_PARAMS
#: samples in one batch
MAX_BATCH = _core.MAX_BATCH
#: logical devices of one kind
MAX_DEVICES = _core.MAX_DEVICES

if __doc__:
    __doc__ += "".join(f"\n- {name} = {value}" for name, value in (
        ("MAX_THREADS", MAX_THREADS), ("MAX_FEATURES", MAX_FEATURES), ("MAX_PARAMS", MAX_PARAMS),
        ("MAX_BATCH", MAX_BATCH), ("MAX_DEVICES", MAX_DEVICES))) + "\n"


def shown(value, limit=60):
    """repr(value), shortened to about ``limit`` characters."""
    try:
        text = repr(value)
    except Exception:  # a hostile __repr__ must not hide the real error
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit - 5] + " ...>"


def _type_error(name, what, value):
    return TypeError(f"{name} must be {what}, got {type(value).__name__} {shown(value)}")


def _scalar(value):
    """A 0-d NumPy array as its scalar; anything else unchanged."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        return value[()]
    return value


def _bound(value):
    """0.0 as 0, 2.0**40 as 1099511627776: a bound as a reader writes it."""
    return int(value) if isinstance(value, float) and value.is_integer() and abs(value) < 2**53 else value


def _range_text(minimum, maximum, exclusive_minimum=False):
    parts = []
    if minimum is not None:
        parts.append(f"{'>' if exclusive_minimum else '>='} {_bound(minimum)}")
    if maximum is not None:
        parts.append(f"<= {_bound(maximum)}")
    return " and ".join(parts)


def integer(name, value, minimum=None, maximum=None):
    """``value`` as an int in [minimum, maximum] (either bound optional)."""
    value = _scalar(value)
    allowed = "an int" + (" " + _range_text(minimum, maximum) if minimum is not None or maximum is not None else "")
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise _type_error(name, allowed, value)
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be {allowed}, got {value}")
    return value


def optional_integer(name, value, minimum=None, maximum=None):
    """None, or :func:`integer`."""
    return None if value is None else integer(name, value, minimum, maximum)


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def real(name, value, minimum=None, maximum=None, exclusive_minimum=False, finite=True, float32=False):
    """``value`` as a float (finite unless ``finite=False``) in the range given;
    ``float32``: also within float32's range (a value the core computes with)."""
    value = _scalar(value)
    if float32:
        maximum = _FLOAT32_MAX if maximum is None else min(maximum, _FLOAT32_MAX)
    bounds = _range_text(minimum, None if float32 else maximum, exclusive_minimum)
    allowed = (("a finite number" if finite else "a number") + (" " + bounds if bounds else "")
               + (" within float32's range" if float32 else ""))
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise _type_error(name, allowed, value)
    try:
        value = float(value)
    except (OverflowError, ValueError):
        raise ValueError(f"{name} must be {allowed}, got {shown(value)}") from None
    if finite and not math.isfinite(value):
        raise ValueError(f"{name} must be {allowed}, got {value}")
    if minimum is not None and (value < minimum or (exclusive_minimum and value == minimum)):
        raise ValueError(f"{name} must be {allowed}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be {allowed}, got {value}")
    return value


def boolean(name, value):
    """``value`` as a bool: True, False or a NumPy bool."""
    if not isinstance(value, (bool, np.bool_)):
        raise _type_error(name, "True or False", value)
    return bool(value)


def string(name, value):
    if not isinstance(value, str):
        raise _type_error(name, "a string", value)
    return value


def one_of(name, value, choices):
    """``value`` if it is one of ``choices`` (strings compared exactly)."""
    text = ", ".join(shown(c) for c in choices)
    if isinstance(value, str) or any(not isinstance(c, str) for c in choices):
        for choice in choices:
            if type(value) is type(choice) and value == choice:
                return value
        raise ValueError(f"{name} must be one of {text}, got {shown(value)}")
    raise _type_error(name, f"one of {text}", value)


def path(name, value):
    """A filesystem path (str, bytes or os.PathLike) as a str."""
    if not isinstance(value, (str, bytes, os.PathLike)):
        raise _type_error(name, "a path (str or os.PathLike)", value)
    text = os.fsdecode(value)
    if not text or "\0" in text:
        raise ValueError(f"{name} must be a non-empty path without NUL characters, got {shown(value)}")
    return text


def writable_file(name, value):
    """A path (see :func:`path`) that a file can be written to: its directory
    exists and it is not itself a directory. Checked before work whose result
    would go there, so that an hour of training does not end in a typo."""
    text = path(name, value)
    directory = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{name}: the directory {directory!r} of {text!r} does not exist")
    if os.path.isdir(text):
        raise IsADirectoryError(f"{name}: {text!r} is a directory; give a file name")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise PermissionError(f"{name}: cannot write files into {directory!r}")
    return text


def function(name, value):
    if not callable(value):
        raise _type_error(name, "callable", value)
    return value


def device_names(name, value):
    """A list of device names from one name ('cpu:0') or a non-empty list or
    tuple of names, each a string, none twice (not yet checked against the
    machine: dpcore.devices.check_device does that)."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, (list, tuple)):
        raise _type_error(name, "a device name like 'cpu:0' or a list of them", value)
    if not value:
        raise ValueError(f"{name} must name at least one device, got {shown(value)}")
    if len(value) > MAX_DEVICES:
        raise ValueError(f"{name} must name at most {MAX_DEVICES} devices, got {len(value)}")
    for item in value:
        if not isinstance(item, str):
            raise TypeError(f"{name} must hold device names like 'cpu:0', got {type(item).__name__} {shown(item)} "
                            f"in {shown(value)}")
    return list(value)


def shape(name, value, length):
    """A tuple of ``length`` ints >= 1 (e.g. an input shape (C, H, W))."""
    if not isinstance(value, (tuple, list)):
        raise _type_error(name, f"a tuple of {length} ints", value)
    if len(value) != length:
        raise ValueError(f"{name} must have {length} entries, got {len(value)}: {shown(value)}")
    return tuple(integer(f"{name}[{i}]", v, 1, 2**31 - 1) for i, v in enumerate(value))


def sgd_arguments(lr, momentum, weight_decay, lr_zero=False):
    """(lr, momentum, weight_decay) as floats: lr finite and > 0 (>= 0 with
    ``lr_zero``), momentum and weight_decay finite and >= 0, each within
    float32's range (the core computes in float32 and checks the same)."""
    return (real("lr", lr, 0.0, exclusive_minimum=not lr_zero, float32=True),
            real("momentum", momentum, 0.0, float32=True), real("weight_decay", weight_decay, 0.0, float32=True))
