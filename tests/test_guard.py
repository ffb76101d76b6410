"""One guard around the CLI, the magics and the templates: an exception in nbddp's own code becomes one
paragraph (what nbddp was doing, where the full traceback was saved, how to report it), never a raw
traceback; what is meant for the user (a refusal, a rank's failure) passes through as it is."""

import nbformat
import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

import nbddp.convert
import nbddp.job
import nbddp.launch
import nbddp.template
from nbddp import cli, guard
from nbddp.errors import JobFailed, NbddpError


def boom(*args, **kwargs):
    raise RuntimeError("boom: a slip in nbddp's own code")


@pytest.fixture
def nb(tmp_path):
    path = tmp_path / "nb.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1")]), str(path))
    return path


def assert_one_paragraph(text: str, doing: str) -> guard.Path:
    assert "Traceback" not in text and "boom" in text
    assert f"internal error while {doing}: RuntimeError: boom: a slip in nbddp's own code. This is a bug in nbddp, " \
           "not in your notebook. The full traceback is in " in text
    assert "please report it on nbddp's issue tracker with that file attached" in text
    saved = guard.Path(text.split("The full traceback is in ")[1].split(";")[0])
    report = saved.read_text()
    assert "Traceback (most recent call last)" in report and "def boom" not in report and "boom: a slip" in report
    return saved


def test_the_cli_says_one_paragraph_and_saves_the_traceback(nb, monkeypatch, capsys):
    monkeypatch.setattr(nbddp.convert, "convert_notebook", boom)
    assert cli.main(["convert", str(nb)]) == 2
    saved = assert_one_paragraph(capsys.readouterr().err, f"running nbddp convert {nb}")
    assert saved.name.startswith("nbddp-internal-error-")  # no run directory yet: a temporary file
    saved.unlink()


def test_once_a_job_has_its_run_directory_the_traceback_goes_there(nb, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(nbddp.launch, "launch", boom)
    assert cli.main(["run", "--every-rank", str(nb), "--nproc", "1", "--strategy", "ddp", "--runs-dir", str(tmp_path / "runs")]) == 2
    saved = assert_one_paragraph(capsys.readouterr().err, f"running nbddp run {nb}")
    assert saved.parent.parent == tmp_path / "runs" and saved.name == guard.ERROR_FILE


@pytest.fixture
def shell():
    ip = InteractiveShell.instance()
    ip.run_cell("%load_ext nbddp", store_history=True)
    yield ip
    ip.run_cell("%unload_ext nbddp")
    InteractiveShell.clear_instance()


def test_a_magic_says_one_paragraph(shell, nb, monkeypatch, capsys):
    import nbddp.magics

    monkeypatch.setattr(nbddp.magics, "prepare_job", boom)
    result = shell.run_cell(f"%ddp_train {nb} --dry-run", store_history=True)
    assert isinstance(result.error_in_exec, guard.InternalError)
    assert_one_paragraph("".join(capsys.readouterr()), "running %%ddp_train").unlink()
    result = shell.run_cell("%ddp_train", store_history=True)  # a usage error stays IPython's
    assert isinstance(result.error_in_exec, UsageError)


def test_a_template_says_one_paragraph(tmp_path, monkeypatch):
    template = tmp_path / "t.ipynb"
    params = nbformat.v4.new_code_cell("steps = 1")
    params.metadata["tags"] = ["parameters"]
    notebook = nbformat.v4.new_notebook(cells=[params, nbformat.v4.new_code_cell("x = steps")])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, str(template))
    monkeypatch.setattr(nbddp.template, "convert_cells", boom)
    with pytest.raises(guard.InternalError) as caught:
        nbddp.template.run_template(template, {"steps": 1})
    assert_one_paragraph(str(caught.value), "training a template").unlink()


def test_what_is_meant_for_the_user_passes_through_as_it_is():
    failed = JobFailed("rank 1 failed in cell 3, line 2: ValueError: bad", report="the mapped traceback")
    for exc in (failed, NbddpError("a refusal"), KeyboardInterrupt(), SystemExit(2)):
        with pytest.raises(type(exc)) as caught:
            with guard.guarded("testing"):
                raise exc
        assert caught.value is exc
    with pytest.raises(UsageError):
        with guard.guarded("testing", passthrough=(UsageError,)):
            raise UsageError("bad usage")
