"""Rank 0's rich output appears once: rich in a kernel (through the metrics file), as text in a terminal."""

import json

import pytest

from nbddp.runtime.rich import bundle
from test_grad_ckpt import run_job


def test_bundles_follow_ipythons_display_protocol():
    from IPython.display import HTML, Image
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    assert bundle(HTML("<b>x</b>"))[0]["text/html"] == "<b>x</b>"
    assert "<table" in bundle(pd.DataFrame({"a": [1]}))[0]["text/html"]
    assert bundle("words")[0] == {"text/plain": "words"}
    figure = plt.figure()
    data, _ = bundle(figure)
    assert data["image/png"] and data["text/plain"].startswith("<Figure size")
    png = bundle(Image(data=_png_bytes(figure)))[0]["image/png"]
    assert isinstance(png, str) and png.startswith("iVBOR")  # base64 text, as a notebook stores it
    plt.close(figure)


def _png_bytes(figure) -> bytes:
    import io

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def _rank_stdout(result, rank: int) -> str:
    logs = sorted(result.run_dir.glob(f"logs/*/attempt_*/{rank}/stdout.log"))
    return logs[-1].read_text() if logs else ""


@pytest.mark.e2e
def test_in_a_terminal_rank_0_prints_each_objects_text_once_and_rank_1_nothing(tmp_path):
    result, out = run_job(tmp_path, "rich_output.py", shim=True)
    assert result.ok, out[-2000:]
    for text in ("RICH-HTML", "loss", "PLAIN-TEXT", "<Figure size"):
        assert out.count(text) == 1, (text, out[-2000:])
    rank1 = _rank_stdout(result, 1)
    assert "IPython.core.display" not in rank1 and "PLAIN-TEXT" not in rank1 and "Figure" not in rank1


@pytest.mark.e2e
def test_when_a_kernel_follows_the_bundles_reach_the_metrics_file_once(tmp_path):
    result, out = run_job(tmp_path, "rich_output.py", shim=True, NBDDP_RICH_DISPLAY="1")
    assert result.ok, out[-2000:]
    events = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    shown = [e["data"] for e in events if e.get("event") == "display"]
    assert [sorted(d) for d in shown] == [
        ["text/html", "text/plain"], ["text/html", "text/plain"], ["text/plain"], ["image/png", "text/plain"]]
    assert "RICH-HTML" in shown[0]["text/html"] and shown[2]["text/plain"] == "PLAIN-TEXT"
    assert "PLAIN-TEXT" not in out  # not printed as text as well
