"""Prediction on every rank, without launching: the converted script of a notebook that predicts and does not
train, the refusals of loops the ranks cannot split, and the runtime's shares and gathers in one process."""

import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nbddp.cells import Cell
from nbddp.convert.script import convert_cells, convert_notebook
from nbddp.display.view import QuietView
from nbddp.errors import CellError, NbddpError
from nbddp.job import run_job
from nbddp.job_plan import PREDICT, decide_mode
from nbddp.options import RunOptions
from nbddp.runtime.predict import Rows, block
from nbddp.runtime.shares import handed_chunks

CORPUS = Path(__file__).resolve().parent / "corpus" / "predict"

SETUP = """import torch
from torch.utils.data import DataLoader, TensorDataset
model = torch.nn.Linear(4, 3)
test_loader = DataLoader(TensorDataset(torch.randn(9, 4)), batch_size=2)
xs = list(torch.randn(5, 4))"""


def convert(*sources: str):
    return convert_cells([Cell(k, src) for k, src in enumerate(sources, start=1)], origin="nb.ipynb")


def test_a_loader_loop_is_split_its_lists_and_sums_gathered_and_the_code_after_runs_on_rank_0():
    script = convert_notebook(CORPUS / "predict_classifier.ipynb")
    text = script.text
    assert script.predicts and not script.trains and decide_mode(script) == PREDICT
    assert ("for xb, yb in (_nbddp_rows := _nbddp.predict.Rows(test_loader, preds=preds, correct=correct, "
            "total=total, loss_sum=loss_sum)):") in text
    assert "correct += _nbddp_rows.add('correct', (pred == yb).sum().item())" in text
    assert "    else:\n        preds, correct, total, loss_sum, = _nbddp_rows.gathered()" in text
    assert "for idx, row in (_nbddp_rows := _nbddp.predict.Rows(test_df.iterrows(), scores=scores)):" in text
    assert "for prompt in (_nbddp_rows := _nbddp.predict.Rows(prompts, answers=answers)):" in text
    assert "for xb, _ in iter((_nbddp_rows := _nbddp.predict.Rows(loader, model_preds=model_preds))):" in text
    assert "for member in members:\n    votes.append(inference(member, test_loader))" in text  # each call splits
    tail = text.split("# [cell 5]\n")[1]
    assert tail.startswith("if _nbddp.on_rank0():\n    labels = torch.cat(preds).tolist()")
    assert "import nbddp.runtime.predict" in text
    compile(text, "script.py", "exec")
    assert not script.warnings


def test_a_notebook_that_trains_is_not_in_predict_mode():
    script = convert(SETUP, "opt = torch.optim.SGD(model.parameters(), lr=0.1)\nfor (xb,) in test_loader:\n"
                            "    loss = model(xb).sum()\n    loss.backward()\n    opt.step()")
    assert script.trains and not script.predicts and "predict.Rows" not in script.text


def test_enumerate_counts_from_each_rows_place_and_tqdm_stays():
    script = convert(SETUP, "from tqdm import tqdm\nout = []\nfor i, x in enumerate(xs, 1):\n"
                            "    out.append((i, model(x)))",
                     "done = []\nfor x in tqdm(xs, desc='predict'):\n    done.append(model(x))")
    assert "_nbddp.predict.Rows(xs, 1, out=out)" in script.text
    batches = convert(SETUP, "out = []\nfor i, (xb,) in enumerate(iter(test_loader)):\n    out.append(model(xb))")
    assert "for i, (xb,) in (_nbddp_rows := _nbddp.predict.Rows(test_loader, 0, out=out)):" in batches.text
    assert "for x in tqdm((_nbddp_rows := _nbddp.predict.Rows(xs, done=done)), desc='predict'):" in script.text


def test_a_notebook_whose_only_prediction_is_trainer_predict_predicts_and_writes_on_rank_0():
    # the Trainer splits and gathers its rows itself: its calls stay as they are, on every rank
    script = convert("from transformers import Trainer, TrainingArguments\nimport pandas as pd\n"
                     "trainer = Trainer(model=model, args=TrainingArguments('out'))",
                     "out = trainer.predict(test_ds)\npreds = out.predictions.argmax(-1)",
                     "print(trainer.evaluate()['eval_loss'])",
                     "pd.DataFrame({'label': preds}).to_csv('submission.csv', index=False)")
    assert script.predicts and decide_mode(script) == PREDICT
    assert "out = trainer.predict(test_ds)\nif _nbddp.on_rank0():\n    preds = out.predictions.argmax(-1)" in script.text
    assert "if _nbddp.on_rank0():\n    pd.DataFrame({'label': preds}).to_csv('submission.csv', index=False)" \
        in script.text
    assert "print(trainer.evaluate()['eval_loss'])" in script.text.split("# [cell 3]")[1].split("# [cell 4]")[0]


def test_a_trainer_prediction_whose_rows_would_be_padded_is_split_in_blocks_unless_it_cannot_be(monkeypatch):
    from types import SimpleNamespace

    from nbddp.runtime import dist
    from nbddp.runtime.trainer_rows import padded, unsplittable

    args = SimpleNamespace(per_device_eval_batch_size=4, batch_eval_metrics=False, include_for_metrics=[])
    trainer = SimpleNamespace(args=args)
    monkeypatch.setattr(dist, "rank_info", lambda: SimpleNamespace(world_size=2))
    assert not padded(trainer, list(range(16))) and unsplittable(trainer, list(range(16))) is None
    assert padded(trainer, list(range(10))) and unsplittable(trainer, list(range(10))) is None  # split in blocks
    assert "no length" in unsplittable(trainer, iter(range(8)))
    args.batch_eval_metrics = True
    assert "batch by batch (batch_eval_metrics=True)" in unsplittable(trainer, list(range(10)))
    assert unsplittable(trainer, list(range(16))) is None  # the Trainer's own split pads nothing there
    args.batch_eval_metrics, args.include_for_metrics = False, ["inputs"]
    assert "given the inputs" in unsplittable(trainer, list(range(10)))
    monkeypatch.setattr(dist, "rank_info", lambda: SimpleNamespace(world_size=1))
    assert not padded(trainer, list(range(10))) and unsplittable(trainer, list(range(10))) is None


