"""Tiny local stand-ins for what the runnable notebooks load from the Hub: models built from a config, data
sets with the published columns, and a metric module for ``evaluate`` (not installed, and its ``load``
downloads). ``build(names, folder)`` writes the ones a notebook needs under ``folder/tiny/``; the notebook's
edited lines (marked ``# nbddp-offline:``) point there.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

WORDS = ("the cat dog sat ran on mat rug a big small red blue quick slow fox jumps over lazy bird sings "
         "tree house car road river sun moon star day night good bad happy sad").split()
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def sentence(rng: random.Random, label: int = 0, n: int = 6) -> str:
    """Words from the first half of ``WORDS`` for label 0, the second half for 1: a tiny model learns it fast."""
    half = len(WORDS) // 2
    words = WORDS[:half] if label == 0 else WORDS[half:]
    return " ".join(rng.choice(words) for _ in range(n))


def bert_tokenizer(folder: Path) -> None:
    """A BERT tokenizer whose vocabulary is ``WORDS``, one piece a word."""
    from tokenizers.implementations import BertWordPieceTokenizer
    from transformers import BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(SPECIAL + WORDS) + "\n")
    pieces = BertWordPieceTokenizer(str(folder / "vocab.txt"), lowercase=True)._tokenizer
    BertTokenizerFast(tokenizer_object=pieces, **dict(zip(("pad_token", "unk_token", "cls_token", "sep_token",
                                                          "mask_token"), SPECIAL))).save_pretrained(folder)


def bert(folder: Path) -> None:
    """A 2-layer BERT (hidden 32) with a word-level vocabulary of ``WORDS``, and its tokenizer."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    bert_tokenizer(folder)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(SPECIAL) + len(WORDS), hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=128)
    BertForSequenceClassification(config).save_pretrained(folder)


def distilbert(folder: Path) -> None:
    """A 2-layer DistilBERT (dim 32) with ``bert``'s word-level tokenizer: its config.json names its sizes
    ``dim``, ``n_layers``, ``n_heads``, ``hidden_dim``, as distilbert-base-uncased's does (no ``hidden_size``)."""
    import torch
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    bert_tokenizer(folder)
    torch.manual_seed(0)
    config = DistilBertConfig(vocab_size=len(SPECIAL) + len(WORDS), dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                              max_position_embeddings=128)
    DistilBertForSequenceClassification(config).save_pretrained(folder)


def glue_mrpc(folder: Path, train: int = 64, validation: int = 8) -> None:
    """MRPC's columns (sentence1, sentence2, label, idx); the label is the half of ``WORDS`` both are drawn from."""
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Value

    rng = random.Random(0)
    features = Features({"sentence1": Value("string"), "sentence2": Value("string"),
                         "label": ClassLabel(names=["not_equivalent", "equivalent"]), "idx": Value("int32")})

    def split(n, offset):
        rows = {"sentence1": [], "sentence2": [], "label": [], "idx": []}
        for i in range(n):
            label = i % 2
            a, b = sentence(rng, label), sentence(rng, label)
            rows["sentence1"].append(a), rows["sentence2"].append(b)
            rows["label"].append(label), rows["idx"].append(offset + i)
        return Dataset.from_dict(rows, features=features)

    DatasetDict({"train": split(train, 0), "validation": split(validation, train),
                 "test": split(validation, train + validation)}).save_to_disk(str(folder))


def imdb(folder: Path, train: int = 64, test: int = 24) -> None:
    """IMDB's columns (text, label of neg/pos): short reviews whose words give the label, as ``glue_mrpc``'s;
    each joins two halves with "and" (a word the notebooks look up)."""
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Value

    rng = random.Random(0)
    features = Features({"text": Value("string"), "label": ClassLabel(names=["neg", "pos"])})

    def split(n):
        labels = [i % 2 for i in range(n)]
        text = [f"{sentence(rng, label)} and {sentence(rng, label)}" for label in labels]
        return Dataset.from_dict({"text": text, "label": labels}, features=features)

    DatasetDict({"train": split(train), "test": split(test)}).save_to_disk(str(folder))


def wav2vec2(folder: Path) -> None:
    """A 4-layer wav2vec2 (hidden 16) with wav2vec2-base's LayerDrop (0.1), and its feature extractor."""
    import torch
    from transformers import Wav2Vec2Config, Wav2Vec2FeatureExtractor, Wav2Vec2Model

    Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=16000, padding_value=0.0, do_normalize=True,
                             return_attention_mask=False).save_pretrained(folder)
    torch.manual_seed(0)
    config = Wav2Vec2Config(hidden_size=16, num_hidden_layers=4, num_attention_heads=2, intermediate_size=32,
                            conv_dim=(8, 8), conv_stride=(5, 4), conv_kernel=(10, 8), num_conv_pos_embeddings=16,
                            num_conv_pos_embedding_groups=2, layerdrop=0.1, classifier_proj_size=16)
    Wav2Vec2Model(config).save_pretrained(folder)  # no head, as wav2vec2-base: the notebook's gets its labels


