"""A model trained through an optimizer over one of its parts (``Adam(model.mask_decoder.parameters())``, as SAM
fine-tuning does) is wrapped in DDP whole, and ``--explain`` says so; where the training calls that part itself and
never the model (SAM's own scripts), the part is what DDP wraps. On two gloo ranks the replicas stay in sync."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nbddp.cells import Cell
from nbddp.convert.script import convert_cells

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from conftest import write_notebook  # noqa: E402
from test_runnable_corpus import RUNNABLE, environment, files, records, run  # noqa: E402

#: SAM's fine-tuning in small: the encoder frozen, the optimizer over the mask decoder alone.
CELLS = [
    """\
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    torch.manual_seed(0)
    """,
    """\
    class Seg(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = nn.Linear(8, 16)
            self.mask_decoder = nn.Sequential(nn.ReLU(), nn.Linear(16, 1))
        def forward(self, x):
            return self.mask_decoder(self.encoder(x))
    model = Seg()
    for name, param in model.named_parameters():
        if name.startswith("encoder"):
            param.requires_grad_(False)
    """,
    """\
    x = torch.randn(64, 8)
    y = (x.sum(1, keepdim=True) > 0).float()
    train_dataloader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    """,
    """\
    optimizer = torch.optim.Adam(model.mask_decoder.parameters(), lr=1e-2)
    loss_fn = nn.BCEWithLogitsLoss()
    """,
    """\
    for epoch in range(3):
        for xb, yb in train_dataloader:
            loss = loss_fn(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        print(epoch, loss.item())
    """,
    'torch.save(model.mask_decoder.state_dict(), "decoder.pt")\n',
]


def _folder(path: Path) -> Path:
    path.mkdir()
    return path / "sam_like.ipynb"


def convert(cells):
    return convert_cells([Cell(i, textwrap.dedent(c)) for i, c in enumerate(cells, start=1)])


def test_the_model_whose_part_an_optimizer_gets_is_wrapped_and_explained():
    script = convert(CELLS)
    assert "model = _nbddp.ddp(model)" in script.text
    wraps = [c for c in script.changes if c.rule == "ddp_wrap"]
    assert [(c.cell, c.line) for c in wraps] == [(2, 9)], script.changes
    assert "mask_decoder" in wraps[0].message, wraps[0].message
    # the saved part comes from the plain model, not the wrapper
    assert "_nbddp.unwrap(model)" in script.text


def test_an_optimizer_over_a_part_reached_by_index_or_attribute_chain_wraps_the_model():
    cells = list(CELLS)
    cells[3] = "optimizer = torch.optim.SGD(params=model.mask_decoder[1].parameters(), lr=0.1)\n"
    assert "model = _nbddp.ddp(model)" in convert(cells).text


def _one_process_and_two_ranks(tmp_path, single, ranks):
    """Run the notebook as one process and with ``nbddp run --nproc 2``; check that the one process saw every
    sample in each of 3 epochs, the two ranks shared them and stepped in sync (12 steps each). Returns the
    records of the one process and of ranks 0 and 1."""
    run([sys.executable, str(RUNNABLE / "run_cells.py"), str(single)],
        environment(tmp_path / "rec-single", single.parent, NBDDP_TEST_RECORD_AS="single"), tmp_path / "single.log")
    run([sys.executable, "-m", "nbddp.cli", "run", str(ranks), "--nproc", "2", "--runs-dir", str(tmp_path / "runs"),
         "--timeout", "300"], environment(tmp_path / "rec-ranks", ranks.parent), tmp_path / "ranks.log")
    one, two = records(tmp_path / "rec-single")["single"], records(tmp_path / "rec-ranks")
    r0, r1 = two["0"], two["1"]
    epochs = [sorted(p["indices"]) for p in one["passes"] if p["size"] == 64 and p["steps"]]
    assert epochs == [list(range(64))] * 3
    a = [p["indices"] for p in r0["passes"] if p["size"] == 64 and p["steps"]]
    b = [p["indices"] for p in r1["passes"] if p["size"] == 64 and p["steps"]]
    assert len(a) == len(b) == 3 and all(sorted(x + y) == list(range(64)) for x, y in zip(a, b))
    stepped = [(o["steps"], o["hash"]) for o in r0["optimizers"] if o["steps"]]
    assert stepped and stepped == [(o["steps"], o["hash"]) for o in r1["optimizers"] if o["steps"]]
    assert stepped[0][0] == 12  # 3 epochs of 32 samples per rank in batches of 8
    return one, r0, r1


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_two_ranks_train_the_part_in_sync_and_share_the_data(tmp_path):
    single, ranks = (write_notebook(_folder(tmp_path / d), [textwrap.dedent(c) for c in CELLS])
                     for d in ("single", "ranks"))
    one, r0, r1 = _one_process_and_two_ranks(tmp_path, single, ranks)
    assert files(r0) == files(one) == {"decoder.pt"} and not files(r1)


#: SAM's own repository's style: the parts called one by one, the model itself never (``sam_model(…)``); the
#: encoder under ``no_grad``, its weights left trainable, as SAM's fine-tuning scripts leave them.
DIRECT = CELLS[:1] + [
    """\
    class Seg(nn.Module):
        def __init__(self):
            super().__init__()
            self.image_encoder = nn.Linear(8, 16)
            self.mask_decoder = nn.Sequential(nn.ReLU(), nn.Linear(16, 1))
    sam_model = Seg()
    """,
    CELLS[2],
    "optimizer = torch.optim.Adam(sam_model.mask_decoder.parameters(), lr=1e-2)\nloss_fn = nn.BCEWithLogitsLoss()\n",
    """\
    for epoch in range(3):
        for xb, yb in train_dataloader:
            with torch.no_grad():
                emb = sam_model.image_encoder(xb)
            loss = loss_fn(sam_model.mask_decoder(emb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    """,
    'torch.save(sam_model.state_dict(), "model.pt")\ntorch.save(sam_model.mask_decoder.state_dict(), "decoder.pt")\n',
]


def _lines(script, rule):
    return [(c.cell, c.line) for c in script.changes if c.rule == rule]


def test_a_part_the_training_calls_itself_is_what_ddp_wraps_and_its_calls_go_through_the_wrapper():
    script = convert(DIRECT + ["with torch.no_grad():\n    check = sam_model.mask_decoder(sam_model.image_encoder(x))\n"])
    text = script.text
    assert "sam_model = Seg()\nsam_model_mask_decoder_ddp = _nbddp.ddp(sam_model.mask_decoder)\n" in text
    assert "loss = loss_fn(sam_model_mask_decoder_ddp(emb), yb)" in text
    assert "emb = sam_model.image_encoder(xb)" in text  # the frozen part is not the optimizer's: called as written
    assert "_nbddp.ddp(sam_model)" not in text and "_nbddp.unwrap(sam_model)" not in text
    # saves read the model's own keys; rank 0's forward after training stays plain (a DDP forward would wait)
    assert 'torch.save(sam_model.state_dict(), "model.pt")' in text
    assert "check = sam_model.mask_decoder(sam_model.image_encoder(x))" in text
    assert _lines(script, "ddp_wrap") == [(2, 6), (5, 5)], script.changes
    wrap = next(c.message for c in script.changes if c.rule == "ddp_wrap")
    assert "sam_model.mask_decoder wrapped in DistributedDataParallel as sam_model_mask_decoder_ddp" in wrap
    assert "never sam_model(…)" in wrap and "state dict" in wrap and "find_unused_parameters=True" in wrap


def test_the_part_called_in_functions_the_training_calls_goes_through_the_wrapper():
    cells = list(DIRECT)
    cells[4] = textwrap.dedent("""\
        def decode(emb):
            return sam_model.mask_decoder(emb)
        def step(xb, yb):
            with torch.no_grad():
                emb = sam_model.image_encoder(xb)
            loss = loss_fn(decode(emb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        def preview(xb):
            return sam_model.mask_decoder(sam_model.image_encoder(xb))
        for epoch in range(3):
            for xb, yb in train_dataloader:
                step(xb, yb)
        """)
    text = convert(cells).text
    assert "return sam_model_mask_decoder_ddp(emb)" in text
    assert "return sam_model.mask_decoder(sam_model.image_encoder(xb))" in text  # not called by the training


@pytest.mark.parametrize("step", [
    "loss = loss_fn(sam_model(xb), yb) + loss_fn(sam_model.mask_decoder(emb), yb)",  # the model called too
    "loss = train_step(sam_model, emb, yb)",  # handed on: what the function calls is not known by name
    "loss = loss_fn(sam_model.mask_decoder[1](sam_model.mask_decoder(emb)), yb)",  # inside the part, past it
], ids=["model-called", "handed-on", "inside-the-part"])
def test_where_the_training_may_run_the_part_past_its_wrapper_the_model_is_wrapped_whole(step):
    cells = list(DIRECT)
    cells[4] = cells[4].replace("loss = loss_fn(sam_model.mask_decoder(emb), yb)", step)
    assert step in cells[4]
    text = convert(cells).text
    assert "sam_model = _nbddp.ddp(sam_model)" in text and "sam_model_mask_decoder_ddp" not in text


def test_the_wrappers_name_is_one_the_notebook_does_not_use():
    cells = list(DIRECT)
    cells[2] += "sam_model_mask_decoder_ddp = None\n"
    text = convert(cells).text
    assert "sam_model_mask_decoder_ddp_ = _nbddp.ddp(sam_model.mask_decoder)" in text
    assert "loss_fn(sam_model_mask_decoder_ddp_(emb), yb)" in text


def test_a_public_sam_notebook_in_its_own_style_gets_its_mask_decoder_wrapped():
    """Encord's SAM fine-tuning (``tests/corpus/public``), which main's wrap of the whole model stopped at step 1."""
    from nbddp.convert import convert_notebook

    script = convert_notebook(ROOT / "tests/corpus/public/encord/Encord_Notebooks_How_To_Fine_Tuning_SAM.ipynb")
    assert "sam_model.to(device)\nsam_model_mask_decoder_ddp = _nbddp.ddp(sam_model.mask_decoder)\n" in script.text
    assert "low_res_masks, iou_predictions = sam_model_mask_decoder_ddp(" in script.text
    assert "_nbddp.ddp(sam_model)" not in script.text
    assert _lines(script, "ddp_wrap") == [(30, 3), (37, 31)]


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_parts_called_directly_train_in_sync_on_two_ranks(tmp_path):
    """The training calls ``sam_model.mask_decoder(…)`` and never ``sam_model(…)``: the part is what DDP wraps,
    so its gradients are averaged, the ranks share the data and end with the same weights, and the saved
    state dicts have the plain model's keys (before, the replica guard stopped the job at step 1)."""
    single, ranks = (write_notebook(_folder(tmp_path / d), [textwrap.dedent(c) for c in DIRECT])
                     for d in ("single", "ranks"))
    one, r0, r1 = _one_process_and_two_ranks(tmp_path, single, ranks)
    assert files(r0) == files(one) == {"model.pt", "decoder.pt"} and not files(r1)
    import torch

    for name in ("model.pt", "decoder.pt"):  # the wrap left the model's own keys alone
        saved = [torch.load(folder.parent / name) for folder in (single, ranks)]
        assert list(saved[0]) == list(saved[1]), name


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_parts_called_past_a_whole_model_wrapper_stop_the_job_at_the_first_step_never_train_apart(tmp_path):
    """The model handed to a step function, which calls its parts: nbddp cannot see by name what runs, so it
    wraps the model whole, and that wrapper never runs; the replica check must not trust it (before it, the
    copies drifted silently)."""
    cells = list(DIRECT)
    cells[4] = textwrap.dedent("""\
        def step(m, xb, yb):
            with torch.no_grad():
                emb = m.image_encoder(xb)
            return loss_fn(m.mask_decoder(emb), yb)
        for epoch in range(3):
            for xb, yb in train_dataloader:
                loss = step(sam_model, xb, yb)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        """)
    assert "sam_model = _nbddp.ddp(sam_model)" in convert(cells).text
    path = write_notebook(_folder(tmp_path / "handed"), cells)
    done = subprocess.run([sys.executable, "-m", "nbddp.cli", "run", str(path), "--nproc", "2",
                           "--runs-dir", str(tmp_path / "runs"), "--timeout", "200"],
                          capture_output=True, text=True, timeout=280)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out[-3000:]
    assert "diverged after optimizer step 1 (cell 5, line 10)" in out and "calls its parts directly" in out, out[-3000:]
