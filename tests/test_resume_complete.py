"""``--resume`` takes a checkpoint only when every rank's files are in it: a run killed while rank 1 wrote
its RNG state leaves ``trainer_state.json`` (rank 0's) beside a temporary file, not ``rng_state_1.pth``."""

from nbddp.runtime.resume import last_complete_checkpoint


def checkpoint(root, step, *files):
    d = root / f"checkpoint-{step}"
    d.mkdir()
    for name in ("trainer_state.json", "model.safetensors", *files):
        (d / name).write_text("x")
    return d


def test_a_checkpoint_missing_a_ranks_rng_state_is_passed_over(tmp_path):
    checkpoint(tmp_path, 5, "rng_state_0.pth", "rng_state_1.pth")
    checkpoint(tmp_path, 10, "rng_state_0.pth", ".rng_state_1.pth.k2j4x8")  # rank 1 killed mid-write
    assert last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-5")


def test_a_gap_in_the_ranks_is_incomplete(tmp_path):
    checkpoint(tmp_path, 5, "rng_state_0.pth", "rng_state_1.pth", "rng_state_2.pth")
    checkpoint(tmp_path, 10, "rng_state_0.pth", "rng_state_2.pth")
    checkpoint(tmp_path, 15, "rng_state_0.pth")  # per-rank names mean two ranks at least
    assert last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-5")


def test_any_file_cut_short_makes_it_incomplete(tmp_path):
    checkpoint(tmp_path, 5, "rng_state_0.pth", "rng_state_1.pth")
    checkpoint(tmp_path, 10, "rng_state_0.pth", "rng_state_1.pth", ".optimizer.pt.a8d7f1")
    assert last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-5")


def test_single_process_and_model_only_checkpoints_stay_complete(tmp_path):
    checkpoint(tmp_path, 5, "rng_state.pth")
    assert last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-5")
    checkpoint(tmp_path, 10)  # save_only_model: no RNG state at all
    assert last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-10")
    checkpoint(tmp_path, 15, "rng_state_0.pth", "rng_state_1.pth", ".gitignore")  # a dotfile that is no temp file
    assert last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-15")
