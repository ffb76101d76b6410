"""A download before training whose result the notebook keeps (``path = wget.download(url)``): the kernel fetched
the file once, so the job's script fetches it once, on rank 0, and the other ranks wait for it and get the names
it bound (the path) from rank 0 (``runtime/from_rank0.py``). Run by every rank, both would write the same file at
once (``wget`` even writes ``x (1).csv`` on the second)."""

from __future__ import annotations

import json

import pytest

from conftest import write_notebook

TRAIN = "trainer = Trainer(model=model)\ntrainer.train()\n"


def sent(names: str, *body: str) -> str:
    """A download's rank-0 block: rank 0 runs ``body``, and the names it binds reach the other ranks as it ends."""
    quoted = ", ".join(repr(n) for n in names.split(", "))
    return (f"with _nbddp.from_rank0(globals(), {quoted}):  # [nbddp] it downloads: once, on rank 0; {names} sent "
            "to every rank\n    if _nbddp.on_rank0():\n" + "".join(f"        {line}\n" for line in body))


@pytest.mark.parametrize(("download", "names"), [
    ("path = wget.download(url)", "path"),
    ("path, _ = urllib.request.urlretrieve(url, 'x.csv')", "_, path"),
    ("(path, headers) = urlretrieve(url, filename='x.csv')", "headers, path"),
    ("f = gdown.download(url, 'w.pt', quiet=False)", "f"),
    ("path: str = wget.download(url, out='data')", "path"),
    ("first = second = request.urlretrieve(url, 'x.csv')[0]", "first, second"),
])
def test_an_assigned_download_before_training_runs_on_rank_0_and_every_rank_gets_what_it_binds(rewrite, download,
                                                                                                 names):
    (code, _), changes = rewrite(download + "\n", TRAIN)
    assert code == sent(names, download)
    assert "barrier" not in code  # the other ranks wait for rank 0's answer already
    assert any(rule == "rank0" and line == 1 and message == (
        f"runs on rank 0 only, once as in the kernel; the other ranks wait for it, then get {names} from rank 0 "
        "(what it downloads is whole before any rank goes on)") for rule, line, message in changes)


def test_a_download_and_a_save_side_by_side_are_one_block_whose_end_every_rank_waits_for(rewrite):
    cells = ("urllib.request.urlretrieve(url, 'a.csv')\npath = wget.download(url2)\n", TRAIN)
    (code, _), _ = rewrite(*cells)
    assert code == sent("path", "urllib.request.urlretrieve(url, 'a.csv')", "path = wget.download(url2)")


def test_an_expression_download_keeps_its_barrier(rewrite):
    (code, _), _ = rewrite("urllib.request.urlretrieve(url, 'a.csv')\n", TRAIN)
    assert code == ("if _nbddp.on_rank0():\n    urllib.request.urlretrieve(url, 'a.csv')\n"
                    "_nbddp.barrier()  # the other ranks read what rank 0 wrote\n")


def test_a_download_into_an_item_of_a_list_sends_the_list(rewrite):
    (code, _), _ = rewrite("paths[0] = wget.download(url)\n", TRAIN)
    assert code == sent("paths", "paths[0] = wget.download(url)")


def test_a_download_nbddp_does_not_know_stays_on_every_rank(rewrite):
    (code, _), _ = rewrite("path = helper.download(url)\n", TRAIN)
    assert code == "path = helper.download(url)\n"


@pytest.mark.parametrize("download", [
    "local = hf_hub_download(repo_id='me/data', filename='train.csv')",
    "folder = snapshot_download('me/model')",
    "p = kagglehub.dataset_download('me/data')",
    "p = kagglehub.competition_download('titanic')",
    "p = kagglehub.model_download('google/gemma/transformers/2b')",
    "p = kagglehub.notebook_output_download('me/notebook')",
])
def test_cache_downloads_run_on_every_rank_main_process_first(rewrite, download):
    """The Hub's and Kaggle's downloads fill a cache: rank 0 downloads first, then each rank finds it there and
    gets its own path back (its node's, not rank 0's)."""
    (code, _), _ = rewrite(download + "\n", TRAIN)
    assert code == f"with _nbddp.main_process_first():\n    {download}\n"


