"""matplotlib, imported only when a figure is asked for (it is an optional dependency)."""

from __future__ import annotations


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed), or an ImportError that says
    what to install."""
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError("plotting needs matplotlib: pip install matplotlib") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