KS_LABELS = ["yes", "no", "up", "down", "left", "right", "on", "off", "stop", "go", "_silence_", "_unknown_"]


def superb_ks(folder: Path, train: int = 32, other: int = 8, samples: int = 1600) -> None:
    """SUPERB keyword spotting's columns (file, audio, label of its 12 names): a tenth of a second of a tone
    whose pitch gives the label ("yes" or "no"): 80 frames for the tiny wav2vec2, whose steps cost in
    proportion. ``audio`` is a plain dict (no decoder needed)."""
    import math

    from datasets import ClassLabel, Dataset, DatasetDict

    rng = random.Random(0)

    def split(n, name):
        rows = {"file": [], "audio": [], "label": []}
        for i in range(n):
            label, phase = i % 2, rng.random()
            tone = [0.5 * math.sin(2 * math.pi * (200 + 600 * label) * t / 16000 + phase) for t in range(samples)]
            rows["file"].append(f"{name}/{i}.wav")
            rows["audio"].append({"array": tone, "sampling_rate": 16000, "path": f"{name}/{i}.wav"})
            rows["label"].append(label)
        data = Dataset.from_dict(rows)
        return data.cast_column("label", ClassLabel(names=KS_LABELS))

    DatasetDict({"train": split(train, "train"), "validation": split(other, "validation"),
                 "test": split(other, "test")}).save_to_disk(str(folder))


CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def llama_chat(folder: Path) -> None:
    """nbddp's tiny character-level Llama (``demo``) with a chat template."""
    from transformers import AutoTokenizer

    from nbddp import demo

    demo.tiny_model(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)


def multilingual_thinking(folder: Path, n: int = 32) -> None:
    """HuggingFaceH4/Multilingual-Thinking's columns: ``messages`` (role, content, thinking) and the five
    columns the notebook removes; short arithmetic chats."""
    from datasets import Dataset, DatasetDict

    rows = {k: [] for k in ("reasoning_language", "developer", "user", "analysis", "final", "messages")}
    for i in range(n):
        a, b = i % 7, i % 5
        question, answer = f"what is {a} plus {b}", f"{a} plus {b} is {a + b}"
        rows["reasoning_language"].append("English"), rows["developer"].append("answer briefly")
        rows["user"].append(question), rows["analysis"].append("add them"), rows["final"].append(answer)
        rows["messages"].append([
            {"role": "system", "content": "answer briefly", "thinking": None},
            {"role": "user", "content": question, "thinking": None},
            {"role": "assistant", "content": answer, "thinking": "add them"},
        ])
    DatasetDict({"train": Dataset.from_dict(rows)}).save_to_disk(str(folder))


EVALUATE = '''"""Stands in for ``evaluate`` offline: ``load(...)`` gives accuracy (and F1 for two classes)."""


def load(*names, **kwargs):
    return Metric()


class Metric:
    def __init__(self):
        self.predictions, self.references = [], []

    def add_batch(self, predictions, references):
        self.predictions += [int(p) for p in predictions]
        self.references += [int(r) for r in references]

    def compute(self, predictions=None, references=None, **kwargs):
        if predictions is not None:
            self.add_batch(predictions, references)
        pairs = list(zip(self.predictions, self.references))
        self.predictions, self.references = [], []
        accuracy = sum(p == r for p, r in pairs) / max(len(pairs), 1)
        tp = sum(p == r == 1 for p, r in pairs)
        f1 = 2 * tp / max(sum(p == 1 for p, _ in pairs) + sum(r == 1 for _, r in pairs), 1)
        return {"accuracy": accuracy, "f1": f1}
'''


def offline_evaluate(folder: Path) -> None:
    (folder.parent.parent / "offline_evaluate.py").write_text(EVALUATE)


