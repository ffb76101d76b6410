"""``nbddp run``'s terminal view shows each tqdm frame once (issue 29): the Trainer logs through ``tqdm.write``,
which clears the bar and draws it again as it was, and a file, pipe or log viewer showed every frame twice.
The streams are made by real tqdm bars, as a rank writes them into its two log files."""

import io
import re
import sys

import tqdm

from nbddp.display import TerminalView
from nbddp.display.stream import Redraws


class Tty(io.StringIO):
    def isatty(self):
        return True


def trainer_like_streams(steps: int, chunk: int | None = None) -> list[tuple[str, str]]:
    """(stream, text) as rank 0's two log files grow during a loop whose bar is on stderr and which logs a
    dict through ``tqdm.write`` at every step, as the Trainer's progress callback does; ``chunk`` cuts the
    text in pieces of that many characters (the launcher reads whatever the files hold)."""
    out, err = io.StringIO(), io.StringIO()
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err  # tqdm.write clears bars when both are the process's stdout/stderr
    seen = {"stdout": 0, "stderr": 0}
    chunks = []

    def grown():
        for name, buf in (("stderr", err), ("stdout", out)):
            text = buf.getvalue()[seen[name]:]
            seen[name] += len(text)
            step = chunk or len(text) or 1
            chunks.extend((name, text[i:i + step]) for i in range(0, len(text), step))

    clock = [1000.0]
    try:
        bar = tqdm.tqdm(total=steps, file=sys.stderr, mininterval=0, ascii=True, delay=0)
        bar._time = lambda: clock[0]  # a step takes 2 s, the log right after it 10 ms, as in a Trainer
        bar.start_t = bar.last_print_t = clock[0]
        for step in range(1, steps + 1):
            clock[0] += 2.0
            bar.update(1)
            grown()
            clock[0] += 0.01
            tqdm.tqdm.write(str({"loss": 3.0 - step / 10, "epoch": step / 10}))
            grown()
        bar.close()
        grown()
    finally:
        sys.stdout, sys.stderr = saved
    return chunks


def frames(text: str) -> list[str]:
    """Every redraw and line of a text, as a log viewer that breaks lines at \\r shows them."""
    return [f for f in re.split(r"[\r\n]", re.sub(r"\x1b\[K", "", text)) if f.strip()]


def screen(text: str) -> list[str]:
    """What a terminal shows after ``text``: \\r goes back to the line's start, ESC[K clears to its end."""
    lines, col = [[]], 0
    for token in re.findall(r"\x1b\[K|[\r\n]|[^\r\n\x1b]", text):
        line = lines[-1]
        if token == "\r":
            col = 0
        elif token == "\n":
            lines.append([])
            col = 0
        elif token == "\x1b[K":
            del line[col:]
        else:
            line[col:col + 1] = [token]
            col += 1
    return ["".join(line).rstrip() for line in lines if "".join(line).strip()]


def metrics(step: int) -> dict:
    return {"event": "log", "step": step, "max_steps": 5, "time": float(step), "loss": 3.0 - step / 10}


def run_view(out, chunks, with_metrics: bool = True) -> None:
    view = TerminalView(out, out)
    step = 0
    for stream, text in chunks:
        view.sink(stream, text)
        if with_metrics and stream == "stdout" and text.endswith("\n"):  # the dict's line ended: its event came
            step += 1
            view.on_metrics(metrics(step))

    class Ended:
        failure = None

    view.finish(Ended())


def test_the_raw_streams_hold_every_frame_twice_which_the_view_shows_once():
    chunks = trainer_like_streams(5)
    raw_err = "".join(t for s, t in chunks if s == "stderr")
    assert sum(" 3/5 " in f for f in frames(raw_err)) == 2  # tqdm's own stream: the frame, then the refresh
    out = io.StringIO()  # a file or a pipe: every frame is in it
    run_view(out, chunks)
    shown = frames(out.getvalue())
    for step in range(1, 6):
        assert sum(f" {step}/5 " in f for f in shown) == 1, (step, shown)
    assert [f.split()[0] for f in shown if re.fullmatch(r"\s+\d+\s+[\d.]+", f)] == ["1", "2", "3", "4", "5"]
    assert not any(f.isspace() for f in re.split(r"[\r\n]", out.getvalue()) if f)  # no clearing line of spaces

    tty = Tty()  # a terminal: what stays on the screen
    run_view(tty, chunks)
    shown = screen(tty.getvalue())
    assert [f.split()[0] for f in shown if re.fullmatch(r"\s+\d+\s+[\d.]+", f)] == ["1", "2", "3", "4", "5"]
    assert [f for f in shown if "/5 " in f] == [f for f in frames(raw_err) if " 5/5 " in f][:1]  # the last bar, once


def test_frames_cut_anywhere_by_the_reads_are_still_shown_once_and_whole():
    chunks = trainer_like_streams(5, chunk=3)
    out = io.StringIO()
    run_view(out, chunks, with_metrics=False)
    shown = frames(out.getvalue())
    assert [f for f in shown if "/5 " in f and f.strip().startswith(("20%", "40%", "60%", "80%"))] == \
        [f for f in frames("".join(t for s, t in trainer_like_streams(5) if s == "stderr"))
         if "/5 " in f and f.strip().startswith(("20%", "40%", "60%", "80%"))][::2]
    assert sum("5/5" in f for f in shown) == 1


def test_a_clearing_before_something_new_is_kept_and_a_cleared_terminal_bar_is_drawn_again():
    r = Redraws()
    assert r.feed("\r 10%|#   | 1/10") == "\r 10%|#   | 1/10"
    assert r.feed("\r" + " " * 16) == ""  # may be tqdm.write's clearing: known by what follows
    assert r.feed("\rhi\n") == "\r" + " " * 16 + "\rhi\n"  # a shorter text over the bar needs the clearing
    r.feed("\r 20%|##  | 2/10")
    r.forget()  # the terminal view cleared the line
    assert r.feed("\r 20%|##  | 2/10") == "\r 20%|##  | 2/10"
    assert r.feed("\r 30%") == "\r 30%" and r.flush() == ""
    assert r.feed("\r") == "" and r.feed("\nnext\n") == "\nnext\n"  # "\r\n" cut in two is one line end