REFUSED = {
    "carried": ("prev = torch.zeros(3)\nout = []\nfor x in xs:\n    prev = model(x) + prev\n    out.append(prev)",
                3, "prev carries a value from one row to the next"),
    "counter": ("i = 1\nsub = []\nfor (xb,) in test_loader:\n    sub.append([i, model(xb)])\n    i += 1",
                3, "i carries a value from one row to the next"),
    "break": ("out = []\nfor x in xs:\n    out.append(model(x))\n    if len(xs) > 3:\n        break", 2, "break"),
    "writes": ("out = []\nf = open('p.txt', 'w')\nfor x in xs:\n    out.append(model(x))\n    f.write(str(x))",
               3, "it writes into f row by row"),
    "shuffled": ("loader = DataLoader(TensorDataset(torch.randn(9, 4)), batch_size=2, shuffle=True)\nout = []\n"
                 "for (xb,) in loader:\n    out.append(model(xb))", 3, "random order"),
    "sampled": ("import random\nout = []\nfor x in random.sample(xs, 3):\n    out.append(model(x))", 3,
                "random order"),
    "returns": ("def first_good(xs):\n    out = []\n    for x in xs:\n        out.append(model(x))\n"
                "        if out[-1].sum() > 0:\n            return x", 3, "it returns from inside the loop"),
    "hidden call": ("def predict_all(xs):\n    out = []\n    for x in xs:\n        out.append(model(x))\n"
                    "    return out\ndef main():\n    return predict_all(xs)", 7, "called from inside another function"),
    "samples": ("out = []\nfor x in xs:\n    out.append(model.generate(x, do_sample=True))", 2, "draws random numbers"),
    "noise": ("out = []\nfor x in xs:\n    out.append(model(x + torch.randn(4)))", 2, "torch.randn(…) draws random"),
    "generator": ("g = torch.Generator().manual_seed(0)\nout = []\nfor x in xs:\n    out.append(pipe(x, generator=g))",
                  3, "generator=g), a generator made before the loop, draws random numbers"),
    "appends after": ("out = []\nwith torch.no_grad():\n    for x in xs:\n        out.append(model(x))\n"
                      "    open('log.txt', 'a').write(str(out))", 3, "would append once per rank"),
    "read after": ("out = []\nfor x in xs:\n    y = model(x)\n    out.append(y)\nprint(y.shape)", 2,
                   "y is read after the loop"),
}


@pytest.mark.parametrize("reason", REFUSED)
def test_a_loop_the_ranks_cannot_split_is_refused_at_its_cell_and_line(reason):
    source, line, said = REFUSED[reason]
    with pytest.raises(CellError) as caught:
        convert(SETUP, source)
    assert (caught.value.cell, caught.value.line) == (2, line)
    assert said in str(caught.value) and "cannot split this prediction loop" in str(caught.value)


