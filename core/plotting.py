"""matplotlib without a display, and PNGs written atomically: shared by `plan show` and `plan bench`."""

from __future__ import annotations

import os
from pathlib import Path

from specplan.core.fileio import atomic_output


def pyplot():
    """matplotlib.pyplot on the Agg backend, imported only when a plot is asked for (it is slow to import)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, png: str | os.PathLike) -> None:
    with atomic_output(Path(png), "wb") as handle:
        fig.savefig(handle, format="png", dpi=110)
    pyplot().close(fig)
