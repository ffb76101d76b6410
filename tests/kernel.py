"""Running notebooks that use nbddp's magics in a real kernel (nbclient), importing nbddp from this tree."""

from __future__ import annotations

import os
import re
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from conftest import ROOT


def kernel_env(**extra: str) -> dict[str, str]:
    """The environment of a test kernel: this checkout's nbddp first on the path, the tests' model cache."""
    env = {k: v for k, v in os.environ.items() if k not in ("JPY_SESSION_NAME", "PAPERMILL_INPUT_PATH")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


class RecordingClient(NotebookClient):
    """An nbclient client that also keeps every output message it saw: (cell index, type, display id, mime types)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.messages: list[tuple[int, str, str | None, tuple[str, ...]]] = []

    def process_message(self, msg, cell, cell_index):
        content = msg["content"]
        display_id = (content.get("transient") or {}).get("display_id")
        self.messages.append((cell_index, msg["msg_type"], display_id, tuple(sorted(content.get("data", {})))))
        return super().process_message(msg, cell, cell_index)


def execute(path: Path, sources: list[str] | None = None, timeout: int = 600,
            **env: str) -> tuple[nbformat.NotebookNode, RecordingClient]:
    """Run the notebook at ``path`` (first written from ``sources`` if given) in a kernel started in its
    folder; save it back with its outputs and return it as read from disk."""
    if sources is not None:
        nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources]), str(path))
    nb = nbformat.read(str(path), as_version=4)
    client = RecordingClient(nb, kernel_name="python3", timeout=timeout, allow_errors=True,
                             resources={"metadata": {"path": str(path.parent)}})
    client.execute(env=kernel_env(**env))
    nbformat.write(nb, str(path))
    return nbformat.read(str(path), as_version=4), client


def stream(cell, name: str) -> str:
    """A cell's saved ``name`` stream, all its outputs joined."""
    return "".join(o.text for o in cell.outputs if o.output_type == "stream" and o.name == name)


def rendered(text: str) -> str:
    """What a Jupyter front end shows of stream text: text after ``\\r`` replaces the line (nbclient's rule)."""
    return re.sub(r"[^\n]*\r(?=[^\n])", "", text.replace("\r\n", "\n"))


def errors(cell) -> list:
    return [o for o in cell.outputs if o.output_type == "error"]


def displays(cell) -> list[str]:
    """A cell's displays as saved (after every update), as plain text: nbddp's panel, then its log view."""
    return [o.data["text/plain"] for o in cell.outputs if o.output_type == "display_data"]


class FrontEnd:
    """A kernel spoken to as a notebook front end speaks to it, one execute_request per cell run: JupyterLab and
    Notebook 7 put the cell's id in the request's metadata (``cellId``), VS Code its cell URI; Colab's and
    nbclient's requests carry none (``cell_id=None``). Started in ``folder``, importing nbddp from this tree."""

    def __init__(self, folder: Path, kernel_dirs: tuple[str, ...] = (), kernel_name: str = "python3", **env: str):
        from jupyter_client import KernelManager
        from jupyter_client.kernelspec import KernelSpecManager

        specs = KernelSpecManager(kernel_dirs=list(kernel_dirs)) if kernel_dirs else KernelSpecManager()
        self.manager = KernelManager(kernel_name=kernel_name, kernel_spec_manager=specs)
        self.manager.start_kernel(cwd=str(folder), env=kernel_env(**env))
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=120)

    def run(self, code: str, cell_id: str | None = None, timeout: float = 600) -> Ran:
        """Run one cell and wait for its end: what it showed (streams and displays as text) and its error."""
        content = dict(code=code, silent=False, store_history=True, user_expressions={}, allow_stdin=False,
                       stop_on_error=True)
        request = self.client.session.msg("execute_request", content, metadata={"cellId": cell_id} if cell_id else {})
        self.client.shell_channel.send(request)
        shown, error = [], None
        while True:
            msg = self.client.get_iopub_msg(timeout=timeout)
            if msg["parent_header"].get("msg_id") != request["header"]["msg_id"]:
                continue
            kind, body = msg["msg_type"], msg["content"]
            if kind == "stream":
                shown.append(body["text"])
            elif kind in ("display_data", "update_display_data", "execute_result"):
                shown.append(body["data"].get("text/plain", "") + "\n")
            elif kind == "error":
                error = f"{body['ename']}: {body['evalue']}"
            elif kind == "status" and body["execution_state"] == "idle":
                return Ran("".join(shown), error)

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


class Ran:
    """What one cell run in a ``FrontEnd`` showed, and its error (``ename: evalue``) if it raised."""

    def __init__(self, shown: str, error: str | None):
        self.shown, self.error = shown, error

    def script(self) -> str:
        """The script a ``--dry-run`` showed."""
        return self.shown[self.shown.index("# Generated by nbddp"):]


#: What Colab's runtime pins (googlecolab/backend-info, pip-freeze.txt, 2026), and so Kaggle's, built on it.
COLAB_PINS = ("ipython==7.34.0", "ipykernel==6.17.1", "jupyter_client==7.4.9")


def colab_kernel_dirs() -> tuple[str, ...]:
    """A kernel spec ``colab`` whose Python has Colab's IPython and ipykernel, everything else from this venv:
    made once in ``build/ipython7`` (pip installs the pins)."""
    import json
    import subprocess
    import sys
    import sysconfig

    env = ROOT / "build" / "ipython7"
    python = env / "bin" / "python"
    spec = env / "kernels" / "colab"
    if not (spec / "kernel.json").exists():
        subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *COLAB_PINS], check=True)
        site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                              check=True, capture_output=True, text=True).stdout.strip()
        # after its own packages: IPython and ipykernel are the pinned ones, the rest (nbformat, torch) this venv's
        Path(site, "zz-nbddp-venv.pth").write_text(sysconfig.get_path("purelib") + "\n")
        spec.mkdir(parents=True, exist_ok=True)
        (spec / "kernel.json").write_text(json.dumps({
            "argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "Colab's IPython 7.34", "language": "python"}))
    return (str(spec.parent),)