def test_a_download_after_training_stays_on_rank_0_as_the_tail_does(rewrite):
    (_, code), _ = rewrite(TRAIN, "path = wget.download(url)\n")
    assert code == "if _nbddp.on_rank0():\n    path = wget.download(url)\n"


# ------------------------------------------------------------------ on two gloo ranks

#: Every call of ``urllib.request.urlretrieve`` appends the rank that made it to ``fetches.txt``.
COUNTED = (
    "import json, os, urllib.request\nimport torch\nfrom torch import nn\n"
    "from torch.utils.data import DataLoader, TensorDataset\n"
    "fetch = urllib.request.urlretrieve\n"
    "def counted(url, filename=None):\n"
    "    with open('fetches.txt', 'a') as fh:\n"
    "        fh.write(os.environ.get('RANK', 'kernel') + '\\n')\n"
    "    return fetch(url, filename)\n"
    "urllib.request.urlretrieve = counted"
)
READ = (
    "rows = [[float(v) for v in line.split(',')] for line in open(path).read().split()]\n"
    "with open(f\"got-{os.environ['RANK']}.json\", 'w') as fh:\n"
    "    json.dump({'path': path, 'rows': len(rows)}, fh)\n"
    "table = torch.tensor(rows)\n"
    "loader = DataLoader(TensorDataset(table[:, :2], table[:, 2:]), batch_size=4, shuffle=True)\n"
    "torch.manual_seed(0)\nmodel = nn.Linear(2, 1)\noptimizer = torch.optim.SGD(model.parameters(), lr=0.05)"
)
TRAIN_LOOP = (
    "for epoch in range(2):\n"
    "    for xb, yb in loader:\n"
    "        loss = ((model(xb) - yb) ** 2).mean()\n"
    "        optimizer.zero_grad()\n"
    "        loss.backward()\n"
    "        optimizer.step()\n"
    "    with open(f\"weights-{os.environ['RANK']}.json\", 'w') as fh:\n"
    "        json.dump([p.tolist() for p in model.parameters()], fh)"
)


def run_on_two_ranks(nb, tmp_path):
    """The notebook as ``nbddp run --nproc 2`` runs it (2 gloo ranks); the job, which must have ended well."""
    from nbddp.job import run_job
    from nbddp.options import RunOptions
    from views import Said

    chunks: list[str] = []
    job = run_job(nb, RunOptions(nproc=2, runs_dir=tmp_path / "runs", timeout_s=300), Said(chunks))
    assert job.run.ok, ("".join(chunks)[-3000:], job.run.failure)
    return job


@pytest.mark.e2e
def test_a_download_whose_path_every_rank_reads_is_fetched_once_and_trains_on_every_rank(tmp_path):
    source = tmp_path / "source.csv"
    source.write_text("".join(f"{i},{i % 3},{2 * i - (i % 3)}\n" for i in range(16)))
    nb = write_notebook(tmp_path / "nb.ipynb", [
        COUNTED,
        f"path, headers = urllib.request.urlretrieve({source.as_uri()!r}, 'data.csv')",
        READ,
        TRAIN_LOOP,
    ])
    job = run_on_two_ranks(nb, tmp_path)
    assert (tmp_path / "fetches.txt").read_text() == "0\n"  # fetched once, by rank 0
    got = [json.loads((tmp_path / f"got-{rank}.json").read_text()) for rank in (0, 1)]
    assert got == [{"path": "data.csv", "rows": 16}] * 2  # every rank got the path, and read the whole file
    weights = [json.loads((tmp_path / f"weights-{rank}.json").read_text()) for rank in (0, 1)]
    assert weights[0] == weights[1]  # trained together on it
    assert "with _nbddp.from_rank0(globals(), 'headers', 'path'):" in job.script.text


# ------------------------------------------------------------------ a download inside a loop or a function


def test_a_loop_of_downloads_before_training_runs_on_rank_0_and_every_rank_gets_what_it_binds(rewrite):
    """``for url in urls: urlretrieve(url, name)`` ran once in the kernel: rank 0 runs the whole loop, the
    others wait and get the names it bound (its target, a list it grew)."""
    loop = "for url in urls:\n    name = url.rsplit('/', 1)[1]\n    urlretrieve(url, name)\n    files.append(name)"
    (code, _), changes = rewrite("files = []\n" + loop + "\n", TRAIN)
    assert code == "files = []\n" + sent("files, name, url", *loop.splitlines())
    assert ("rank0", 2, "runs on rank 0 only, once as in the kernel (a loop that downloads); the other ranks wait "
            "for it, then get files, name, url from rank 0 (what it downloads is whole before any rank goes on)"
            ) in changes