def test_a_refusal_comes_before_anything_is_made(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    nb = tmp_path / "nb.ipynb"
    from conftest import write_notebook

    write_notebook(nb, [SETUP, REFUSED["counter"][0]])
    with pytest.raises(CellError, match="cell 2, line 3"):
        run_job(nb, RunOptions(nproc=2, runs_dir=tmp_path / "runs"), QuietView())
    assert not (tmp_path / "runs").exists()


@given(total=st.integers(0, 500), world=st.integers(1, 8))
def test_the_blocks_are_contiguous_in_rank_order_and_cover_every_position(total, world):
    blocks = [block(total, rank, world) for rank in range(world)]
    assert blocks[0][0] == 0 and blocks[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
    assert max(e - f for f, e in blocks) - min(e - f for f, e in blocks) <= 1


def test_one_process_takes_every_row_and_replays_its_sums():
    preds, total = [-1], 0.5
    rows = Rows(iter("abc"), 10, preds=preds, total=total)
    for i, ch in rows:
        preds.append((i, ch))
        total += rows.add("total", 0.25)
    assert rows.gathered() == ([-1, (10, "a"), (11, "b"), (12, "c")], 1.25)
    assert rows.gathered()[0] is preds


def test_a_rank_without_a_process_group_keeps_its_block_and_gathers_its_own_rows(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    out, total = [], 0
    rows = Rows(list(range(5)), out=out, total=total)
    assert rows.next_chunk is None  # nothing to count hand-outs on: its contiguous block
    for x in rows:
        out.append(x * 10)
        total += rows.add("total", x)
    assert rows.gathered() == ([20, 30, 40], 9) and rows.last_rank == 1


def test_a_tensor_sum_is_replayed_from_its_value_before_the_loop_and_an_unknown_accumulator_is_stopped():
    import collections

    import torch

    total = torch.zeros(2)
    rows = Rows([1, 2, 3], total=total)
    for x in rows:
        total += rows.add("total", torch.ones(2) * x)  # in place: the value before the loop was kept apart
    assert rows.gathered()[0].tolist() == [6.0, 6.0]
    with pytest.raises(TypeError, match="d accumulates .* but is a deque"):
        Rows([1], d=collections.deque())


def test_a_loop_over_sharded_weights_is_stopped_saying_what_runs_it(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("NBDDP_STRATEGY", "fsdp")
    with pytest.raises(RuntimeError, match="--strategy split"):
        Rows([1, 2, 3], out=[])


def test_each_kind_of_rows_is_shared_as_iterating_it_gives_them(monkeypatch):
    import pandas as pd
    import torch

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")  # the second of two ranks: the second block
    frame = pd.DataFrame({"a": [1, 2, 3], "b": [4, 5, 6]})
    for rows, expected in ((frame, ["b"]), (frame["a"], [2, 3]), (range(3), [1, 2]),
                           ({"k": 1}, ["k"]), (torch.arange(3), [1, 2]), (iter("abcd"), ["c", "d"])):
        assert [x.item() if hasattr(x, "item") else x for x in Rows(rows)] == expected


def test_a_row_that_draws_random_numbers_stops_the_split_loop(monkeypatch):
    import torch

    monkeypatch.setenv("WORLD_SIZE", "2")
    drawn = []
    with pytest.raises(RuntimeError, match="draws random numbers"):
        for x in Rows([1, 2, 3, 4], iterable=[], drawn=drawn):  # any name may accumulate
            drawn.append(torch.rand(1))  # sampling: row 2 would draw another number than in one process
    assert len(drawn) == 1
    steady = []
    for x in Rows([1, 2, 3, 4], steady=steady):
        steady.append(torch.ones(1) * x)
    assert len(steady) == 2  # the first of two ranks: its block, undisturbed


def test_a_public_notebook_that_only_predicts_splits_its_loop_over_the_urls():
    # huggingface/cookbook's information extraction notebook (tests/corpus/public/MANIFEST.json): a Haystack
    # pipeline fetches each URL and extracts with NuExtract; nbddp refused it before (no training call found)
    script = convert_notebook(CORPUS.parent / "public" / "hf_cookbook" / "information_extraction_haystack_nuextract.ipynb")
    assert decide_mode(script) == PREDICT
    assert "for url in tqdm((_nbddp_rows := _nbddp.predict.Rows(urls, extracted_data=extracted_data))):" in script.text
    assert "else:\n    extracted_data, = _nbddp_rows.gathered()" in script.text
    assert "# [cell 29]\nif _nbddp.on_rank0():\n    extracted_data[:2]" in script.text


def test_between_two_prediction_loops_what_writes_runs_on_rank_0_and_what_a_later_loop_needs_on_every_rank():
    script = convert(SETUP, "out = []\nfor x in xs:\n    out.append(model(x))\nopen('first.txt', 'w').write(str(out))\n"
                            "model.eval()\nscale = 2",
                     "more = []\nfor x in xs:\n    more.append(model(x) * scale)\nprint(len(more))")
    assert "if _nbddp.on_rank0():\n    open('first.txt', 'w').write(str(out))\nmodel.eval()\nscale = 2" in script.text
    assert "if _nbddp.on_rank0():\n    print(len(more))" in script.text


def test_a_progress_bar_inside_enumerate_is_shared_as_what_it_wraps(monkeypatch):
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from tqdm.auto import tqdm

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    loader = DataLoader(TensorDataset(torch.arange(8)), batch_size=2)
    rows = Rows(tqdm(loader, disable=True), 0)  # enumerate(tqdm(loader)): the loader's share, not every batch read
    assert rows.unit == "batches" and (rows.first, rows.end) == (2, 4)
    assert [(i, b.tolist()) for i, (b,) in rows] == [(2, [4, 5]), (3, [6, 7])]


@pytest.mark.parametrize("loop", [REFUSED["counter"][0], "out = []\nfor x in xs:\n    out.append(model(x))"])
def test_every_rank_runs_a_predicting_notebook_whole_on_every_rank_split_or_not(tmp_path, loop):
    # --every-rank is the escape hatch: no prediction split, no refusal, every cell on every rank as before
    from conftest import write_notebook
    from nbddp.gpus import Machine
    from nbddp.job_plan import EVERY_RANK, plan_job

    nb = tmp_path / "nb.ipynb"
    write_notebook(nb, [SETUP, loop, "print(len(out))"])
    planned = plan_job(nb, RunOptions(nproc=2, every_rank=True), machine=Machine(0))
    assert planned.mode == EVERY_RANK and not planned.job.script.predicts
    assert "predict.Rows" not in planned.job.script.text and "on_rank0" not in planned.job.script.text


def test_every_rank_dry_run_from_the_command_line_shows_the_notebook_whole(tmp_path, capsys):
    # nbddp run --every-rank --dry-run converts before planning: the switch goes with the conversion
    from conftest import write_notebook
    from nbddp import cli

    nb = tmp_path / "nb.ipynb"
    write_notebook(nb, [SETUP, REFUSED["counter"][0], "print(len(sub))"])
    assert cli.main(["run", str(nb), "--every-rank", "--dry-run", "--show-script", "--nproc", "2"]) == 0
    out = capsys.readouterr().out
    assert "for (xb,) in test_loader:" in out and "predict.Rows" not in out


PIPE = "from transformers import pipeline\npipe = pipeline('text-classification')\n"




def test_a_pipeline_given_one_text_or_a_notebook_launching_its_training_is_not_refused():
    assert not convert(SETUP, PIPE + "print(pipe('a b'))").predicts
    assert convert(SETUP, PIPE + "!torchrun train.py\nprint(pipe(['a', 'b']))").launches


SPLIT = PIPE + "texts = df['text'].tolist()\n"


@pytest.mark.parametrize("call, split", [
    (PIPE + "out = pipe(['a b', 'c d'])", "out = _nbddp.predict.split_call(pipe, ['a b', 'c d'])"),
    (SPLIT + "preds = pipe(texts, batch_size=32, truncation=True)",
     "preds = _nbddp.predict.split_call(pipe, texts, batch_size=32, truncation=True)"),
    (PIPE + "preds = pipe(df['text'].tolist(), batch_size=8)",
     "preds = _nbddp.predict.split_call(pipe, df['text'].tolist(), batch_size=8)"),
    (PIPE + "preds = pipe([t.lower() for t in texts])",
     "preds = _nbddp.predict.split_call(pipe, [t.lower() for t in texts])"),
])
def test_a_pipeline_given_a_whole_list_in_an_assignment_is_split_and_the_code_after_runs_on_rank_0(call, split):
    script = convert("import pandas as pd\ndf = pd.read_csv('test.csv')", call, "pd.DataFrame(preds).to_csv('p.csv')")
    assert script.predicts and decide_mode(script) == PREDICT and not script.warnings
    assert split in script.text
    assert "if _nbddp.on_rank0():\n    pd.DataFrame(preds).to_csv('p.csv')" in script.text
    line = call.count("\n") + 1
    (said,) = [c for c in script.changes if c.rule == "predict"]
    assert (said.cell, said.line) == (2, line) and "contiguous block" in said.message
    compile(script.text, "script.py", "exec")


KEYED = PIPE + "from transformers.pipelines.pt_utils import KeyDataset\n"


@pytest.mark.parametrize("call, split", [
    (KEYED + "preds = list(pipe(KeyDataset(ds, 'text'), batch_size=8))",
     "preds = list(_nbddp.predict.split_call(pipe, KeyDataset(ds, 'text'), batch_size=8))"),
    (KEYED + "preds = []\nfor out in tqdm(pipe(KeyDataset(ds, 'text'), batch_size=8), total=len(ds)):\n"
             "    preds.append(out['label'])",
     "for out in tqdm(_nbddp.predict.split_call(pipe, KeyDataset(ds, 'text'), batch_size=8), total=len(ds)):"),
    (SPLIT + "preds = []\nfor i, out in enumerate(pipe(texts)):\n    preds.append(out['label'])",
     "for i, out in enumerate(_nbddp.predict.split_call(pipe, texts)):"),
    (SPLIT + "with torch.no_grad():\n    preds = pipe(texts, batch_size=16)",
     "with torch.no_grad():\n    preds = _nbddp.predict.split_call(pipe, texts, batch_size=16)"),
])
def test_a_pipeline_over_a_dataset_column_or_a_loop_over_its_results_is_split(call, split):
    """The documented way to run a pipeline over a dataset (``for out in pipe(KeyDataset(ds, "text"))``), a loop
    walking a pipeline's results, a call under ``torch.no_grad()``: the call is split, every rank gets every
    result, the code after runs on rank 0."""
    script = convert("import pandas as pd\nfrom tqdm import tqdm\nds = load()", call,
                     "pd.DataFrame(preds).to_csv('p.csv')")
    assert script.predicts and decide_mode(script) == PREDICT and not script.warnings
    assert split in script.text
    assert "if _nbddp.on_rank0():\n    pd.DataFrame(preds).to_csv('p.csv')" in script.text
    (said,) = [c for c in script.changes if c.rule == "predict"]
    assert said.cell == 2 and "contiguous block" in said.message
    compile(script.text, "script.py", "exec")


BATCHED_REFUSED = {
    "not assigned": (SPLIT + "print(pipe(texts, batch_size=8))", 4, "a statement of its own"),
    "called twice": (SPLIT + "out = pipe(texts) + pipe(texts[:1])", 4, "a statement of its own"),
    "a loop writing as it goes": (SPLIT + "for out in pipe(texts):\n    open('p.txt', 'a').write(str(out))", 4,
                                  "collect the results in the loop and write the file after it"),
    "a loop writing to a file opened before it": (
        SPLIT + "fh = open('p.txt', 'w')\nfor out in pipe(texts):\n    fh.write(str(out))", 5,
        "collect the results in the loop and write the file after it"),
    "a loop printing into a file": (SPLIT + "for out in pipe(texts):\n    print(out, file=fh)", 4,
                                    "collect the results in the loop and write the file after it"),
    "samples": (SPLIT + "out = pipe(texts, do_sample=True)", 4, "draws random numbers"),
    "samples by its pipeline": ("from transformers import pipeline\n"
                                "pipe = pipeline('text-generation', do_sample=True)\nout = pipe(['a', 'b'])", 3,
                                "draws random numbers"),
    "generator": (PIPE + "out = pipe(t for t in ['a', 'b'])", 3, "give it a list"),
    "streamed dataset": (PIPE + "out = list(pipe(load_dataset('imdb', streaming=True)))", 3, "give it a list"),
    # a tokenizer's batch given to one generate call: a split would pad and compute each part at another size
    "one generate call": ("inputs = tok(prompts, return_tensors='pt', padding=True)\n"
                          "out = model.generate(**inputs, max_new_tokens=8)\nanswers = tok.batch_decode(out)", 2,
                          "this generate(…) call predicts its whole batch at once"),
    "one generate in a with": ("with torch.no_grad():\n    ids = llm.generate(input_ids=x, do_sample=False)", 2,
                               "Predict in a loop over the prompts or their batches"),
}


@pytest.mark.parametrize("case", BATCHED_REFUSED)
def test_a_batched_prediction_that_cannot_be_split_is_refused_at_its_line_saying_the_fix(case):
    source, line, said = BATCHED_REFUSED[case]
    with pytest.raises(CellError) as caught:
        convert(SETUP, source)
    assert (caught.value.cell, caught.value.line) == (2, line)
    assert said in str(caught.value) and "cannot split this prediction" in str(caught.value)


@pytest.mark.parametrize("source", [
    "for p in prompts:\n    print(tok.decode(model.generate(**tok(p, return_tensors='pt'))[0]))",  # no accumulator
    "answers = [model.generate(**tok(p, return_tensors='pt')) for p in prompts]",
    "rows = faker.generate(10)",  # not a model
])
def test_a_generate_in_a_loop_or_not_of_a_model_is_no_one_call_refusal(source):
    script = convert(SETUP, source)  # left to the job's decision (no training call found, or --every-rank)
    assert "_nbddp.predict" not in script.text


def test_one_generate_call_beside_a_split_loop_is_not_refused():
    script = convert(SETUP, "out = []\nfor x in xs:\n    out.append(model(x))",
                     "demo = model.generate(**tok('hello', return_tensors='pt'))")
    assert "_nbddp.predict.Rows(xs, out=out)" in script.text


def test_a_split_pipeline_call_is_given_whole_batches_and_one_process_just_calls_it(monkeypatch):
    from nbddp.runtime.predict import split_call

    calls = []

    def pipe(rows, **kwargs):
        calls.append((list(rows), kwargs))
        return [{"label": r} for r in rows]

    rows = [f"t{i}" for i in range(11)]
    assert split_call(pipe, rows, batch_size=4) == [{"label": r} for r in rows]  # one process: one call, whole
    assert calls == [(rows, {"batch_size": 4})]
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, block_rows in (("0", rows[:4]), ("1", rows[4:])):  # 3 batches of 4: one, then two
        monkeypatch.setenv("RANK", rank)
        calls.clear()
        assert split_call(pipe, rows, batch_size=4) == [{"label": r} for r in block_rows]  # no group: its own
        assert calls == [(block_rows, {"batch_size": 4})]


def test_a_one_row_block_is_called_as_a_list_of_rows_so_a_pipeline_unwrapping_one_row_still_gives_a_list(monkeypatch):
    from nbddp.runtime.predict import split_call

    def fill_mask(rows, **kwargs):  # as transformers' fill-mask: a list of one row gives that row's result
        out = [[{"token": r, "size": kwargs.get("batch_size")}] for r in rows]
        return out[0] if len(rows) == 1 else out

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")  # two batches of two rows, [a, b] and [c]: the second rank's block is [c]
    assert split_call(fill_mask, ["a", "b", "c"], batch_size=2) == [[{"token": "c", "size": 1}]]


def test_a_split_pipeline_call_that_draws_random_numbers_is_stopped_and_its_own_loader_draw_is_not(monkeypatch):
    import torch
    from torch.utils.data import DataLoader

    from nbddp.runtime.predict import split_call

    def loader_pipe(rows):  # a transformers pipeline iterates its rows through a DataLoader (one seed drawn)
        return [r for r in DataLoader(rows, batch_size=None)]

    def sampling_pipe(rows):
        return [r + torch.rand(3).sum().item() for r in rows]

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert split_call(loader_pipe, [1.0, 2.0, 3.0, 4.0]) == [1.0, 2.0]
    with pytest.raises(RuntimeError, match="draws random numbers"):
        split_call(sampling_pipe, [1.0, 2.0, 3.0, 4.0])


def test_a_file_written_after_a_split_loop_in_the_same_block_or_function_is_written_by_rank_0():
    script = convert(SETUP, "import json\nout = []\nwith torch.no_grad():\n    for x in xs:\n        out.append(model(x))\n"
                            "    rows = [o.tolist() for o in out]\n    json.dump(rows, open('p.json', 'w'))\n",
                     "def infer(xs, path):\n    res = []\n    for x in xs:\n        res.append(model(x).sum().item())\n"
                     "    with open(path, 'w') as fh:\n        fh.write(str(res))\n    return res\nscores = infer(xs, 's.txt')")
    text = script.text
    assert "    rows = [o.tolist() for o in out]\n    if _nbddp.on_rank0():\n        json.dump(rows, open('p.json', 'w'))" in text
    assert "    if _nbddp.on_rank0():\n        with open(path, 'w') as fh:\n            fh.write(str(res))\n    return res" in text
    compile(text, "script.py", "exec")


def test_the_blocks_losses_are_cut_where_the_trainers_own_gather_cuts_them():
    """The Trainer's gather (``gather_for_metrics``) keeps the last batch's repeated loss once per row it holds;
    ``Seq2SeqTrainer``'s (``gather``) keeps it ``eval_batch_size`` times. 7 rows in batches of 2: the blocks'
    losses, each batch's repeated twice, give one process's mean either way."""
    import functools
    from types import SimpleNamespace

    import numpy as np
    from accelerate import Accelerator

    from nbddp.runtime.trainer_rows import _cuts_the_last_batch, _whole

    accelerator = Accelerator(cpu=True)
    trainer = SimpleNamespace(gather_function=functools.partial(accelerator.gather_for_metrics, use_gather_object=False))
    assert _cuts_the_last_batch(trainer)
    trainer.gather_function = accelerator.gather
    assert not _cuts_the_last_batch(trainer)
    trainer = SimpleNamespace(compute_metrics=None, args=SimpleNamespace(logging_nan_inf_filter=True,
                                                                         include_for_metrics=[]))
    batch = np.array([2.0, 4.0, 6.0, 8.0], dtype=np.float32)  # four batches' losses, the last of one row
    every = [(None, None, np.repeat(batch[:2], 2)), (None, None, np.repeat(batch[2:], 2))]
    cut = _whole(trainer, every, "test", 7, 7).metrics["test_loss"]
    whole = _whole(trainer, every, "test", 7, None).metrics["test_loss"]
    assert cut == np.repeat(batch, 2)[:7].mean().item() and whole == np.repeat(batch, 2).mean().item() == 5.0


def test_a_real_trainers_predict_that_cannot_be_split_in_blocks_stops_before_it_predicts(monkeypatch, tmp_path):
    import sys

    import nbddp.runtime.predict  # noqa: F401  (wraps the Trainer, as the converted script's import does)
    from nbddp.runtime import dist

    sys.path.insert(0, str(Path(__file__).resolve().parent / "jobs"))
    try:
        from tiny_bert_trainer import Rows
    finally:
        sys.path.pop(0)
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    model = BertForSequenceClassification(BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=32))
    trainer = Trainer(model=model, args=TrainingArguments(str(tmp_path), per_device_eval_batch_size=4, report_to=[],
                                                          use_cpu=True, batch_eval_metrics=True))
    monkeypatch.setattr(dist, "rank_info", lambda: type("Info", (), {"world_size": 2})())
    rows = Rows()
    with pytest.raises(RuntimeError, match=r"trainer.predict\(…\) cannot split its rows.*batch_eval_metrics"):
        trainer.predict([rows[i] for i in range(6)])
    assert trainer.predict([rows[i] for i in range(8)]).predictions.shape == (8, 2)  # 4 a rank × 2: not stopped


def test_a_split_loop_runs_a_ddp_models_module_and_gives_ddp_its_forward_back():
    """On two ranks or more a split loop's rows run a DDP model's own module (DDP's forward may broadcast buffers,
    which ranks with uneven shares cannot all enter); DDP has its forward back once the loop ends or is left."""
    from torch.nn.parallel import DistributedDataParallel

    from nbddp.runtime import predict

    original = DistributedDataParallel.forward
    for _ in predict._whole_models(iter(range(2))):
        assert DistributedDataParallel.forward is predict._module_forward
    assert DistributedDataParallel.forward is original
    rows = predict._whole_models(iter(range(5)))
    next(rows)
    rows.close()  # a loop left by an error
    assert DistributedDataParallel.forward is original


def test_a_loader_sharded_for_training_gives_its_whole_dataset_to_a_prediction_loop(monkeypatch):
    """A kept job's training gave the loader a DistributedSampler (in order); a %%ddp cell's prediction loop over
    it splits every row of its dataset, not this rank's half of them."""
    import torch
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    data = TensorDataset(torch.arange(10.0))
    loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, num_replicas=2, rank=1, shuffle=False))
    assert [b[0].tolist() for b in loader] == [[1.0, 3.0, 5.0, 7.0], [9.0]]  # the rank's own half, as the training read it
    rows = Rows(loader)
    assert (rows.first, rows.end, rows.total) == (0, 3, 3)
    assert [b[0].tolist() for b in rows] == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0], [8.0, 9.0]]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    rows = Rows(loader)  # rank 1 of 2: the later block of the dataset's 3 batches
    assert (rows.first, rows.end, rows.total) == (1, 3, 3)
    assert [b[0].tolist() for b in rows] == [[4.0, 5.0, 6.0, 7.0], [8.0, 9.0]]