TORCHTEXT = '''"""Stands in for the few parts of ``torchtext`` a notebook uses (torchtext is not installed, and its
``GloVe()`` downloads): ``data.utils.get_tokenizer("basic_english")``, ``vocab.build_vocab_from_iterator``
and ``vocab.GloVe`` (a fixed random 300-dimensional vector per word)."""

import collections
import re
import types
import zlib

import torch


def get_tokenizer(name):
    assert name == "basic_english", name
    return lambda text: re.findall(r"[a-z0-9]+|[^a-z0-9\\s]", text.lower())


class Vocab:
    def __init__(self, itos):
        self.itos, self.stoi, self.default = list(itos), {t: i for i, t in enumerate(itos)}, None

    def __len__(self):
        return len(self.itos)

    def __contains__(self, token):
        return token in self.stoi

    def __getitem__(self, token):
        if token not in self.stoi and self.default is None:
            raise RuntimeError(f"token {token} not found and default index is not set")
        return self.stoi.get(token, self.default)

    def set_default_index(self, index):
        self.default = index

    def get_itos(self):
        return list(self.itos)

    def lookup_indices(self, tokens):
        return [self[t] for t in tokens]

    def lookup_tokens(self, indices):
        return [self.itos[i] for i in indices]


def build_vocab_from_iterator(iterator, min_freq=1, specials=None):
    counts = collections.Counter(t for tokens in iterator for t in tokens)
    words = sorted((t for t, n in counts.items() if n >= min_freq), key=lambda t: (-counts[t], t))
    return Vocab(list(specials or []) + [t for t in words if t not in (specials or [])])


class GloVe:
    dim = 300

    def get_vecs_by_tokens(self, tokens):
        single = isinstance(tokens, str)
        rows = [torch.randn(self.dim, generator=torch.Generator().manual_seed(zlib.crc32(t.encode())))
                for t in ([tokens] if single else tokens)]
        return rows[0] if single else torch.stack(rows)


data = types.SimpleNamespace(utils=types.SimpleNamespace(get_tokenizer=get_tokenizer))
vocab = types.SimpleNamespace(build_vocab_from_iterator=build_vocab_from_iterator, GloVe=GloVe, Vocab=Vocab)
'''


def offline_torchtext(folder: Path) -> None:
    (folder.parent.parent / "offline_torchtext.py").write_text(TORCHTEXT)

TIKTOKEN = '''"""Stands in for ``tiktoken`` (not installed; its encodings download): ``get_encoding("gpt2")`` gives a
word-level encoder over GPT-2's 50257 ids, ``<|endoftext|>`` being 50256 as in GPT-2."""

import re
import zlib

END = "<|endoftext|>"


class Encoding:
    n_vocab = 50257

    def __init__(self):
        self.pieces = {}

    def encode(self, text, allowed_special=()):
        ids = []
        for piece in re.findall(r"<\\|endoftext\\|>|\\w+|[^\\w\\s]", text):
            ids.append(50256 if piece == END and END in allowed_special else self._id(piece))
        return ids

    def _id(self, piece):
        i = zlib.crc32(piece.encode()) % 50000  # the same id in every process
        self.pieces.setdefault(i, piece)
        return i

    def decode(self, ids):
        return " ".join(END if i == 50256 else self.pieces.get(i, f"<{i}>") for i in ids)


def get_encoding(name):
    assert name == "gpt2", name
    return Encoding()
'''

GPT2 = '''"""Stands in for ``gpt_download`` (it downloads OpenAI's GPT-2 checkpoint and reads it with tensorflow):
random weights in the checkpoint's layout, for the tiny GPT-2 of the runnable notebook (2 layers, 32 wide)."""

import numpy as np


def download_and_load_gpt2(model_size, models_dir, emb_dim=32, n_layers=2, vocab_size=50257, context_length=1024):
    rng = np.random.default_rng(0)

    def w(*shape):
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    def norm():
        return {"g": np.ones(emb_dim, np.float32), "b": np.zeros(emb_dim, np.float32)}

    def linear(n_in, n_out):
        return {"w": w(n_in, n_out), "b": np.zeros(n_out, np.float32)}

    blocks = [{"attn": {"c_attn": linear(emb_dim, 3 * emb_dim), "c_proj": linear(emb_dim, emb_dim)},
               "mlp": {"c_fc": linear(emb_dim, 4 * emb_dim), "c_proj": linear(4 * emb_dim, emb_dim)},
               "ln_1": norm(), "ln_2": norm()} for _ in range(n_layers)]
    params = {"wte": w(vocab_size, emb_dim), "wpe": w(context_length, emb_dim), "blocks": blocks, **norm()}
    settings = {"n_vocab": vocab_size, "n_ctx": context_length, "n_embd": emb_dim, "n_layer": n_layers}
    return settings, params
'''


def offline_tiktoken(folder: Path) -> None:
    (folder.parent.parent / "offline_tiktoken.py").write_text(TIKTOKEN)


def offline_gpt2(folder: Path) -> None:
    (folder.parent.parent / "offline_gpt2.py").write_text(GPT2)


