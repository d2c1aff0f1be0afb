"""Progress bars for dp.train and evaluate (tqdm).

Where the bar goes, decided once per bar:

- in a Jupyter kernel: tqdm's notebook widget (ipywidgets), or tqdm's text
  bar in the cell's output when ipywidgets is missing;
- in a terminal (stderr is a TTY): tqdm's text bar on stderr;
- anywhere else (output to a file or a pipe, CI logs): no bar at all, so that
  logs hold the per-epoch lines only.

A bar refreshes at most every ``MIN_INTERVAL_S`` seconds (tqdm's
``mininterval``), so its cost per step is a counter and a clock read: well
under 1% of a LeNet step (benchmarks/bench_progress.py measures it).
"""
import sys

__all__ = ["in_notebook", "bar"]

MIN_INTERVAL_S = 0.1


def in_notebook():
    """True inside a Jupyter kernel (IPython's ZMQ shell)."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    try:
        shell = ipython.get_ipython()
    except Exception:  # an IPython without a shell, or a broken one
        return False
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


class _NoBar:
    """What bar() returns when no bar is shown: every call does nothing."""

    n = 0

    def update(self, n=1):
        self.n += n

    def set_postfix_str(self, text, refresh=True):
        pass

    def close(self):
        pass


def _stderr_is_terminal():
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced by an object without isatty, or closed
        return False


def bar(enabled, total, desc, unit="step"):
    """A tqdm bar (see the module's docstring for where it goes), or an object
    with the same calls that shows nothing."""
    if not enabled:
        return _NoBar()
    notebook = in_notebook()
    if not notebook and not _stderr_is_terminal():
        return _NoBar()
    if notebook:
        try:
            import ipywidgets  # noqa: F401  (tqdm.notebook needs it)
            from tqdm.notebook import tqdm
        except ImportError:
            from tqdm import tqdm
    else:
        from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit=unit, leave=True, mininterval=MIN_INTERVAL_S, dynamic_ncols=True)
