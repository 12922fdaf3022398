"""matplotlib for the plot tools, which are all it is needed for: an optional extra (pip install -e ".[plot]"),
so a missing matplotlib is one line saying how to install it, not a traceback."""

from __future__ import annotations

INSTALL = 'pip install -e ".[plot]" (or pip install matplotlib)'


def pyplot():
    """matplotlib.pyplot drawing to files (the Agg backend: no display needed), or exit with one line."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise SystemExit(f"error: this tool draws with matplotlib, which is not installed: {INSTALL}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
