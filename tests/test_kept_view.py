"""What a %%ddp cell shows, fed as the kernel feeds it: rank 0's text, then the Trainer's events."""

from __future__ import annotations

from test_display_bounded import Capture, Cell_, Clock

from nbddp.kept.view import CellView

FIRST_FRAME = "\r  0%|          | 0/30 [00:00<?, ?it/s]"
BEGIN = {"event": "begin", "step": 0, "max_steps": 30, "epoch": 0, "time": 0.0, "output_dir": "/tmp/out"}


def view(tmp_path, monkeypatch):
    cell, clock = Cell_(), Clock()
    monkeypatch.setattr("sys.stdout", Capture(cell, "stdout"))
    monkeypatch.setattr("sys.stderr", Capture(cell, "stderr"))
    return cell, clock, CellView(2, tmp_path, show=cell.show, clock=clock)


def test_the_bars_first_frame_before_the_first_event_goes_into_the_panel_not_above_it(tmp_path, monkeypatch):
    # seen in JupyterLab: a second trainer.train() in a %%ddp cell left a stale "0%" bar above its panel
    cell, clock, v = view(tmp_path, monkeypatch)
    v.sink("stdout", "before training\n")
    v.sink("stderr", FIRST_FRAME)
    clock.now = 0.05
    v.poll()
    v.on_metrics(BEGIN)
    text = [o for o in cell.outputs if o["output_type"] == "stream"]
    assert text == [{"output_type": "stream", "name": "stdout", "text": "before training\n"}]
    assert any("0/30" in line for line in v.panel.log.lines()), v.panel.log.lines()


def test_a_bar_outside_training_still_shows_while_it_runs(tmp_path, monkeypatch):
    cell, clock, v = view(tmp_path, monkeypatch)
    v.sink("stderr", FIRST_FRAME)
    assert not cell.outputs  # held a moment: a training's first event may be on its way
    clock.now = 1.0
    v.poll()
    assert cell.outputs == [{"output_type": "stream", "name": "stderr", "text": FIRST_FRAME}]
    assert v.panel is None


def test_the_persons_own_lines_stay_in_view_after_a_librarys_many_finished_bars():
    """Seen with TRL: eleven dataset-preparation bars after print_trainable_parameters() pushed it out of the
    last 12 lines the finished cell kept."""
    from nbddp.display.stream import RankLog

    log = RankLog(12)
    log.feed("stdout", "trainable params: 1,081,344 || all params: 495,114,112 || trainable%: 0.2184\n")
    for name in ["Converting train dataset to ChatML", "Applying chat template", "Tokenizing train dataset",
                 "Truncating train dataset"] * 3:
        log.feed("stderr", f"\r{name}:   0%|          | 0/1024 [00:00<?, ? examples/s]"
                           f"\r{name}: 100%|██████████| 1024/1024 [00:00<00:00, 9000.00 examples/s]\n")
    log.feed("stdout", "my own line after the bars\n")
    shown = log.lines()
    assert shown[0].startswith("trainable params: 1,081,344"), shown
    assert shown[-1] == "my own line after the bars"
    assert sum("100%|" in line for line in shown) == 1  # the newest bar alone
    for i in range(20):  # the person's lines still scroll as lines do
        log.feed("stdout", f"step line {i}\n")
    assert log.lines()[-12:] == [f"step line {i}" for i in range(8, 20)]