def previous_chapters(folder: Path) -> None:
    """``previous_chapters.py`` of LLMs-from-scratch's chapter 6 (in the public corpus) next to the notebook,
    its ``import tiktoken`` marked and pointed at the stand-in."""
    public = Path(__file__).resolve().parent.parent / "public"
    source = (public / "llms_from_scratch" / "previous_chapters.py").read_text()
    marked = "import offline_tiktoken as tiktoken  # nbddp-offline: tiktoken is not installed (tiny.py)"
    assert source.count("\nimport tiktoken\n") == 1
    (folder.parent.parent / "previous_chapters.py").write_text(source.replace("\nimport tiktoken\n", f"\n{marked}\n"))


def sms_spam(folder: Path, spam: int = 80, ham: int = 100) -> None:
    """SMS Spam Collection's file (``label<TAB>text`` lines) where chapter 6 looks for it
    (``sms_spam_collection/SMSSpamCollection.tsv``: its download is skipped): 80 spam, 100 ham, which the
    notebook balances and splits 70/10/20 into 112 training, 16 validation and 32 test messages."""
    rng = random.Random(0)
    rows = [("spam", 1)] * spam + [("ham", 0)] * ham
    rng.shuffle(rows)
    target = folder.parent.parent / "sms_spam_collection" / "SMSSpamCollection.tsv"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("".join(f"{name}\t{sentence(rng, label, rng.randint(4, 9))}\n" for name, label in rows))


def sam(folder: Path) -> None:
    """A SAM of one vision layer (hidden 16) on 64-pixel inputs, whose masks are 16x16, and its processor."""
    import torch
    from transformers import SamConfig, SamImageProcessor, SamModel, SamProcessor

    config = SamConfig(
        vision_config=dict(hidden_size=16, output_channels=16, num_hidden_layers=1, num_attention_heads=1,
                           image_size=64, patch_size=16, mlp_dim=32, global_attn_indexes=[0], num_pos_feats=8),
        prompt_encoder_config=dict(hidden_size=16, image_size=64, patch_size=16, mask_input_channels=4),
        mask_decoder_config=dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, mlp_dim=32,
                                 iou_head_hidden_dim=16))
    torch.manual_seed(0)
    SamModel(config).save_pretrained(str(folder))
    SamProcessor(image_processor=SamImageProcessor(
        size={"longest_edge": 64}, pad_size={"height": 64, "width": 64},
        mask_size={"longest_edge": 16}, mask_pad_size={"height": 16, "width": 16})).save_pretrained(str(folder))


def breast_cancer(folder: Path, n: int = 32) -> None:
    """nielsr/breast-cancer's columns (image, label): 16x16 RGB images, each with a brighter rectangle that its
    mask (the label, 0/1) marks: the masks are the size of the tiny SAM's."""
    import numpy as np
    import PIL.Image
    from datasets import Dataset, Features, Image

    rng = np.random.default_rng(0)
    images, masks = [], []
    for _ in range(n):
        x0, y0 = rng.integers(1, 8, size=2)
        w, h = rng.integers(4, 8, size=2)
        mask = np.zeros((16, 16), dtype=np.uint8)
        mask[y0 : y0 + h, x0 : x0 + w] = 1
        image = (rng.random((16, 16, 3)) * 100 + mask[..., None] * 150).astype(np.uint8)
        images.append(PIL.Image.fromarray(image))
        masks.append(PIL.Image.fromarray(mask))
    features = Features({"image": Image(), "label": Image()})
    Dataset.from_dict({"image": images, "label": masks}, features=features).save_to_disk(str(folder))


