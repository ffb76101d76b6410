"""Write the runnable copies of public notebooks whose training is a command they launch:
``python tests/corpus/runnable/make_launched.py``.

As ``make_runnable.py`` (whose ``runnable()`` writes them, with the same ``# nbddp-offline:`` marks and
``nbddp-skip`` tags), into ``launched/``: these run in launched mode (``nbddp.launched``), their cells once and
the command on every rank, so ``tests/test_runnable_launched.py`` holds them to other promises than
``tests/test_runnable_corpus.py``'s. ``launched/MANIFEST.json`` names each copy's original, the stand-ins
(``tiny.py``, ``tiny_launched.py``: the scripts and recipes its shell lines run, edited there) and the files
its prep and post cells write.
"""

from __future__ import annotations

import json
from pathlib import Path

import nbformat

import tiny_launched  # noqa: F401  (adds its builders to tiny.BUILDERS)
from make_runnable import MARK, runnable

HERE = Path(__file__).resolve().parent / "launched"

NOTEBOOKS = {
    # issue 28: `!python scripts/run_sft.py --config receipes/llama-3-1-8b-qlora.yaml` after a data-prep cell
    # writing train_dataset.json, then `!python scripts/merge_adapter_weights.py` on the adapter it saved
    "sft_script_fine_tune_llms_2025": {
        "source": "philschmid/fine-tune-llms-in-2025.ipynb",
        "style": "`!python scripts/run_sft.py --config recipe.yaml` (TRL SFT script)",
        "skip": {3: "pip installs need the network", 5: "logs in to the Hub",
                 15: "starts a TGI container (docker, a GPU)", 17: "queries the TGI container of cell 15",
                 19: "lm_eval against the TGI container of cell 15", 21: "stops the TGI container of cell 15"},
        "edits": [
            (8, "from datasets import load_dataset",
             f"from datasets import load_dataset, load_from_disk  {MARK} the local copy of the data set"),
            (8, 'dataset = load_dataset("microsoft/orca-math-word-problems-200k", split="train")',
             f'dataset = load_from_disk("tiny/orca_math")["train"]  {MARK} 32 word problems, same columns (tiny_launched.py)'),
            (8, 'print(dataset[345]["messages"])', f'print(dataset[3]["messages"])  {MARK} 32 rows'),
            (13, "!python scripts/merge_adapter_weights.py --peft_model_id runs/llama-3-1-8b-math-orca-qlora-10k-ep1 "
                 "--push_to_hub True --repository_id llama-3-1-8b-math-orca-qlora-10k-ep1-merged",
             "!python scripts/merge_adapter_weights.py --peft_model_id runs/llama-3-1-8b-math-orca-qlora-10k-ep1 "
             f"--push_to_hub False --repository_id llama-3-1-8b-math-orca-qlora-10k-ep1-merged  {MARK} no Hub "
             "offline: the merged model is saved to merged-weights/"),
        ],
        "tiny": ["llama_bpe", "orca_math", "run_sft", "merge_adapter_weights"],
        "command": "scripts/run_sft.py",
        "prep": ["train_dataset.json"],
        "trained": "runs/llama-3-1-8b-math-orca-qlora-10k-ep1",
        "post": "merged-weights",
        # none: run_sft.py's train_function saves the tokenizer after training, which the converter leaves to
        # rank 0 inside a function that trains as at a notebook's top level (rules/rank_zero_in_functions.py)
        "every_rank_writes": [],
        # NBDDP_TIMEOUT: shorter than the command (≈ 9 s on a fast 2-core machine, its ranks forked), which must
        # outlast it; the launched ranks' own collectives wait at most this long for each other
        "timeout": 5,
    },
    # issue 28: the Kaggle 2×T4 recipe, `%%writefile script.py` then `!torchrun --nproc_per_node 2 script.py`,
    # twice (a hand-written gradient all-reduce over gloo, then DDP), after cells that start processes of their
    # own (`multiprocessing.Process` groups with their own rendezvous, `!python` scripts doing the same)
    "writefile_torchrun_mnist": {
        "source": "efficient_dl/practice.ipynb",
        "style": "`%%writefile script.py`, then `!torchrun --nproc_per_node 2 script.py` (plain PyTorch)",
        # cells 4-14 start `multiprocessing.Process` groups of the notebook's own, with their own env://
        # rendezvous: they run, in the notebook's one process, as in a kernel
        "skip": {2: "nvidia-smi needs a GPU"},
        "edits": [
            *[(cell, "import torchvision.transforms as transforms",
               f"import offline_torchvision as transforms  {MARK} torchvision is not installed") for cell in (27, 30)],
            *[(cell, "from torchvision.datasets import MNIST",
               f"from offline_torchvision import MNIST  {MARK} torchvision is not installed; MNIST downloads (64 "
               "images, tiny.py)") for cell in (27, 30)],
            (30, "device = torch.device('cuda', rank)", f"device = torch.device('cpu')  {MARK} no GPU"),
            (30, "model = DistributedDataParallel(model, device_ids=[rank], output_device=rank)",
             f"model = DistributedDataParallel(model)  {MARK} CPU replicas: no device ids"),
        ],
        "tiny": ["offline_torchvision"],
        # both commands, each launched with 2 processes in a kernel as under nbddp
        "command": ["custom_allreduce_training.py", "ddp_example.py"],
        "kernel_nproc": 2,
        "prep": ["custom_allreduce_training.py", "ddp_example.py"],
        # the one-rank job has no collective to wait in; each command runs ≈ 3 s on a fast 2-core machine
        "timeout": 1,
    },
}


def write_all(folder: Path = HERE) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, spec in NOTEBOOKS.items():
        path = folder / f"{name}.ipynb"
        nbformat.write(runnable(spec), str(path))
        written.append(path)
    keys = ("style", "tiny", "command", "kernel_nproc", "prep", "trained", "post", "every_rank_writes", "timeout")
    manifest = [{"file": f"{name}.ipynb", "original": spec["source"], **{k: spec[k] for k in keys if k in spec}}
                for name, spec in NOTEBOOKS.items()]
    (folder / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return written


if __name__ == "__main__":
    for p in write_all():
        print(p)
