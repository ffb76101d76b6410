"""Rank 0's rich output: ``display()`` of HTML, DataFrames and images, and the notebook's own ``plt.show()``.

In a kernel these render in the cell; in a rank there is no front end, and IPython's own ``display`` prints
``<IPython.core.display.HTML object>`` on every rank. So in every rank ``display`` (nbddp's, and IPython's
once the notebook imports ``IPython.display``) shows on rank 0 only, once:

- when the launcher asked for rich output (``NBDDP_RICH_DISPLAY=1``, a kernel follows the job), each object's
  MIME bundle goes to the metrics file as ``{"event": "display", "data": …, "metadata": …}`` and the kernel
  publishes it in the job's cell (so papermill's output notebook keeps it too);
- otherwise (a terminal, a Kaggle script's log) its text form is printed.

The bundle comes from the object's ``_repr_*_`` methods, IPython's display protocol, read here without
importing IPython; a matplotlib figure is drawn to PNG. ``plt.show()`` displays every open figure that way
and closes it (other ranks just close theirs), as the inline backend does in a kernel.
"""

from __future__ import annotations

import base64
import io
import json
import re
import time

from . import settings
from . import records

#: IPython's ``_repr_*_`` methods and the MIME type each gives, richest first as IPython orders them.
_REPR_METHODS = (
    ("_repr_html_", "text/html"),
    ("_repr_markdown_", "text/markdown"),
    ("_repr_svg_", "image/svg+xml"),
    ("_repr_png_", "image/png"),
    ("_repr_jpeg_", "image/jpeg"),
    ("_repr_latex_", "text/latex"),
    ("_repr_json_", "application/json"),
)
_BINARY = {"image/png", "image/jpeg"}
#: A text form that says nothing but the class: ``<IPython.core.display.HTML object>``, ``object.__repr__``.
_BARE_REPR = re.compile(r"^<[\w.]+ object( at 0x[0-9a-fA-F]+)?>$")


def bundle(obj) -> tuple[dict, dict]:
    """``(data, metadata)``: the MIME bundle a notebook front end would render for ``obj``."""
    if _is_figure(obj):
        return _figure_bundle(obj), {}
    data, metadata = _mimebundle(obj)
    for method, mime in _REPR_METHODS:
        if mime in data:
            continue
        value = _call(obj, method)
        if isinstance(value, tuple) and len(value) == 2:  # (data, metadata), as the protocol allows
            value, metadata[mime] = value
        if value is not None:
            data[mime] = _text(value) if mime in _BINARY else value
    data.setdefault("text/plain", obj if isinstance(obj, str) else repr(obj))
    return data, metadata


def _mimebundle(obj) -> tuple[dict, dict]:
    result = _call(obj, "_repr_mimebundle_", include=None, exclude=None)
    if isinstance(result, tuple):
        data, metadata = result
        return dict(data or {}), dict(metadata or {})
    return dict(result or {}), {}


def _call(obj, method: str, **kwargs):
    """``obj.method(**kwargs)``, or None where the object has no such method (never a class's unbound one)."""
    if isinstance(obj, type):
        return None
    fn = getattr(obj, method, None)
    if not callable(fn):
        return None
    try:
        return fn(**kwargs)
    except NotImplementedError:
        return None


def _text(value) -> str:
    """Binary image data as the base64 text a notebook stores (IPython's own objects give it so already)."""
    return base64.b64encode(value).decode("ascii") if isinstance(value, bytes) else value


def _is_figure(obj) -> bool:
    return type(obj).__module__.startswith("matplotlib.figure") and hasattr(obj, "savefig")


def _figure_bundle(figure) -> dict:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", bbox_inches="tight")
    width, height = figure.get_size_inches() * figure.dpi
    return {"image/png": _text(buffer.getvalue()), "text/plain": f"<Figure size {width:g}x{height:g} with "
            f"{len(figure.axes)} Axes>"}


def display(*objs, **kwargs) -> None:
    """The notebook's ``display()`` in a rank: each object shown once, on rank 0 (see the module's text)."""
    from .dist import is_main_process

    if not is_main_process():
        return
    for obj in objs:
        data, metadata = bundle(obj)
        if not _send(data, metadata):
            print(readable_text(data), flush=True)


def readable_text(data: dict) -> str:
    """What a terminal shows: the text form, or the HTML's text where the text form is only ``<… object>``."""
    if "text/html" in data and _BARE_REPR.match(data["text/plain"]):
        return _html_text(data["text/html"])
    return data["text/plain"]


def _html_text(markup: str) -> str:
    from html.parser import HTMLParser

    class Text(HTMLParser):
        def __init__(self):
            super().__init__()
            self.parts: list[str] = []

        def handle_data(self, text):
            self.parts.append(text)

    parser = Text()
    parser.feed(markup)
    return "".join(parser.parts).strip()


def _send(data: dict, metadata: dict) -> bool:
    """Append the bundle to the metrics file when a kernel follows the job; False when none does."""
    path = settings.current().metrics  # NBDDP_METRICS
    if settings.current().rich_display is not True or not path:  # NBDDP_RICH_DISPLAY
        return False
    record = {"event": records.Event.DISPLAY, "data": data, "metadata": metadata, "time": time.time()}
    records.append_line(path, json.dumps(record, default=str))  # a full disk drops it, never the training
    return True


def show_figures(*args, **kwargs) -> None:
    """``plt.show()`` in a rank: rank 0 displays every open figure; every rank then closes them."""
    import matplotlib.pyplot as plt

    from .dist import is_main_process

    for number in plt.get_fignums():
        figure = plt.figure(number)
        if is_main_process():
            display(figure)
        plt.close(figure)


def install() -> None:
    """Route IPython's ``display`` and matplotlib's ``show`` here once the notebook imports them."""
    from .patching import when_imported

    for module in ("IPython.display", "IPython.core.display_functions", "IPython.core.display"):
        when_imported(module, _replace_display)
    when_imported("matplotlib.pyplot", _replace_show)


def _replace_display(module) -> None:
    if hasattr(module, "display"):
        module.display = display


def _replace_show(pyplot) -> None:
    pyplot.show = show_figures
