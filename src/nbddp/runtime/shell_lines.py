"""A notebook's shell lines in a rank: ``!cmd``, ``x = !cmd``, ``%cd``, ``%%bash`` and ``%%writefile``.

Each runs on the first process of each machine while the others wait (a clone or a download happens once
per machine), and means what it meant in the kernel: ``{expr}`` and ``$name`` are expanded against the
caller's names as IPython's ``var_expand`` does (``expand`` mirrors its ``DollarFormatter``, since ranks
never import IPython); a ``!cmd`` that fails sets ``_exit_code`` and the script goes on; a ``%%bash`` cell
runs as one script and a failure raises ``CalledProcessError``, as IPython's ``%%script`` does.
"""

from __future__ import annotations

import os
import re
import shlex
import string
import subprocess
import sys

from . import settings
from .dist import is_local_main_process, main_process_first

#: IPython's ``DollarFormatter``: ``$name`` or ``$name.attr`` outside single quotes; ``$$name`` is ``$name``.
_DOLLAR = re.compile(r"(.*?)\$(\$?[\w\.]+)(?=([^']*'[^']*')*[^']*$)")


class _DollarFormatter(string.Formatter):
    """``{expr}`` evaluated in a namespace (slices allowed, no format specs), ``$name`` likewise: the
    rules of IPython's ``FullEvalFormatter``/``DollarFormatter`` (``IPython.utils.text``)."""

    def parse(self, format_string):
        for literal, field, spec, conversion in super().parse(format_string):
            done, text = 0, ""
            for m in _DOLLAR.finditer(literal):
                before, name = m.group(1, 2)
                if name.startswith("$"):
                    text += before + name
                else:
                    yield text + before, name, "", None
                    text = ""
                done = m.end()
            yield text + literal[done:], field, spec, conversion

    def vformat(self, format_string, args, kwargs):
        out = []
        for literal, field, spec, conversion in self.parse(format_string):
            out.append(literal)
            if field is not None:
                expr = f"{field}:{spec}" if spec else field
                out.append(self.format_field(self.convert_field(eval(expr, dict(kwargs)), conversion), ""))
        return "".join(out)


_FORMATTER = _DollarFormatter()


def expand(command: str, depth: int = 1) -> str:
    """``command`` with ``{expr}``/``$name`` replaced from the names of the frame ``depth`` above this one
    (its globals, then its locals); left as written when anything in it fails, as IPython leaves it."""
    frame = sys._getframe(depth)
    namespace = dict(frame.f_globals)
    namespace.update(frame.f_locals)
    try:
        return _FORMATTER.vformat(command, [], namespace)
    except Exception:
        return command


def shell(command: str) -> int:
    """A notebook ``!command``: expanded, run once per machine while the other processes wait.

    Its exit code goes to the caller's ``_exit_code``, as in the kernel; a failure does not stop the script.
    An install that would replace the running torch/CUDA stack is named and skipped (``stack_replacement``).
    """
    command = expand(command, 2)
    reason = "install" in command and not replace_stack_allowed() and stack_replacement(_split(command))
    code = 0
    with main_process_first():
        if reason and is_local_main_process():
            print(f"nbddp: not installing `{command}`: {reason} (NBDDP_REPLACE_TORCH=1 installs it)", flush=True)
        elif is_local_main_process():
            code = _run(command, shell=True, executable=os.environ.get("SHELL"))
    sys._getframe(1).f_globals["_exit_code"] = code
    return code


