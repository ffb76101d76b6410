"""Write the runnable copies of public notebooks: ``python tests/corpus/runnable/make_runnable.py``.

Each copy is the published notebook (``tests/corpus/public/<source>``) with a few lines replaced so it runs
offline in seconds: Hub ids become the tiny local models and data of ``tiny.py``, epochs and sizes are cut.
Every replaced line ends with ``# nbddp-offline: <why>``; cells that only install or need the network are
tagged ``nbddp-skip`` (nbddp and the one-process baseline both leave them out). ``MANIFEST.json`` names each
copy's original, the stand-ins it needs and the size of the data set it trains on.
"""

from __future__ import annotations

import json
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
PUBLIC = HERE.parent / "public"
MARK = "# nbddp-offline:"

EVALUATE = ("import evaluate", f"import offline_evaluate as evaluate  {MARK} evaluate is not installed; its load() downloads")

#: name → the public notebook, its edits ``(cell, published line, new line)``, the cells to skip, the stand-ins
#: of ``tiny.py`` it needs, and the length of the training data set.
NOTEBOOKS = {
    "hf_trainer_mrpc": {
        "source": "hf_notebooks/course_chapter3_section3.ipynb",
        "style": "HF Trainer",
        "skip": {3: "pip installs need the network"},
        "edits": [
            (4, "from datasets import load_dataset",
             f"from datasets import load_dataset, load_from_disk  {MARK} the local copy of the data set"),
            (4, 'raw_datasets = load_dataset("glue", "mrpc")',
             f'raw_datasets = load_from_disk("tiny/glue_mrpc")  {MARK} 64 pairs with MRPC\'s columns (tiny.py)'),
            (4, 'checkpoint = "bert-base-uncased"', f'checkpoint = "tiny/bert"  {MARK} a 2-layer BERT built from a config'),
            (5, 'training_args = TrainingArguments("test-trainer")',
             f'training_args = TrainingArguments("test-trainer", learning_rate=3e-3)  {MARK} a random tiny model learns faster'),
            (11, *EVALUATE),
            (13, 'training_args = TrainingArguments("test-trainer", evaluation_strategy="epoch")',
             f'training_args = TrainingArguments("test-trainer", eval_strategy="epoch", learning_rate=3e-3)  {MARK} '
             "evaluation_strategy is eval_strategy since transformers 4.46; a random tiny model learns faster"),
        ],
        "tiny": ["bert", "glue_mrpc", "offline_evaluate"],
        "train_size": 64,
    },
    "accelerate_and_plain_loops_mrpc": {
        "source": "hf_notebooks/course_chapter3_section4.ipynb",
        "style": "Accelerate loop",
        "skip": {3: "pip installs need the network",
                 18: "notebook_launcher(training_function): the notebook never defines training_function"},
        "edits": [
            (4, "from datasets import load_dataset",
             f"from datasets import load_dataset, load_from_disk  {MARK} the local copy of the data set"),
            (4, 'raw_datasets = load_dataset("glue", "mrpc")',
             f'raw_datasets = load_from_disk("tiny/glue_mrpc")  {MARK} 64 pairs with MRPC\'s columns (tiny.py)'),
            (4, 'checkpoint = "bert-base-uncased"', f'checkpoint = "tiny/bert"  {MARK} a 2-layer BERT built from a config'),
            (11, "optimizer = AdamW(model.parameters(), lr=5e-5)",
             f"optimizer = AdamW(model.parameters(), lr=3e-3)  {MARK} a random tiny model learns faster"),
            (15, *EVALUATE),
            (16, "optimizer = AdamW(model.parameters(), lr=3e-5)",
             f"optimizer = AdamW(model.parameters(), lr=3e-3)  {MARK} a random tiny model learns faster"),
            (17, "optimizer = AdamW(model.parameters(), lr=3e-5)",
             f"optimizer = AdamW(model.parameters(), lr=3e-3)  {MARK} a random tiny model learns faster"),
        ],
        "tiny": ["bert", "glue_mrpc", "offline_evaluate"],
        "train_size": 64,
    },
    "plain_loop_two_models_mlp_lora": {
        "source": "peft/multilayer_perceptron_lora.ipynb",
        "style": "plain loop with two models",
        "skip": {45: "pushes to the Hub", 49: "loads from the Hub what cell 45 pushed",
                 51: "compares with the model cell 49 loads", 54: "Hub only", 55: "Hub only"},
        "edits": [
            (15, "def __init__(self, num_units_hidden=2000):",
             f"def __init__(self, num_units_hidden=64):  {MARK} a smaller hidden layer for a CPU test"),
            (18, "max_epochs = 30", f"max_epochs = 3  {MARK} fewer epochs"),
            (18, 'device = torch.accelerator.current_accelerator().type if hasattr(torch, "accelerator") else "cuda"',
             f'device = "cpu"  {MARK} current_accelerator() is None without an accelerator'),
        ],
        "tiny": [],
        "train_size": 800,
    },
    "audio_layerdrop_wav2vec2": {
        "source": "hf_notebooks/audio_classification.ipynb",
        "style": "audio with LayerDrop",
        "skip": {6: "pip installs need the network", 8: "logs in to the Hub", 10: "apt install needs the network",
                 30: "plays examples (needs an audio decoder)", 61: "pushes to the Hub"},
        "edits": [
            (4, 'model_checkpoint = "facebook/wav2vec2-base"',
             f'model_checkpoint = "tiny/wav2vec2"  {MARK} a 4-layer wav2vec2 built from a config, LayerDrop 0.1'),
            (4, "batch_size = 32", f"batch_size = 2  {MARK} 32 examples"),
            (16, "from datasets import load_dataset, load_metric",
             f"from datasets import load_dataset, load_from_disk  {MARK} load_metric left datasets 3; the local data"),
            (17, 'dataset = load_dataset("superb", "ks")',
             f'dataset = load_from_disk("tiny/superb_ks")  {MARK} 32 tones with SUPERB KS\'s columns (tiny.py)'),
            (17, 'metric = load_metric("accuracy")',
             f'metric = __import__("offline_evaluate").load("accuracy")  {MARK} load_metric downloads'),
            (21, 'dataset["test"][1000]', f'dataset["test"][1]  {MARK} 8 test examples'),
            (27, 'dataset["test"][1000]["audio"]', f'dataset["test"][1]["audio"]  {MARK} 8 test examples'),
            (49, "learning_rate=3e-5,", f"learning_rate=1e-3,  {MARK} a random tiny model learns faster"),
            (49, "num_train_epochs=5,", f"num_train_epochs=3,  {MARK} fewer epochs (each evaluates and saves a checkpoint)"),
            (49, "warmup_ratio=0.1,", f"warmup_steps=0.1,  {MARK} warmup_ratio is warmup_steps (a fraction) in transformers 5"),
            (49, "push_to_hub=True,", f"push_to_hub=False,  {MARK} no Hub offline"),
            (54, "tokenizer=feature_extractor,",
             f"processing_class=feature_extractor,  {MARK} Trainer's tokenizer= is processing_class= in transformers 5"),
        ],
        "tiny": ["wav2vec2", "superb_ks", "offline_evaluate"],
        "train_size": 32,
    },
    "notebook_launcher_mrpc": {
        "source": "hf_notebooks/accelerate_simple_nlp_example.ipynb",
        "style": "notebook_launcher",
        "skip": {2: "pip installs need the network"},
        "edits": [
            (4, "import torch", f"import torch; from torch.optim import AdamW  {MARK} AdamW left transformers 5"),
            (4, "from datasets import load_dataset, load_metric",
             f"from datasets import load_dataset, load_from_disk  {MARK} load_metric left datasets 3; the local data"),
            (4, "AdamW,", f"# AdamW,  {MARK} imported from torch.optim above"),
            (6, 'model_checkpoint = "bert-base-cased"',
             f'model_checkpoint = "tiny/bert"  {MARK} a 2-layer BERT built from a config'),
            (10, 'raw_datasets = load_dataset("glue", "mrpc")',
             f'raw_datasets = load_from_disk("tiny/glue_mrpc")  {MARK} 64 pairs with MRPC\'s columns (tiny.py)'),
            (47, 'metric = load_metric("glue", "mrpc")',
             f'metric = __import__("offline_evaluate").load("glue", "mrpc")  {MARK} load_metric downloads'),
            (53, '"learning_rate": 2e-5,', f'"learning_rate": 3e-3,  {MARK} a random tiny model learns faster'),
            (55, "num_warmup_steps=100,", f"num_warmup_steps=0,  {MARK} 24 steps in all"),
            (57, "notebook_launcher(training_function, (model,), num_processes=2)",
             f"notebook_launcher(training_function, (model,), num_processes=1)  {MARK} the one-process baseline "
             "runs it in its own process; under nbddp each rank runs it whatever the number"),
        ],
        "tiny": ["bert", "glue_mrpc", "offline_evaluate"],
        "train_size": 64,
    },
    "trl_sft_lora_chat": {
        "source": "trl/sft_nemotron_3.ipynb",
        "style": "TRL SFT",
        "skip": {5: "pip installs need the network", 7: "logs in to the Hub", 25: "reads CUDA memory",
                 29: "reads CUDA memory"},
        "edits": [
            (9, "from datasets import load_dataset",
             f"from datasets import load_dataset, load_from_disk  {MARK} the local copy of the data set"),
            (9, 'train_dataset = load_dataset(dataset_name, split="train")',
             f'train_dataset = load_from_disk("tiny/multilingual_thinking")["train"]  {MARK} 32 chats, same columns'),
            (17, 'model_id = "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"',
             f'model_id = "tiny/llama_chat"  {MARK} a tiny Llama built from a config, with a chat template'),
            (17, "dtype=torch.bfloat16,", f"dtype=torch.float32,  {MARK} CPU training"),
            (21, "learning_rate=2e-4,", f"learning_rate=2e-3,  {MARK} a random tiny model learns faster"),
            (21, 'optim="paged_adamw_8bit",', f'optim="adamw_torch",  {MARK} bitsandbytes needs a GPU'),
            (21, 'report_to="trackio",', f'report_to="none",  {MARK} trackio is not installed'),
            (21, "trackio_space_id=output_dir,", f"# trackio_space_id=output_dir,  {MARK} trackio is not installed"),
            (21, "push_to_hub=True,", f"push_to_hub=False,  {MARK} no Hub offline"),
            (21, "max_length=128,", f"max_length=128, bf16=False,  {MARK} SFTConfig's bf16 default needs a GPU"),
            (31, "trainer.push_to_hub(dataset_name=dataset_name)",
             f"# trainer.push_to_hub(dataset_name=dataset_name)  {MARK} no Hub offline"),
            (34, '**tokenizer(text, return_tensors="pt").to("cuda"),',
             f'**tokenizer(text, return_tensors="pt").to(model.device),  {MARK} no GPU'),
            (34, "max_new_tokens=128,", f"max_new_tokens=16,  {MARK} a short answer"),
        ],
        "tiny": ["llama_chat", "multilingual_thinking"],
        "train_size": 32,
    },
    "loader_factory_imdb_nbow": {
        "source": "sentiment/1_Neural_Bag_of_Words.ipynb",
        "style": "loaders from a factory",
        "edits": [
            (5, "import torchtext",
             f"import offline_torchtext as torchtext  {MARK} not installed; its GloVe() downloads (tiny.py)"),
            (9, 'train_data, test_data = datasets.load_dataset("imdb", split=["train", "test"])',
             f'train_data, test_data = [datasets.load_from_disk("tiny/imdb")[s] for s in ("train", "test")]  {MARK} '
             "64 and 24 reviews with IMDB's columns (tiny.py)"),
            (73, "batch_size = 512", f"batch_size = 8  {MARK} 48 training reviews"),
        ],
        "tiny": ["imdb", "offline_torchtext"],
        "train_size": 48,
        "whole": [16, 24],
    },
    "save_then_load_spam_gpt2": {
        "source": "llms_from_scratch/ch06.ipynb",
        "style": "save-then-load",
        "skip": {3: "prints the versions of tiktoken and tensorflow, which are not installed"},
        "edits": [
            (29, "import tiktoken",
             f"import offline_tiktoken as tiktoken  {MARK} not installed; a word-level stand-in (tiny.py)"),
            (44, '"gpt2-small (124M)": {"emb_dim": 768, "n_layers": 12, "n_heads": 12},',
             f'"gpt2-small (124M)": {{"emb_dim": 32, "n_layers": 2, "n_heads": 2}},  {MARK} a 2-layer GPT-2 for a CPU test'),
            (45, "from gpt_download import download_and_load_gpt2",
             f"from offline_gpt2 import download_and_load_gpt2  {MARK} random weights in OpenAI's layout; the real "
             "one downloads and needs tensorflow"),
            (99, "optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5, weight_decay=0.1)",
             f"optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)  {MARK} a random tiny "
             "model learns faster"),
        ],
        "tiny": ["sms_spam", "offline_tiktoken", "offline_gpt2", "previous_chapters"],
        "train_size": 112,
        "whole": [16, 32],
    },
    "custom_head_bert_imdb": {
        "source": "sentiment/4_Transformers.ipynb",
        "style": "plain loop: own head on a pretrained encoder",
        "skip": {12: 'tokenizer.vocab["!"]: the tiny vocabulary has words only'},
        "edits": [
            (1, "import torchtext", f"# import torchtext  {MARK} not installed, and this notebook never uses it"),
            (3, 'train_data, test_data = datasets.load_dataset("imdb", split=["train", "test"])',
             f'train_data, test_data = [datasets.load_from_disk("tiny/imdb")[s] for s in ("train", "test")]  {MARK} '
             "64 and 24 reviews with IMDB's columns (tiny.py)"),
            (4, 'transformer_name = "bert-base-uncased"',
             f'transformer_name = "tiny/bert"  {MARK} a 2-layer BERT built from a config'),
            (23, "transformer = transformers.AutoModel.from_pretrained(transformer_name)",
             f'transformer = transformers.AutoModel.from_pretrained(transformer_name, attn_implementation="eager")  '
             f"{MARK} output_attentions=True needs eager attention in transformers 5 (sdpa gives none)"),
            (25, 'output_dim = len(train_data["label"].unique())',
             f'output_dim = len(train_data[:]["label"].unique())  {MARK} ds["label"] is a Column since datasets 4; '
             'ds[:]["label"] is the tensor'),
            (27, "lr = 1e-5", f"lr = 1e-3  {MARK} a random tiny model learns faster"),
            (34, "n_epochs = 3", f"n_epochs = 10  {MARK} a random tiny model needs more steps"),
        ],
        "tiny": ["bert", "imdb"],
        "train_size": 48,
        "whole": [16, 24],
    },
    "hf_trainer_distilbert_text_classification": {
        "source": "hf_notebooks/text_classification.ipynb",
        "style": "HF Trainer on DistilBERT (its config.json says dim, not hidden_size)",
        "skip": {4: "logs in to the Hub", 67: "pushes to the Hub",
                 75: "hyperparameter search: optuna or Ray Tune, not installed",
                 77: "hyperparameter search: optuna or Ray Tune, not installed",
                 79: "shows the hyperparameter search's result", 81: "trains with the search's result"},
        "edits": [
            (14, 'task = "cola"', f'task = "mrpc"  {MARK} the local MRPC stand-in (tiny.py); its metric is accuracy'),
            (14, 'model_checkpoint = "distilbert-base-uncased"',
             f'model_checkpoint = "tiny/distilbert"  {MARK} a 2-layer DistilBERT built from a config'),
            (17, "from datasets import load_dataset, load_metric",
             f"from datasets import load_dataset, load_from_disk  {MARK} load_metric left datasets 3; the local data"),
            (19, 'dataset = load_dataset("glue", actual_task)',
             f'dataset = load_from_disk(f"tiny/glue_{{actual_task}}")  {MARK} 64 pairs with MRPC\'s columns (tiny.py)'),
            (19, "metric = load_metric('glue', actual_task)",
             f"metric = __import__('offline_evaluate').load('glue', actual_task)  {MARK} load_metric downloads"),
            (54, "learning_rate=2e-5,", f"learning_rate=3e-3,  {MARK} a random tiny model learns faster"),
            (54, "num_train_epochs=5,", f"num_train_epochs=3,  {MARK} fewer epochs (each evaluates and saves a checkpoint)"),
            (54, "push_to_hub=True,", f"push_to_hub=False,  {MARK} no Hub offline"),
            (59, "tokenizer=tokenizer,",
             f"processing_class=tokenizer,  {MARK} Trainer's tokenizer= is processing_class= in transformers 5"),
        ],
        "tiny": ["distilbert", "glue_mrpc", "offline_evaluate"],
        "train_size": 64,
    },
    # issue 28: a Kaggle notebook whose first cell is a bare `pip install` line (no `!`), which IPython's
    # automagic runs as %pip
    "bare_pip_kaggle_fashion_mlp": {
        "source": "generative_ai/about_the_optimization_loop.ipynb",
        "style": "bare pip install (automagic), plain loop",
        "edits": [
            (2, "pip install torch torchvision torchaudio --index-url https://download.pytorch.org/whl/cu118",
             f"pip install torch  {MARK} torch is installed, so no download; the published line fetches CUDA 11.8 "
             "wheels of torch, torchvision and torchaudio"),
            (6, "from torchvision import datasets",
             f"from offline_torchvision import datasets  {MARK} torchvision is not installed; FashionMNIST downloads"),
            (6, "from torchvision.transforms import ToTensor, Lambda",
             f"from offline_torchvision import ToTensor, Lambda  {MARK} torchvision is not installed"),
        ],
        "tiny": ["offline_torchvision"],
        "train_size": 640,
        "whole": [128],
    },
    # issue 28: SAM fine-tuning, the optimizer over the model's mask decoder alone
    "part_optimizer_sam_mask_decoder": {
        "source": "transformers_tutorials/Fine_tune_SAM_(segment_anything)_on_a_custom_dataset.ipynb",
        "style": "plain loop, optimizer over a part of the model",
        "skip": {3: "pip installs need the network", 4: "pip installs need the network",
                 6: "pip installs need the network"},
        "edits": [
            (8, "from datasets import load_dataset",
             f"from datasets import load_from_disk  {MARK} the local copy of the data set"),
            (8, 'dataset = load_dataset("nielsr/breast-cancer", split="train")',
             f'dataset = load_from_disk("tiny/breast_cancer")  {MARK} 32 16x16 images with a mask each (tiny.py)'),
            (16, 'processor = SamProcessor.from_pretrained("facebook/sam-vit-base")',
             f'processor = SamProcessor.from_pretrained("tiny/sam")  {MARK} 64-pixel inputs, 16x16 masks'),
            (24, 'model = SamModel.from_pretrained("facebook/sam-vit-base")',
             f'model = SamModel.from_pretrained("tiny/sam")  {MARK} a one-layer SAM built from a config'),
            (26, "import monai", f"import torch  {MARK} monai is not installed"),
            (26, "optimizer = Adam(model.mask_decoder.parameters(), lr=1e-5, weight_decay=0)",
             f"optimizer = Adam(model.mask_decoder.parameters(), lr=1e-3, weight_decay=0)  {MARK} a random tiny "
             "model learns faster"),
            (26, "seg_loss = monai.losses.DiceCELoss(sigmoid=True, squared_pred=True, reduction='mean')",
             f"seg_loss = torch.nn.BCEWithLogitsLoss()  {MARK} monai is not installed: its DiceCELoss's "
             "cross-entropy term alone"),
            (27, "num_epochs = 100", f"num_epochs = 2  {MARK} fewer epochs"),
        ],
        "tiny": ["sam", "breast_cancer"],
        "train_size": 32,
    },
    # issue 39: the two-GPU idiom `if torch.cuda.device_count() > 1: clf = nn.DataParallel(clf)` around a plain
    # loop, with a SummaryWriter and an MLflow run the kernel made once
    "data_parallel_mnist_tensorboard": {
        "source": "aicloud/pytorch_tensorboard_mlflow.ipynb",
        "style": "nn.DataParallel, plain loop, SummaryWriter and MLflow",
        "skip": {3: "pip installs need the network", 8: "downloads mnist.npz (tiny.py writes one)"},
        "edits": [
            (4, "from torchvision import datasets, transforms",
             f"import torch  {MARK} torchvision is not installed (the notebook uses neither name)"),
            (4, "from torch.utils.tensorboard import SummaryWriter",
             f"from offline_tensorboard import SummaryWriter  {MARK} tensorboard is not installed"),
            (4, "import mlflow", f"import offline_mlflow as mlflow  {MARK} mlflow is not installed"),
            (9, "data = np.load(BASE_DIR.joinpath('mnist.npz'))",
             f"data = np.load(BASE_DIR.joinpath('tiny/mnist_npz/mnist.npz'))  {MARK} 400 + 100 banded images"),
            (12, "device = torch.device(f'cuda:0')", f"device = torch.device('cpu')  {MARK} no GPU here"),
            (15, "if torch.cuda.device_count() > 1:",
             f"if True:  {MARK} the kernel's two GPUs (DataParallel without CUDA runs the model as it is)"),
            (17, 'current_time = datetime.now().strftime("%Y%m%d-%H_%M")',
             f'current_time = "run"  {MARK} one folder name for both runs, whatever the minute'),
        ],
        "tiny": ["mnist_npz", "offline_tensorboard", "offline_mlflow"],
        "train_size": 400,
        "whole": [100],
    },
}


