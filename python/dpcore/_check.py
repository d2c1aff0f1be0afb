"""The one checking layer of dpcore's public API.

Every public function checks its arguments here before anything runs, so that
a bad argument is one clear exception: TypeError for the wrong kind of value,
ValueError for a value out of range, each message naming the argument, showing
the value and saying what is allowed::

    batch_size must be an int >= 1, got 0
    lr must be a finite real number > 0, got nan

Numbers accept NumPy scalars (np.int64, np.float32, ...) and 0-d arrays
wherever Python numbers are accepted; bool is refused where a number is meant
(``batch_size=True`` is a mistake, not a 1), and a flag takes only a bool.

The upper limits are the C core's (csrc/dp_limits.h, exported by the
extension), so that Python and C cannot disagree; the C core checks them
again and never crashes on them.
"""
import math
import numbers
import os

import numpy as np

from . import _core

# the documented limits (README "Limits")
MAX_THREADS = _core.MAX_THREADS      # threads of one CPU device's replica
MAX_CHANNELS = _core.MAX_CHANNELS    # channels / output features of one layer
MAX_DEVICES = _core.MAX_DEVICES      # logical devices of one kind
MAX_PARAMS = _core.MAX_PARAMS        # parameters of a model (fewer than 2**31)
MAX_BATCH = _core.MAX_BATCH          # samples of one batch (fewer than 2**31)
MAX_INT = 2**31 - 1                  # the C core's largest size (strides, padding)
FLOAT32_MAX = float(np.finfo(np.float32).max)

_SHOWN = 80  # characters of a value's repr in a message


def show(value):
    """repr(value), shortened to about 80 characters; arrays by shape and dtype."""
    if isinstance(value, np.ndarray) and value.ndim > 0:
        return f"array of shape {value.shape} and dtype {value.dtype}"
    try:
        text = repr(value)
    except Exception:  # a broken __repr__ must not hide the real error
        text = f"<{type(value).__name__} object>"
    return text if len(text) <= _SHOWN else text[:_SHOWN - 5] + " ...>"


def fail(kind, name, allowed, value):
    """Raise kind("{name} must be {allowed}, got {value}")."""
    typed = kind is TypeError and value is not None and not isinstance(value, np.ndarray)
    raise kind(f"{name} must be {allowed}, got {type(value).__name__ + ' ' if typed else ''}{show(value)}")


def _scalar(value):
    """A 0-d NumPy array's item; anything else unchanged."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        return value[()]
    return value


def _bounds(minimum, maximum, above=False):
    """' >= 1', ' in [0, 256]', ' > 0' for a message."""
    if minimum is not None and maximum is not None:
        return f" in {'(' if above else '['}{minimum}, {maximum}]"
    if minimum is not None:
        return f" {'>' if above else '>='} {minimum}"
    if maximum is not None:
        return f" <= {maximum}"
    return ""


def integer(name, value, minimum=None, maximum=None):
    """value as an int in [minimum, maximum] (None: unbounded on that side)."""
    allowed = "an int" + _bounds(minimum, maximum)
    value = _scalar(value)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        fail(TypeError, name, allowed, value)
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        fail(ValueError, name, allowed, value)
    return value


def real(name, value, minimum=None, maximum=None, allow_minimum=True, finite=True, float32=False):
    """value as a float: finite unless finite=False, in [minimum, maximum] (or
    (minimum, maximum] when allow_minimum=False), within float32's range when
    float32 (what the C core computes in)."""
    allowed = ("a finite real number" if finite else "a real number") + _bounds(minimum, maximum, not allow_minimum)
    value = _scalar(value)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        fail(TypeError, name, allowed, value)
    try:
        number = float(value)
    except OverflowError:  # an int beyond a double
        fail(ValueError, name, allowed, value)
    if finite and not math.isfinite(number):
        fail(ValueError, name, allowed, value)
    if math.isnan(number) or (minimum is not None and (number < minimum or number == minimum and not allow_minimum)) \
            or (maximum is not None and number > maximum):
        fail(ValueError, name, allowed, value)
    if float32 and math.isfinite(number) and abs(number) > FLOAT32_MAX:
        fail(ValueError, name, f"{allowed} within float32's range (|x| <= {FLOAT32_MAX:.4g})", value)
    return number


def boolean(name, value):
    """value, True or False: 0/1, None, strings and NumPy bools are refused
    rather than guessed at."""
    if not isinstance(value, bool):
        fail(TypeError, name, "True or False", value)
    return value


def optional_boolean(name, value):
    """None, True or False."""
    return None if value is None else boolean(name, value)


def string(name, value):
    """value, a str."""
    if not isinstance(value, str):
        fail(TypeError, name, "a string", value)
    return value


def one_of(name, value, choices):
    """value, one of choices (strings)."""
    allowed = "one of " + ", ".join(map(repr, choices))
    if not isinstance(value, str):
        fail(TypeError, name, allowed, value)
    if value not in choices:
        fail(ValueError, name, allowed, value)
    return value


def path(name, value):
    """value as a str path (str, bytes or os.PathLike)."""
    if not isinstance(value, (str, bytes, os.PathLike)):
        fail(TypeError, name, "a path (str or os.PathLike)", value)
    value = os.fsdecode(os.fspath(value))
    if not value:
        fail(ValueError, name, "a non-empty path", value)
    return value


def callable_(name, value):
    if not callable(value):
        fail(TypeError, name, "callable", value)
    return value


def iterable(name, value, what="an iterable"):
    """value, something a for loop can walk (not None, not a str)."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        fail(TypeError, name, what, value)
    return value


