"""What the benchmark scripts share about their child processes: how a child imports
dpcore (the package may be being reinstalled while it starts), the exit status that
says it could not, and how a child hands its result to the parent (one marked JSON
line on stdout); progress goes to stderr (`log`). Imports no other benchmark, so
that every one of them, floor.py included, may import it.
"""
import datetime
import json
import os
import sys
import time

RESULT_MARKER = "BENCH_RESULT "
EXIT_DPCORE_MISSING = 2


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def import_dpcore(tries=1, wait=5.0):
    """(dpcore, None), or (None, why) after `tries` attempts `wait` s apart: the package may be
    being reinstalled while a benchmark child starts."""
    err = None
    for i in range(tries):
        try:
            import dpcore
            return dpcore, None
        except Exception as e:  # ImportError, or the extension failing to load
            err = "%s: %s" % (type(e).__name__, e)
            for name in [m for m in sys.modules if m == "dpcore" or m.startswith("dpcore.")]:
                del sys.modules[name]
            if i + 1 < tries:
                log("dpcore import failed (%s); retrying in %.0f s" % (err, wait))
                time.sleep(wait)
    return None, err


def import_dpcore_or_exit(tries=6, wait=5.0):
    """dpcore (retried as above), or exit with EXIT_DPCORE_MISSING saying why."""
    dp, err = import_dpcore(tries, wait)
    if dp is None:
        print("dpcore not importable: %s" % err, file=sys.stderr, flush=True)
        sys.exit(EXIT_DPCORE_MISSING)
    return dp


def build_string(dp):
    """dpcore's version and the time its extension was built (others rebuild it while we work)."""
    try:
        built = datetime.datetime.fromtimestamp(os.path.getmtime(dp._core.__file__), datetime.timezone.utc)
        return "dpcore %s (extension built %s)" % (dp.__version__, built.strftime("%Y-%m-%d %H:%M UTC"))
    except (OSError, AttributeError):
        return "dpcore %s" % getattr(dp, "__version__", "?")


def emit_result(result):
    """A child's result, with the build it ran (result["build"]), as the line the parent looks for."""
    result["build"] = build_string(sys.modules["dpcore"])
    print(RESULT_MARKER + json.dumps(result), flush=True)