def getoutput(command: str) -> list[str]:
    """A notebook ``x = !command``: expanded, run in every process, its output lines (stderr included)."""
    command = expand(command, 2)
    proc = subprocess.run(command, shell=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sys._getframe(1).f_globals["_exit_code"] = proc.returncode
    return proc.stdout.splitlines()


def cd(argument: str) -> None:
    """A notebook ``%cd``: expanded, changes every process's directory and prints it (not with ``-q``)."""
    words = shlex.split(expand(argument, 2))  # as IPython's parse_options splits it (POSIX quoting)
    options = []
    while words and words[0].startswith("-") and words[0] != "-":
        options.append(words.pop(0))
    quiet = any("q" in option for option in options)
    path = " ".join(words)
    try:
        os.chdir(os.path.expanduser(path or "~"))
    except OSError as exc:  # IPython prints the error, then the directory it stays in
        print(exc)
    if not quiet:
        print(os.getcwd())


def shell_cell(arguments: str, body: str) -> int:
    """A ``%%bash``/``%%sh``/``%%script PROGRAM`` cell: ``body`` run as one script by ``PROGRAM``, once
    per machine; a non-zero exit raises ``CalledProcessError`` unless ``--no-raise-error``, as in IPython."""
    argv = shlex.split(expand(arguments, 2))
    raise_error = "--no-raise-error" not in argv
    argv = [a for a in argv if a != "--no-raise-error"]
    code = 0
    with main_process_first():
        if is_local_main_process():
            code = _run(argv, input=body.encode())
    if code and raise_error:
        raise subprocess.CalledProcessError(code, body)
    return code


def _run(args, **kwargs) -> int:
    """Run a command with its output on the console, or through ``sys.stdout`` while a ``%%capture`` cell
    holds it (the kernel reads a command's output and prints it, so ``%%capture`` takes it too)."""
    sys.stdout.flush()
    if sys.stdout is sys.__stdout__:
        return subprocess.run(args, **kwargs).returncode
    proc = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kwargs)
    sys.stdout.write(proc.stdout.decode(errors="replace"))
    return proc.returncode


def replace_stack_allowed() -> bool:
    """``NBDDP_REPLACE_TORCH=1``: installs may replace the running torch/CUDA stack."""
    return settings.current().replace_torch is True  # NBDDP_REPLACE_TORCH


def _split(command: str) -> list[str]:
    try:
        return shlex.split(command, comments=True)
    except ValueError:
        return command.split()


#: The packages of the running torch and CUDA stack, and pip's options that take a value.
_STACK = ("torch", "torchvision", "torchaudio", "triton", "pytorch", "pytorch-cuda", "cudatoolkit")
_VALUED = {"-i", "--index-url", "--extra-index-url", "-f", "--find-links", "-c", "--constraint", "-r",
           "--requirement", "-t", "--target", "--prefix", "--root", "--platform", "--python-version", "-e",
           "--editable", "--src", "--upgrade-strategy", "--trusted-host", "--cache-dir", "--log", "--timeout",
           "--retries", "--progress-bar", "--only-binary", "--no-binary", "-C", "--config-settings", "--python"}


def stack_replacement(argv: list[str]) -> str | None:
    """Why an install would replace the running torch/CUDA stack, or None.

    It would when it names a stack package (``torch``, ``torchvision``, ``nvidia-*``, …) with a version the
    installed one does not meet, or asks for one from another package index or with ``--upgrade``/
    ``--force-reinstall`` while one is installed.
    """
    from importlib import metadata

    from packaging.requirements import InvalidRequirement, Requirement

    args = argv[argv.index("install") + 1 :] if "install" in argv else []
    index = next((a for a in args if a.split("=")[0] in ("-i", "--index-url", "--extra-index-url")), None)
    forced = next((a for a in args if a in ("-U", "--upgrade", "--force-reinstall")), None)
    skip = False
    for arg in args:
        if skip or arg.startswith("-"):
            skip = not skip and arg in _VALUED
            continue
        try:
            req = Requirement(arg)
        except InvalidRequirement:
            continue
        name = req.name.lower().replace("_", "-")
        if name not in _STACK and not name.startswith("nvidia-"):
            continue
        try:
            installed = metadata.version("torch" if name == "pytorch" else name)
        except metadata.PackageNotFoundError:
            continue
        if req.specifier and not req.specifier.contains(installed, prereleases=True):
            return f"{arg} would replace the running {name} {installed}"
        if index or forced:
            return f"{arg} with {index or forced} would replace the running {name} {installed}"
    return None


def write_file(path: str, text: str, append: bool = False) -> None:
    """A ``%%writefile`` cell: written once per machine, read by all after."""
    with main_process_first():
        if is_local_main_process():
            with open(path, "a" if append else "w", encoding="utf-8") as fh:
                fh.write(text)