def sequence(name, value, what="a list or tuple", length=None):
    """list(value) of a list, tuple or range (of `length` items when given)."""
    if not isinstance(value, (list, tuple, range)):
        fail(TypeError, name, what, value)
    value = list(value)
    if length is not None and len(value) != length:
        fail(ValueError, name, f"{what} of {length} items", value)
    return value


def shape(name, value, names, maxima=()):
    """A tuple of len(names) ints >= 1, e.g. (channels, height, width);
    maxima: the largest value of each leading item."""
    allowed = f"({', '.join(names)}), ints >= 1"
    if not isinstance(value, (list, tuple)):
        fail(TypeError, name, allowed, value)
    if len(value) != len(names):
        fail(ValueError, name, allowed, value)
    return tuple(integer(f"{name}[{i}] ({names[i]})", v, 1, maxima[i] if i < len(maxima) else None)
                 for i, v in enumerate(value))


def array(name, value, kinds="fiu", ndim=None):
    """value as a NumPy array whose dtype kind is one of `kinds` ('f' float,
    'i' signed, 'u' unsigned integers; bool never; None: any dtype, for a
    caller that says more about a wrong one itself), of `ndim` dimensions."""
    names = {"f": "floating", "i": "integer", "u": "unsigned integer"}
    allowed = "an array" if kinds is None else "an array of " + " or ".join(names[k] for k in kinds) + " numbers"
    if value is None or isinstance(value, (str, bytes, dict, set)):
        fail(TypeError, name, allowed, value)
    try:
        a = np.asarray(value)
    except (ValueError, TypeError) as e:  # a ragged list
        raise ValueError(f"{name} must be {allowed} (a rectangular array), got {show(value)}: {e}") from None
    if kinds is not None and (a.dtype.kind not in kinds or a.dtype == np.bool_):
        raise TypeError(f"{name} must be {allowed}, got an array of dtype {a.dtype}")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name} must be a {ndim}-D array, got shape {a.shape}")
    return a


def float32_values(name, a):
    """a as float32, refusing finite values beyond float32's range (the
    conversion would make them inf without a word)."""
    if a.dtype.kind == "f" and a.dtype.itemsize > 4 and a.size:
        finite = a[np.isfinite(a)]
        if finite.size and np.abs(finite).max() > FLOAT32_MAX:
            raise ValueError(f"{name} must hold values within float32's range (|x| <= {FLOAT32_MAX:.4g}), got "
                             f"{np.abs(finite).max():g}")
    return a.astype(np.float32)


def sgd(lr, momentum, weight_decay, lr_zero=True):
    """(lr, momentum, weight_decay) as floats: lr >= 0 (> 0 unless lr_zero),
    momentum in [0, 1], weight_decay >= 0, all finite and within float32's
    range: the ranges of the C core's dp_sgd_args_check."""
    return (real("lr", lr, 0, allow_minimum=lr_zero, float32=True),
            real("momentum", momentum, 0, 1),
            real("weight_decay", weight_decay, 0, float32=True))


def device(name, value):
    """The canonical name of one device ('cpu' means 'cpu:0')."""
    if not isinstance(value, str):
        fail(TypeError, name, "a device name like 'cpu:0'", value)
    canonical = value if ":" in value else value + ":0"
    known = [d[0] for d in _core.list_devices()]
    if canonical not in known:
        raise ValueError(f"{name}: unknown device {show(value)}; it must be one of the devices {known} "
                         f"(dp.set_logical_devices('cpu', k) makes more CPU devices)")
    return canonical


def devices(name, value):
    """A non-empty list of distinct canonical device names, in order; a single
    name ('cpu:0') is one device. A set or dict is refused: its order is not
    the caller's."""
    if isinstance(value, str):
        value = [value]
    if isinstance(value, (bytes, set, frozenset, dict)) or not hasattr(value, "__iter__"):
        fail(TypeError, name, "a device name or a list of them, e.g. ['cpu:0', 'cpu:1']", value)
    value = list(value)
    if not value:
        fail(ValueError, name, "at least one device", value)
    if len(value) > MAX_DEVICES:
        fail(ValueError, name, f"at most {MAX_DEVICES} devices", value)
    names = [device(f"{name}[{i}]", d) for i, d in enumerate(value)]
    if len(set(names)) != len(names):
        fail(ValueError, name, "distinct devices (one appears twice)", value)
    return names