#: Loops whose rows are independent, each with a name bound only in a comprehension's or lambda's own scope
#: (or read there), which is no value carried from row to row, nor read after the loop.
SCOPED = {
    "generator": "answers = []\nfor x in xs:\n    out = model(x)\n    answers.append(' '.join(str(t) for t in out.tolist()))",
    "list comprehension": "answers = []\nfor x in xs:\n    answers.append([round(t, 2) for t in model(x).tolist()])",
    "dict and set": ("answers = []\nfor x in xs:\n    out = model(x).tolist()\n    d = {k: v for k, v in enumerate(out)}\n"
                     "    answers.append((d, {round(v) for v in out}))"),
    "lambda": "answers = []\nfor x in xs:\n    out = model(x).tolist()\n    answers.append(sorted(out, key=lambda t: -t))",
    "shadowing": ("answers = []\nfor x in xs:\n    out = model(x).tolist()\n    best = max(out, key=lambda t: t)\n"
                  "    t = [t for t in out if t < best]\n    answers.append(t)"),
    "walrus head": "answers = []\nfor x in xs:\n    if (out := model(x)) is not None:\n        answers.append(out)",
    "comprehension mutates its items": ("answers = []\nfor x in xs:\n    rows = [[], []]\n"
                                        "    [r.append(model(x)) for r in rows]\n    answers.append(rows)"),
}


