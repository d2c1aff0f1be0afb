"""Run at start-up by every Python process of scripts/sanitized-pytest.sh's run
(PYTHONPATH names this directory, and the processes the tests start inherit it).

1. UndefinedBehaviorSanitizer's reports go to a file of the run's log directory.
   With AddressSanitizer in the same process, GCC's libubsan skips the start-up
   that applies UBSAN_OPTIONS' log_path and writes to stderr, where pytest's
   capture (or a test's subprocess pipe) can swallow the report of a process
   that then dies; its own __sanitizer_set_report_path still works.
2. The processes this one starts get the children's ASAN_OPTIONS (no leak
   check: they include gcc and the like); this process's own options were read
   by the runtime before Python started.
"""
import ctypes
import os

_log = os.environ.get("DPCORE_UBSAN_LOG")
if _log:
    ctypes.CDLL(os.environ["DPCORE_UBSAN_RUNTIME"]).__sanitizer_set_report_path(_log.encode())
if "DPCORE_CHILD_ASAN_OPTIONS" in os.environ:
    os.environ["ASAN_OPTIONS"] = os.environ["DPCORE_CHILD_ASAN_OPTIONS"]
