"""The book's training figure, drawn live: dp.train(..., plot=True) in a
notebook, dp.train(..., plot='curves.png') anywhere.

The figure (train loss, train acc, test acc against epochs, as d2l's
Animator draws them) is a matplotlib Figure made without pyplot, so no GUI
backend is involved. In a notebook it is shown as a PNG through an IPython
display handle that each epoch updates in place; given a path, each epoch
writes the PNG atomically (a temporary beside it, then a rename), so a reader
never sees half a file.
"""
import os

from . import _check
from .progress import in_notebook

__all__ = ["LivePlot"]


def _figure_png(figure):
    import io

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()


def show(figure):
    """Display a pyplot-less matplotlib Figure in the notebook, as a PNG."""
    from IPython.display import Image, display

    display(Image(data=_figure_png(figure), format="png"))


def show_in_notebook(figure, made_here):
    """Display the figure when a plot method made it itself (no ``ax`` given)
    inside a notebook: Jupyter does not show figures made without pyplot."""
    if made_here and in_notebook():
        show(figure)


def draw(history, figure=None):
    """The training figure of a History (a new matplotlib Figure, or ``figure``
    cleared and redrawn)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:  # optional dependency
        raise ImportError("plotting needs matplotlib: pip install matplotlib") from e
    if figure is None:
        figure = Figure(figsize=(5, 3.5))
    figure.clear()
    ax = figure.add_subplot(1, 1, 1)
    history.plot(ax)
    if history.num_epochs > 1:
        ax.set_xlim(1, history.num_epochs)
    figure.tight_layout()
    return figure


class LivePlot:
    """plot=True: update a figure in the notebook each epoch (nothing outside a
    notebook); plot=<path>: write the figure there each epoch."""

    def __init__(self, target):
        if target is True:
            self.path = None
        elif isinstance(target, (str, bytes, os.PathLike)):
            self.path = _check.writable_file("plot", target)
        else:
            raise TypeError(f"plot must be True, False or a path to write the figure to, got "
                            f"{type(target).__name__} {_check.shown(target)}")
        self.notebook = self.path is None and in_notebook()
        self.figure = None
        self._handle = None

    @property
    def active(self):
        return self.path is not None or self.notebook

    def update(self, history):
        if not self.active:
            return
        self.figure = draw(history, self.figure)
        png = _figure_png(self.figure)
        if self.path is not None:
            from .checkpoint import atomic_write

            atomic_write(self.path, [png])
            return
        from IPython.display import Image, display

        if self._handle is None:
            self._handle = display(Image(data=png, format="png"), display_id=True)
        else:
            self._handle.update(Image(data=png, format="png"))