@pytest.mark.parametrize("case", SCOPED)
def test_a_name_of_a_comprehension_or_lambda_in_a_prediction_loop_is_not_carried_from_row_to_row(case):
    script = convert(SETUP, SCOPED[case], "print(answers)")
    assert script.predicts
    header = next(line for line in script.text.splitlines() if "predict.Rows(" in line)
    assert header == "for x in (_nbddp_rows := _nbddp.predict.Rows(xs, answers=answers)):"
    compile(script.text, "script.py", "exec")


def test_a_comprehension_after_the_loop_reuses_a_loop_name_as_its_own_and_reads_nothing_of_the_last_row():
    # [x for x in …] after the loop binds its own x; in a function the same, and a generator in its loop's rows
    after = convert(SETUP, "out = []\nfor x in xs:\n    out.append(model(x))", "print([x.shape for x in out])")
    assert after.predicts
    inside = convert(SETUP, "def run(xs):\n    out = []\n    for x in xs:\n        out.append(model(x))\n"
                            "    return [x.sum() for x in out], sorted(out, key=lambda x: x.sum())", "res = run(xs)")
    assert inside.predicts
    in_function = convert(SETUP, "def run(xs):\n    answers = []\n    for x in xs:\n        out = model(x)\n"
                                 "        answers.append(' '.join(str(t) for t in out.tolist()))\n    return answers",
                          "res = run(xs)")
    assert "for x in (_nbddp_rows := _nbddp.predict.Rows(xs, answers=answers)):" in in_function.text