def test_a_lambda_in_a_loop_of_downloads_binds_nothing_to_send(rewrite):
    loop = "for url in sorted(urls, key=lambda u: len(u)):\n    wget.download(url)"
    (code, _), _ = rewrite(loop + "\n", TRAIN)
    assert code == sent("url", *loop.splitlines())


def test_a_call_of_a_notebook_function_that_downloads_runs_on_rank_0_and_the_others_wait(rewrite):
    fetch = "def fetch():\n    urllib.request.urlretrieve(url, 'data.csv')\n"
    (_, code, _), changes = rewrite(fetch, "fetch()\n", TRAIN)
    assert code == ("with _nbddp.from_rank0(globals()):  # [nbddp] it downloads: once, on rank 0\n"
                    "    if _nbddp.on_rank0():\n        fetch()\n")
    assert ("rank0", 1, "runs on rank 0 only, once as in the kernel (fetch() downloads); the other ranks wait for "
            "it (what it downloads is whole before any rank goes on)") in changes


@pytest.mark.parametrize(("calls", "names"), [
    ("path = fetch(url)", "path"),
    ("paths = [fetch(u) for u in urls]", "paths"),
    ("fetch_all()", "downloaded"),  # through a second function, which declares a global
])
def test_a_function_that_downloads_is_followed_through_the_functions_it_calls(rewrite, calls, names):
    defs = ("def fetch(u):\n    return wget.download(u)\n"
            "def fetch_all():\n    global downloaded\n    downloaded = [fetch(u) for u in urls]\n")
    (_, code, _), _ = rewrite(defs, calls + "\n", TRAIN)
    assert code == sent(names, calls)


def test_a_function_that_downloads_stays_as_defined(rewrite):
    (code, _, _), _ = rewrite("def fetch():\n    wget.download(url)\n", "print(1)\n", TRAIN)
    assert code == "def fetch():\n    wget.download(url)\n"


def refused(*cells):
    from nbddp.cells import Cell
    from nbddp.convert import convert_cells
    from nbddp.errors import CellError

    with pytest.raises(CellError) as error:
        convert_cells([Cell(index=i + 1, source=source) for i, source in enumerate(cells)])
    return error.value


@pytest.mark.parametrize(("code", "line", "said"), [
    ("for url in urls:\n    wget.download(url)\n    dist.barrier()\n", 2,
     "this loop downloads (wget.download) and calls dist.barrier(), which needs every rank, so nbddp cannot run it "
     "once on rank 0"),
    ("path = (wget.download(url), dist.barrier())[0]\n", 1,
     "this statement downloads (wget.download) and calls dist.barrier(), which needs every rank"),
    ("for url in urls:\n    config.path = wget.download(url)\n", 2,
     "this loop downloads (wget.download), and it sets config.path, which the other ranks would miss"),
    ("config.path = wget.download(url)\n", 1,
     "this statement downloads (wget.download), and it sets config.path, which the other ranks would miss"),
    ("for url in urls:\n    import json\n    urlretrieve(url, 'x.json')\n", 3,
     "this loop downloads (urlretrieve), and it imports json, which rank 0 cannot send to the other ranks"),
    ("model.load_state_dict(torch.load(wget.download(url)))\n", 1,
     "this statement downloads (wget.download), and it calls model.load_state_dict(), whose effect the other ranks "
     "would miss"),
    ("for url in urls:\n    def name(u):\n        return u[-5:]\n    urlretrieve(url, name(url))\n", 4,
     "this loop downloads (urlretrieve), and it defines name, which rank 0 cannot send to the other ranks"),
    ("def fetch(u):\n    os.environ['DATA'] = wget.download(u)\n\nfetch(url)\n", 4,
     "this statement downloads (wget.download, in fetch()), and it sets os.environ['DATA'], which the other ranks "
     "would miss (in fetch())"),
    ("for url in urls:\n    urlretrieve(url, 'x.csv')\n    os.chdir('data')\n", 2,
     "this loop downloads (urlretrieve), and it calls os.chdir(), whose effect the other ranks would miss"),
])
def test_a_download_that_cannot_run_on_rank_0_alone_is_refused_at_its_line_with_the_fix(code, line, said):
    error = refused(code, TRAIN)
    assert (error.cell, error.line) == (1, line)
    assert said in str(error) and "every rank would download at once" in str(error)
    assert "download in a statement of its own before it" in str(error)