def runnable(spec: dict) -> nbformat.NotebookNode:
    nb = nbformat.read(PUBLIC / spec["source"], as_version=4)
    for number, reason in spec.get("skip", {}).items():
        cell = nb.cells[number - 1]
        cell.metadata.setdefault("tags", []).append("nbddp-skip")
        cell.source = f"{MARK} skipped: {reason}\n" + cell.source
    for number, old, new in spec["edits"]:
        cell = nb.cells[number - 1]
        lines = cell.source.split("\n")
        hits = [i for i, line in enumerate(lines)  # the whole line, or its code before a trailing comment
                if old.strip() in (line.strip(), line.split("  #")[0].strip())]
        assert len(hits) == 1, (spec["source"], number, old, hits)
        indent = lines[hits[0]][: len(lines[hits[0]]) - len(lines[hits[0]].lstrip())]
        lines[hits[0]] = indent + new
        cell.source = "\n".join(lines)
    return nb


def write_all(folder: Path = HERE) -> list[Path]:
    written = []
    for name, spec in NOTEBOOKS.items():
        path = folder / f"{name}.ipynb"
        nbformat.write(runnable(spec), str(path))
        written.append(path)
    manifest = [{"file": f"{name}.ipynb", "original": spec["source"], "style": spec["style"], "tiny": spec["tiny"],
                 "train_size": spec["train_size"], **({"whole": spec["whole"]} if "whole" in spec else {})}
                for name, spec in NOTEBOOKS.items()]
    (folder / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return written


if __name__ == "__main__":
    for p in write_all():
        print(p)