#: Still refused: a walrus in a comprehension binds in the loop's own scope, so it carries; a name bound in the
#: loop read in a comprehension or lambda after it reads the last row's; a comprehension's name shadowing an
#: outer one does not hide a write into that outer one.
STILL_REFUSED = {
    "walrus in a comprehension": ("total = 0\nout = []\nfor x in xs:\n"
                                  "    out.append([(total := total + t) for t in model(x).tolist()])",
                                  "total carries a value from one row to the next"),
    "read in a later comprehension": ("out = []\nfor x in xs:\n    y = model(x)\n    out.append(y)\n"
                                      "print([y + t for t in out])", "y is read after the loop"),
    "read in a later lambda": ("def run(xs):\n    out = []\n    for x in xs:\n        y = model(x)\n"
                               "        out.append(y)\n    return sorted(out, key=lambda t: (t - y).sum())\nres = run(xs)",
                               "y is read after the loop"),
    "outer name written": ("t = {}\nout = []\nfor x in xs:\n    out.append([t for t in model(x).tolist()])\n"
                           "    t['last'] = 1", "it writes into t['last']"),
}


@pytest.mark.parametrize("case", STILL_REFUSED)
def test_a_name_a_comprehension_binds_in_the_loops_scope_or_reads_from_it_is_still_refused(case):
    source, said = STILL_REFUSED[case]
    with pytest.raises(CellError) as caught:
        convert(SETUP, source)
    assert said in str(caught.value) and "cannot split this prediction loop" in str(caught.value)


