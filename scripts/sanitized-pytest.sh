#!/usr/bin/env bash
# pytest in a Python that has AddressSanitizer + UndefinedBehaviorSanitizer
# preloaded, for a dpcore built with DPCORE_SANITIZE=1 (make test-asan).
#
#   scripts/sanitized-pytest.sh VENV [pytest arguments...]
#
# Fails when pytest fails or when any process of the run (pytest itself or a
# process a test starts: a Python script, a C test program) printed a sanitizer
# report: every report goes to a file under a fresh directory (ASan's log_path;
# UBSan's through scripts/sanitizer-site/sitecustomize.py), so the report of a
# child that a test expected to fail, or whose stderr it dropped, or of pytest
# itself while it captures stderr, is not lost; they are printed at the end.
#
# Options, and why:
#   LD_PRELOAD   GCC's libasan and libubsan: ASan must be the first library of
#                the process (Python is not linked with it); inherited by every
#                child, so the Python processes the tests start are checked too.
#   PYTHONMALLOC=malloc  CPython's objects come from malloc, not from pymalloc's
#                mmap'd arenas: ASan sees them (an overflow from dpcore into a
#                Python object is caught) and LeakSanitizer scans them (a dpcore
#                buffer owned by a live Python object is reachable, not leaked).
#   detect_leaks=1 in pytest's own process (and its xdist workers, which run
#                the tests: DPCORE_SANITIZED_WORKERS below); 0 in their children (they inherit the
#                ASAN_OPTIONS that scripts/sanitizer-site/sitecustomize.py sets):
#                they are also gcc and the like, whose own leaks at exit are not
#                dpcore's and would fail them. (So a leak only a child Python
#                process's code path makes goes unseen; the suite's own process
#                runs the core and the binding throughout.)
#                tests/test_sanitizers.py runs its C programs with leak
#                detection on and full stacks (no suppression but Open MPI's).
#   malloc_context_size=2  an allocation's stack is the allocator and its direct
#                caller. LeakSanitizer applies a suppression when any frame of a
#                leak's stack matches, and a dpcore allocation made under a Python
#                call has CPython's frames below dpcore's; with two frames,
#                scripts/lsan-python.supp (allocations made directly by CPython)
#                can never hide an allocation made by dpcore's code, whose
#                direct caller is in dpcore's _core.so. ASan's
#                reports keep the whole stack of the bad access itself; the
#                allocation and free stacks name the function that called
#                malloc / free.
#   allocator_may_return_null=1  a request too large to satisfy returns NULL as
#                glibc's malloc does (the tests ask for impossible sizes and expect
#                dpcore's memory error), instead of ending the process.
#   halt_on_error=1 (both), -fno-sanitize-recover=undefined (setup.py): the
#                first report ends the process.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:?usage: scripts/sanitized-pytest.sh VENV [pytest arguments...]}
shift
asan=$(gcc -print-file-name=libasan.so)
ubsan=$(gcc -print-file-name=libubsan.so)
for lib in "$asan" "$ubsan"; do
  [ -e "$lib" ] || { echo "sanitized-pytest: $lib not found (gcc's sanitizer runtime)" >&2; exit 1; }
done
logs=$(mktemp -d "${TMPDIR:-/tmp}/dpcore-sanitizers.XXXXXX")
common="halt_on_error=1:abort_on_error=0:allocator_may_return_null=1:malloc_context_size=2"
common+=":log_path=$logs/asan:log_exe_name=1"
export PYTHONMALLOC=malloc
export LSAN_OPTIONS="suppressions=$here/scripts/lsan-python.supp:print_suppressions=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
# scripts/sanitizer-site/sitecustomize.py, in every Python process of the run:
# UBSan's reports into the log directory too, and the children's ASAN_OPTIONS
export PYTHONPATH="$here/scripts/sanitizer-site${PYTHONPATH:+:$PYTHONPATH}"
export DPCORE_UBSAN_LOG="$logs/ubsan" DPCORE_UBSAN_RUNTIME="$ubsan"
export DPCORE_CHILD_ASAN_OPTIONS="$common:detect_leaks=0"
# Open MPI's launcher (mpirun, as the tests and dp.launch start it) runs
# without the runtime and hands it to its ranks: ASan finds a use-after-free in
# Open MPI 4.1's own PMIx server code in mpirun (orte_rml_send_callback frees a
# buffer that pmix_server_log_fn's send still copies), which is not dpcore's and
# would fail the run; the ranks, where dpcore runs, keep every check.
shims=$(mktemp -d "${TMPDIR:-/tmp}/dpcore-sanitizers-bin.XXXXXX")
for launcher in mpirun mpiexec; do
  command -v "$launcher" >/dev/null || continue
  # by name, on the PATH without this directory: Open MPI treats a launcher
  # started by its absolute path as --prefix and changes the remote command
  cat > "$shims/$launcher" <<SHIM