@pytest.mark.parametrize(("cells", "cell", "line", "said"), [
    (("def train():\n    urlretrieve(url, 'x.csv')\n    trainer.train()\n",
      "trainer = Trainer(model=model)\ntrain()\n"),
     2, 2, "train() trains, and downloads (urlretrieve) on every rank at once"),
    (("for epoch in range(2):\n    urlretrieve(url, 'x.csv')\n    loss = model(x)\n    loss.backward()\n",),
     1, 2, "this loop trains, and downloads (urlretrieve) on every rank at once"),
])
def test_a_download_in_a_statement_that_trains_is_refused(cells, cell, line, said):
    error = refused(*cells)
    assert (error.cell, error.line) == (cell, line)
    assert said in str(error) and "download in a cell before the training" in str(error)


@pytest.mark.e2e
def test_a_loop_calling_a_function_that_downloads_fetches_each_file_once_and_every_rank_gets_the_list(tmp_path):
    sources = []
    for part, rows in (("a", range(8)), ("b", range(8, 16))):
        source = tmp_path / f"source-{part}.csv"
        source.write_text("".join(f"{i},{i % 3},{2 * i - (i % 3)}\n" for i in rows))
        sources.append((source.as_uri(), f"{part}.csv"))
    nb = write_notebook(tmp_path / "nb.ipynb", [
        COUNTED,
        "def download(url, name):\n    urllib.request.urlretrieve(url, name)\n    return name",
        f"sources = {sources!r}\npaths = []\nfor url, name in sources:\n    paths.append(download(url, name))",
        READ.replace("open(path).read()", "''.join(open(p).read() for p in paths)").replace("'path': path",
                                                                                           "'paths': paths"),
        TRAIN_LOOP,
    ])
    job = run_on_two_ranks(nb, tmp_path)
    assert (tmp_path / "fetches.txt").read_text() == "0\n0\n"  # each file fetched once, by rank 0
    got = [json.loads((tmp_path / f"got-{rank}.json").read_text()) for rank in (0, 1)]
    assert got == [{"paths": ["a.csv", "b.csv"], "rows": 16}] * 2  # every rank got the list, and read both files
    weights = [json.loads((tmp_path / f"weights-{rank}.json").read_text()) for rank in (0, 1)]
    assert weights[0] == weights[1]
    assert "with _nbddp.from_rank0(globals(), 'name', 'paths', 'url'):" in job.script.text


# ------------------------------------------------------------------ a notebook that only predicts

PREDICT = "preds = []\nfor text in texts:\n    preds.append(pipe(text))\n"


def test_a_download_before_the_predictions_runs_once_on_rank_0_as_before_a_training(rewrite):
    """Nothing trains: the downloads before the first prediction loop are fetched once as before a training
    (every rank fetched them at once, and a rank reading its file while another truncated it read part of it)."""
    (loop, single, _, tail), changes = rewrite(
        "for url in urls:\n    urllib.request.urlretrieve(url, url.split('/')[-1])\n",
        "urllib.request.urlretrieve(url, 'c.csv')\n",
        "pipe = pipeline('text-classification')\ntexts = list(open('c.csv'))\n" + PREDICT,
        "pd.DataFrame({'p': preds}).to_csv('submission.csv')\n")
    assert loop == sent("url", "for url in urls:", "    urllib.request.urlretrieve(url, url.split('/')[-1])")
    assert single == ("if _nbddp.on_rank0():\n    urllib.request.urlretrieve(url, 'c.csv')\n"
                      "_nbddp.barrier()  # the other ranks read what rank 0 wrote\n")
    assert tail.startswith("if _nbddp.on_rank0():\n")
    assert ("rank0", 1, "runs on rank 0 only (after the predictions, which every rank gathered)") in changes