def test_a_kept_cells_loop_gives_every_rank_its_own_names_not_a_comprehensions(tmp_path):
    # settle() sends the names the loop binds from the last row's rank; a generator's t is bound nowhere after it
    from nbddp.kept.cell import convert_kept_cell

    history = [Cell(1, "import torch\nmodel = torch.nn.Linear(4, 3)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                       "xs = list(torch.randn(5, 4))"),
               Cell(2, "for _ in range(3):\n    loss = model(torch.randn(8, 4)).pow(2).mean()\n"
                       "    opt.zero_grad()\n    loss.backward()\n    opt.step()")]
    source = "answers = []\nfor x in xs:\n    out = model(x)\n    answers.append(' '.join(str(t) for t in out.tolist()))"
    code = convert_kept_cell(source, history, tmp_path, 1).code
    assert "_nbddp_rows.settle(globals(), 'out', 'x')" in code


def tiny_zero_shot():
    """A zero-shot classification pipeline (a ``ChunkPipeline``: a chunk per row and label) over a tiny NLI model."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast, pipeline

    words = "the a movie good bad great plot is not this example about sports politics".split()
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]"] + words)}
    wordlevel = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    wordlevel.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=wordlevel, unk_token="[UNK]", pad_token="[PAD]",
                                        cls_token="[CLS]", sep_token="[SEP]")
    torch.manual_seed(0)
    labels = {0: "entailment", 1: "neutral", 2: "contradiction"}
    model = BertForSequenceClassification(BertConfig(
        vocab_size=len(vocab), hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        num_labels=3, id2label=labels, label2id={v: k for k, v in labels.items()})).eval()
    return pipeline("zero-shot-classification", model=model, tokenizer=tokenizer, device=-1)


def test_a_chunking_pipeline_batching_chunks_of_several_rows_is_called_whole_and_split_with_one_chunk_a_batch(
        monkeypatch, capsys):
    """A ``ChunkPipeline`` batches the chunks of neighbouring rows together: split over the ranks, a block's rows
    would be computed in other batches than one process's. With batches of one chunk it splits as any."""
    from nbddp.runtime import predict, rank

    pipe = tiny_zero_shot()
    texts = ["the movie is good", "a plot about sports", "not this", "politics is bad", "great example"]
    labels = ["sports", "politics"]
    whole = pipe(texts, candidate_labels=labels, batch_size=3)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(rank, "_said", set())  # said once a process: not yet in this one
    assert predict.split_call(pipe, texts, candidate_labels=labels, batch_size=3) == whole  # every row, here too
    assert "every rank runs this call whole" in capsys.readouterr().out
    one = predict.split_call(pipe, texts, candidate_labels=labels, batch_size=1)  # no group: this rank's block
    assert one == pipe(texts[:2], candidate_labels=labels, batch_size=1)  # 5 batches: two, then three


def test_a_split_pipeline_call_over_a_dataset_column_gives_each_rank_a_subset_of_whole_batches(monkeypatch):
    """``pipe(KeyDataset(ds, "text"))`` over a ``datasets.Dataset``: one process's call as it is (an iterator, as
    a pipeline over a dataset returns); a rank's call gets a ``Subset`` of its block and its results as a list."""
    import datasets
    from torch.utils.data import Dataset, Subset
    from transformers.pipelines.pt_utils import KeyDataset

    from nbddp.runtime.predict import split_call

    seen = []

    def pipe(rows, **kwargs):  # a pipeline over a dataset: results one by one
        seen.append(rows)
        assert isinstance(rows, Dataset)
        return iter([{"label": rows[i].upper()} for i in range(len(rows))])

    texts = [f"t{i}" for i in range(11)]
    column = KeyDataset(datasets.Dataset.from_dict({"text": texts}), "text")
    whole = split_call(pipe, column, batch_size=4)
    assert not isinstance(whole, list) and [r["label"] for r in whole] == [t.upper() for t in texts]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")  # 3 batches of 4: the first rank one, the second two
    assert split_call(pipe, column, batch_size=4) == [{"label": t.upper()} for t in texts[4:]]  # no group: its own
    assert isinstance(seen[-1], Subset) and list(seen[-1].indices) == list(range(4, 11))


@given(st.integers(0, 5000), st.integers(1, 16))
def test_handed_out_chunks_cover_the_rows_once_in_order_and_end_in_single_rows(total, world):
    chunks = handed_chunks(total, world)
    assert [c for first, end in chunks for c in range(first, end)] == list(range(total))
    assert all(end > first for first, end in chunks)
    sizes = [end - first for first, end in chunks]
    assert sizes == sorted(sizes, reverse=True) and (not sizes or sizes[-1] == 1)
    assert len(chunks) <= 2 * world * (1 + math.log(total + 1)) + world  # few hand-outs: about 2·world·ln(rows)



def _last_display(file) -> str:
    return file.getvalue().replace("\r", "\n").strip().splitlines()[-1]


@pytest.mark.parametrize("rank, world, shown", [(0, 2, "predicting (rank 0's share): 100%"),
                                                (1, 2, "predicting (rank 1's share): 100%"), (0, 1, "predicting: 100%")])
def test_a_progress_bar_the_loop_iterates_for_the_notebook_counts_this_ranks_rows_to_the_end(monkeypatch, rank, world,
                                                                                          shown):
    # it stood at 0 % before: the loop iterated the rows the bar wraps, never the bar
    import io

    from tqdm.auto import tqdm

    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", str(rank))
    file, out = io.StringIO(), []
    bar = tqdm(list(range(41)), total=41, desc="predicting", file=file, mininterval=0)
    rows = Rows(bar, 0, out=out)  # enumerate(tqdm(rows, total=len(df))): the loop iterates the rows, not the bar
    for i, x in rows:
        out.append(x)
    share = rows.end - rows.first
    assert (bar.n, bar.total) == (share, share) and share == (41 if world == 1 else 20 + rank)
    assert _last_display(file).startswith(shown) and f"{share}/{share}" in _last_display(file)


def test_a_progress_bar_around_the_loop_is_given_this_ranks_share_as_its_total(monkeypatch):
    import io

    from tqdm.auto import tqdm

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    file, out = io.StringIO(), []
    rows = Rows(list(range(40)), out=out)
    for x in tqdm(rows, total=40, file=file, mininterval=0):  # tqdm(Rows(df.iterrows()), total=len(df))
        out.append(x)
    assert _last_display(file).startswith("rank 0's share: 100%") and "20/20" in _last_display(file)


def test_a_sum_made_anew_in_each_row_and_grown_in_an_inner_loop_is_the_rows_own():
    # test-time augmentation (a public Kaggle notebook's valid_epoch): logits = zeros(…) in each row, then
    # logits += preds / n over the flips; it was refused as "logits carries a value from one row to the next"
    script = convert(SETUP, "probs = []\nfor (x,) in test_loader:\n    logits = torch.zeros(len(x), 3)\n"
                            "    for k in range(2):\n        logits += model(x * (1 - 2 * k)) / 2\n"
                            "    probs.append(logits.softmax(-1))")
    assert "_nbddp.predict.Rows(test_loader, probs=probs)" in script.text and script.text.count("Rows(") == 1


def test_a_loop_that_builds_loads_and_keeps_models_is_no_prediction_and_the_loop_running_them_is_split():
    # a public Kaggle submission notebook (BirdCLEF): its fold checkpoints loaded in a loop were split as rows and
    # the models gathered; the runtime then stopped it, blaming the models' random init for "sampling"
    load = ("class BirdModel(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            "        self.fc = torch.nn.Linear(4, 3)\n    def forward(self, x):\n        return self.fc(x)\n"
            "models = []\nfor path in ['a.pt', 'b.pt']:\n    model = BirdModel()\n"
            "    model.load_state_dict(torch.load(path))\n    model.eval()\n    models.append(model.to('cpu'))")
    script = convert(SETUP, load, "preds = []\nfor (x,) in test_loader:\n    preds.append(model(x))")
    assert script.text.count("Rows(") == 1 and "_nbddp.predict.Rows(test_loader, preds=preds)" in script.text


@pytest.mark.parametrize("loop, line, written", [
    ("preds = np.zeros((9, 3))\nfor b, (x,) in enumerate(test_loader):\n    out = model(x)\n"
     "    preds[b * 2:(b + 1) * 2] = out.detach().numpy()", 2, "preds[b * 2:(b + 1) * 2]"),
    ("def infer(df):\n    for fold in range(2):\n        for i, (x,) in enumerate(test_loader):\n"
     "            df.loc[i, 'p'] = model(x).sum().item()\ninfer(frame)", 3, "df.loc[i, 'p']"),
])
def test_a_notebook_whose_prediction_writes_rows_into_what_it_made_before_is_refused_at_that_loop(loop, line,
                                                                                                   written):
    # public Kaggle inference notebooks (a preallocated array filled by batch slices; test.loc[i, …] = … in a
    # function): refused as "no training call found … pass --every-rank" before, which predicts every row twice
    with pytest.raises(CellError) as caught:
        convert(SETUP + "\nimport numpy as np", loop)
    error = caught.value
    assert (error.cell, error.line) == (2, line) and f"it writes into {written} row by row" in str(error)


def test_a_file_written_in_a_loop_after_a_call_that_splits_its_rows_is_written_by_rank_0():
    # a public Kaggle feature-extraction notebook: for each patient, features = extract(pid, model) (a function
    # whose loader loop is split), then torch.save(features, path): every rank wrote the same file at once before
    script = convert(SETUP, "import os\ndef extract(x):\n    out = []\n    for (b,) in test_loader:\n"
                            "        out.append(model(b + x))\n    return torch.cat(out)",
                     "for pid in range(3):\n    path = f'{pid}.pt'\n    if not os.path.exists(path):\n"
                     "        feats = extract(pid)\n        if feats is not None:\n            torch.save(feats, path)\n"
                     "            print(pid)")
    text = script.text
    assert ("        if feats is not None:\n            if _nbddp.on_rank0():\n                torch.save(feats, path)\n"
            "            print(pid)") in text
    assert "if _nbddp.on_rank0():\n        feats" not in text  # the call itself stays on every rank
    compile(text, "script.py", "exec")


@pytest.mark.parametrize("call, runs", [("model(x)", True), ("model.get_image_features(x)", True),
                                        ("model.encode(x)", True), ("BirdModel()", False),
                                        ("timm.create_model('nfnet')", False), ("model.load_state_dict(s)", False),
                                        ("models.append(m)", False), ("net.to(device)", False)])
def test_what_runs_a_model_and_what_only_builds_loads_or_keeps_one(call, runs):
    import ast

    from nbddp.convert.facts.predicts import _calls_a_model

    assert _calls_a_model(ast.parse(call).body[0].value) is runs