TORCHVISION = '''"""Stands in for the few parts of ``torchvision`` a notebook uses (torchvision is not installed, and its
data sets download): ``datasets.FashionMNIST`` gives 640 training or 128 test images with FashionMNIST's
shapes (1x28x28 floats in [0, 1], labels 0-9) whose label is the brightest of ten horizontal bands, so a small
model learns it; ``datasets.MNIST`` (or ``MNIST``) the same with 64 training images, MNIST's shapes; ``ToTensor``,
``Lambda``, ``Compose`` and ``Normalize`` are what transforms of such tensors need."""

import types

import torch


class ToTensor:
    def __call__(self, x):
        return x


class Lambda:
    def __init__(self, fn):
        self.fn = fn

    def __call__(self, x):
        return self.fn(x)


class Compose:
    def __init__(self, transforms):
        self.transforms = transforms

    def __call__(self, x):
        for transform in self.transforms:
            x = transform(x)
        return x


class Normalize:
    def __init__(self, mean, std):
        self.mean, self.std = torch.tensor(mean).view(-1, 1, 1), torch.tensor(std).view(-1, 1, 1)

    def __call__(self, x):
        return (x - self.mean) / self.std


class FashionMNIST(torch.utils.data.Dataset):
    SIZES = (640, 128)

    def __init__(self, root, train=True, download=False, transform=None, target_transform=None):
        g = torch.Generator().manual_seed(0 if train else 1)
        n = self.SIZES[0] if train else self.SIZES[1]
        self.targets = torch.arange(n) % 10
        self.data = torch.rand(n, 1, 28, 28, generator=g) * 0.5
        for i, label in enumerate(self.targets.tolist()):
            self.data[i, :, 2 * label + 4 : 2 * label + 6, :] += 0.5
        self.transform, self.target_transform = transform, target_transform

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, i):
        x, y = self.data[i], int(self.targets[i])
        x = self.transform(x) if self.transform else x
        return x, (self.target_transform(y) if self.target_transform else y)


class MNIST(FashionMNIST):
    SIZES = (64, 32)


datasets = types.SimpleNamespace(FashionMNIST=FashionMNIST, MNIST=MNIST)
'''


def offline_torchvision(folder: Path) -> None:
    (folder.parent.parent / "offline_torchvision.py").write_text(TORCHVISION)


def mnist_npz(folder: Path, train: int = 400, test: int = 100) -> None:
    """``mnist.npz`` as Keras publishes it (``x_train`` 28x28 uint8 images, ``y_train`` labels 0-9, the same for
    test) at ``tiny/mnist_npz/mnist.npz``: dim noisy images with a white horizontal band whose row gives the
    label (the noise makes each image its own, as the same-samples check compares the ranks' batches)."""
    import numpy as np

    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    arrays = {}
    for split, n in (("train", train), ("test", test)):
        labels = np.arange(n) % 10
        images = rng.integers(0, 40, (n, 28, 28), dtype=np.uint8)
        for i, label in enumerate(labels):
            images[i, 2 * label + 4 : 2 * label + 6, 4:24] = 255
        arrays[f"x_{split}"], arrays[f"y_{split}"] = images, labels.astype(np.uint8)
    np.savez(folder / "mnist.npz", **arrays)


TENSORBOARD = '''"""Stands in for ``torch.utils.tensorboard`` (tensorboard is not installed): ``SummaryWriter`` makes its
log folder and appends each scalar to ``scalars.txt`` there, so a run that makes one on every rank writes twice."""

import os


class SummaryWriter:
    def __init__(self, log_dir=None, **kwargs):
        self.log_dir = str(log_dir or "runs")
        os.makedirs(self.log_dir, exist_ok=True)

    def add_scalar(self, tag, value, step=None, **kwargs):
        with open(os.path.join(self.log_dir, "scalars.txt"), "a") as fh:
            fh.write(f"{tag} {step} {float(value)}\\n")

    def close(self):
        pass
'''


def offline_tensorboard(folder: Path) -> None:
    (folder.parent.parent / "offline_tensorboard.py").write_text(TENSORBOARD)


MLFLOW = '''"""Stands in for ``mlflow`` (not installed): tracking calls that keep nothing."""

import contextlib


def set_tracking_uri(uri):
    pass


def set_experiment(name):
    pass


@contextlib.contextmanager
def start_run(**kwargs):
    yield None


def log_metric(key, value, step=None):
    pass
'''


def offline_mlflow(folder: Path) -> None:
    (folder.parent.parent / "offline_mlflow.py").write_text(MLFLOW)


BUILDERS = {"bert": bert, "mnist_npz": mnist_npz, "offline_tensorboard": offline_tensorboard,
            "offline_mlflow": offline_mlflow, "distilbert": distilbert, "glue_mrpc": glue_mrpc, "imdb": imdb,
            "offline_evaluate": offline_evaluate,
            "offline_torchtext": offline_torchtext, "offline_torchvision": offline_torchvision,
            "sam": sam, "breast_cancer": breast_cancer, "offline_tiktoken": offline_tiktoken, "offline_gpt2": offline_gpt2,
            "previous_chapters": previous_chapters, "sms_spam": sms_spam,
            "wav2vec2": wav2vec2, "superb_ks": superb_ks, "llama_chat": llama_chat, "multilingual_thinking": multilingual_thinking}


def build(names, folder: Path) -> Path:
    """Write the named stand-ins under ``folder/tiny/`` (the ``offline_*`` modules next to the notebook)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        target = folder / "tiny" / name
        if target.exists():
            shutil.rmtree(target)
        BUILDERS[name](target)
    return folder