@pytest.mark.e2e
def test_a_notebook_that_only_predicts_fetches_its_file_once_and_every_rank_predicts_its_share(tmp_path):
    source = tmp_path / "source.csv"
    source.write_text("".join(f"{i},{i % 3}\n" for i in range(10)))
    nb = write_notebook(tmp_path / "nb.ipynb", [
        COUNTED,
        f"path, headers = urllib.request.urlretrieve({source.as_uri()!r}, 'data.csv')",
        "rows = [[float(v) for v in line.split(',')] for line in open(path).read().split()]\n"
        "with open(f\"got-{os.environ['RANK']}.json\", 'w') as fh:\n"
        "    json.dump({'path': path, 'rows': len(rows)}, fh)\n"
        "torch.manual_seed(0)\nmodel = nn.Linear(2, 1)",
        "preds = []\nfor row in rows:\n    with torch.no_grad():\n"
        "        preds.append(float(model(torch.tensor(row)).item()))",
        "with open('preds.json', 'w') as fh:\n    json.dump(preds, fh)",
    ])
    job = run_on_two_ranks(nb, tmp_path)
    assert (tmp_path / "fetches.txt").read_text() == "0\n"  # fetched once, by rank 0 (every rank fetched before)
    got = [json.loads((tmp_path / f"got-{rank}.json").read_text()) for rank in (0, 1)]
    assert got == [{"path": "data.csv", "rows": 10}] * 2  # every rank got the path, and read the whole file
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        expected = [float(model(torch.tensor([float(i), float(i % 3)])).item()) for i in range(10)]
    assert json.loads((tmp_path / "preds.json").read_text()) == pytest.approx(expected)  # every row, in order
    assert "each rank predicts its share of the rows" in job.script.text


# ------------------------------------------------------------------ between two trainings


def test_a_download_between_two_trainings_runs_once_on_rank_0_as_before_the_first(rewrite):
    """Between two trainings every statement that is not a save, a print or a plot ran on every rank, a download
    too: every rank fetched the same file at once."""
    (_, between, _, after), changes = rewrite(
        TRAIN, "path, _ = urllib.request.urlretrieve(url, 'more.csv')\n", TRAIN,
        "for url in urls:\n    urllib.request.urlretrieve(url, url.split('/')[-1])\n")
    assert between == sent("_, path", "path, _ = urllib.request.urlretrieve(url, 'more.csv')")
    assert after.startswith("if _nbddp.on_rank0():\n")  # after the last training: the tail's, as before
    assert ("rank0", 1, "runs on rank 0 only, once as in the kernel; the other ranks wait for it, then get _, path "
            "from rank 0 (what it downloads is whole before any rank goes on)") in changes


@pytest.mark.e2e
def test_a_download_between_two_trainings_is_fetched_once_and_the_second_training_reads_it_on_every_rank(tmp_path):
    sources = []
    for part, rows in (("a", range(8)), ("b", range(8, 16))):
        source = tmp_path / f"source-{part}.csv"
        source.write_text("".join(f"{i},{i % 3},{2 * i - (i % 3)}\n" for i in rows))
        sources.append(source.as_uri())
    nb = write_notebook(tmp_path / "nb.ipynb", [
        COUNTED,
        f"path, headers = urllib.request.urlretrieve({sources[0]!r}, 'a.csv')",
        READ,
        TRAIN_LOOP,
        f"path, headers = urllib.request.urlretrieve({sources[1]!r}, 'b.csv')",
        READ.replace("got-{", "got-second-{"),
        TRAIN_LOOP,
    ])
    job = run_on_two_ranks(nb, tmp_path)
    assert (tmp_path / "fetches.txt").read_text() == "0\n0\n"  # each file fetched once, by rank 0
    got = [json.loads((tmp_path / f"got-second-{rank}.json").read_text()) for rank in (0, 1)]
    assert got == [{"path": "b.csv", "rows": 8}] * 2  # every rank got the second path and read the whole file
    weights = [json.loads((tmp_path / f"weights-{rank}.json").read_text()) for rank in (0, 1)]
    assert weights[0] == weights[1]
    assert job.script.text.count("with _nbddp.from_rank0(globals(), 'headers', 'path'):") == 2