#!/bin/sh
# written by scripts/sanitized-pytest.sh: $launcher without the sanitizer runtime, its ranks with it
preload=\$LD_PRELOAD
unset LD_PRELOAD
PATH='$PATH'
if [ -n "\$preload" ]; then exec $launcher -x LD_PRELOAD="\$preload" "\$@"; fi
exec $launcher "\$@"
SHIM
  chmod +x "$shims/$launcher"
done
export PATH="$shims:$PATH"
# DPCORE_SANITIZED_WORKERS=N (N > 1; make test-asan sets 2): the tests in N pytest-xdist workers,
# a test file to a worker at a time (--dist loadfile: a file's tests share one process, as in a
# serial run). Most of this run's time is the sanitized code of one thread in one process, so a
# second worker uses the core the first leaves idle. The workers start through a wrapper that gives
# them pytest's own options (leak check on) in place of the children's, which sitecustomize.py set
# in the controller's environment; each worker's leaks are checked at its exit.
workers=()
nworkers=${DPCORE_SANITIZED_WORKERS:-1}
case "$nworkers" in ''|*[!0-9]*) echo "sanitized-pytest: DPCORE_SANITIZED_WORKERS=$nworkers: a count" >&2; exit 2;; esac
if [ "$nworkers" -gt 1 ]; then
  "$venv/bin/python" -c 'import xdist' 2>/dev/null ||
    { echo "sanitized-pytest: DPCORE_SANITIZED_WORKERS=$nworkers needs pytest-xdist in $venv" >&2; exit 2; }
  cat > "$shims/python-worker" <<WORKER
#!/bin/sh
# written by scripts/sanitized-pytest.sh: a pytest-xdist worker, with pytest's own ASAN_OPTIONS
ASAN_OPTIONS='$common:detect_leaks=1' exec '$(cd "$venv" && pwd)/bin/python' "\$@"
WORKER
  chmod +x "$shims/python-worker"
  workers=(--tx "$nworkers*popen//python=$shims/python-worker" --dist loadfile --no-loadscope-reorder)
fi
# LeakSanitizer's own tracer (the thread that stops the others for the leak
# check at pytest's exit) has crashed now and then after every test passed
# ("Tracer caught signal 11 ... LeakSanitizer has encountered a fatal error":
# twice in CI, a failure of the sanitizer, not a report, and the leak check
# never ran): then, and only then, the run is repeated once, so that the leak
# check gets its run. Test failures (pytest's JUnit report) are never retried.
tracer_crashed() {
  grep -q -r -e "LeakSanitizer has encountered a fatal error" "$logs" 2>/dev/null &&
    ! grep -q -r -e "ERROR: [A-Za-z]*Sanitizer" -e "runtime error:" "$logs" 2>/dev/null
}
tests_all_passed() { # $1: pytest's JUnit XML
  "$venv/bin/python" - "$1" <<'PY'
import sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError):
    sys.exit(1)
suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
bad = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
sys.exit(0 if suites and bad == 0 else 1)
PY
}
junit=$(mktemp -d "${TMPDIR:-/tmp}/dpcore-sanitizers-junit.XXXXXX")
attempt=1
while :; do
  rc=0
  # LD_PRELOAD for Python and what it starts, not for this script's own tools
  LD_PRELOAD="$asan $ubsan" ASAN_OPTIONS="$common:detect_leaks=1" "$venv/bin/python" -m pytest \
    --junit-xml="$junit/junit.$attempt.xml" "${workers[@]}" "$@" || rc=$?
  if [ "$rc" != 0 ] && [ "$attempt" = 1 ] && tracer_crashed && tests_all_passed "$junit/junit.$attempt.xml"; then
    echo "sanitized-pytest: every test passed, but LeakSanitizer's tracer crashed at pytest's exit" \
      "(no report; the leak check did not run): the run once more" >&2
    for f in $(grep -l -r -e "LeakSanitizer has encountered a fatal error" "$logs"); do mv "$f" "$f.tracer-crash"; done
    attempt=2
    continue
  fi
  break
done
# A report is an error (ASan, LeakSanitizer: "ERROR: ...Sanitizer"; UBSan:
# "runtime error:"). Shown, not failed: the warning allocator_may_return_null=1
# writes for each impossible request (the tests make them on purpose), and the
# stack libFuzzer prints through the runtime when a harness's input crashes
# (tests/test_fuzz.py plants one).
errors=0
for f in $(find "$logs" -type f | sort); do
  if grep -q -e "ERROR: [A-Za-z]*Sanitizer" -e "runtime error:" "$f"; then
    echo "==== sanitizer report: $f"
    cat "$f"
    errors=$((errors + 1))
  else
    echo "sanitized-pytest: note, $f: $(head -c 300 "$f")"
  fi
done
if [ "$errors" != 0 ]; then
  echo "sanitized-pytest: $errors process(es) printed a sanitizer report (above)" >&2
  [ "$rc" != 0 ] || rc=1
else
  echo "sanitized-pytest: no sanitizer report from any process"
fi
rm -rf "$logs" "$shims" "$junit"
exit "$rc"
