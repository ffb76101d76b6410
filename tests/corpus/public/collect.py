"""How the public notebook corpus was gathered; run it again to rebuild it from the same commits.

Each source repository is a bare git snapshot (``--mirrors DIR`` holds ``owner+name/repo``, one per
repository, as a snapshot store lays them out). Nothing here runs in the tests.

- ``<source>/<name>.ipynb``: the notebook's JSON as published at the recorded commit, with every code cell's
  ``outputs`` emptied and ``execution_count`` set to null, markdown attachments, the base64 data of images
  inlined in markdown (``data:image/…;base64,`` stays) and the notebook's ``widgets`` metadata dropped (to
  keep the corpus small); code cells are as published, and a notebook that nbformat's schema rejects stays
  rejected.
- ``unsloth_nb.tar.xz``: every notebook of ``unslothai/notebooks``'s ``nb/`` folder, compact: the same with
  outputs dropped, and markdown cells kept with an empty source (their text dropped); format version, cell
  ids, cell and notebook metadata kept. Only notebooks go in, no other file of that repository.
- ``<source>/<name>.py`` (or ``.yaml``): a module a notebook imports from its folder, or a script or recipe its
  shell lines run (``MODULES``), as published.
- ``MANIFEST.json``: for each notebook its repository, path, commit, licence and style tags (the tags are
  computed from the code cells by the patterns below, plus the few hand-given ones in ``EXTRA_TAGS``).

    python tests/corpus/public/collect.py --mirrors /work/.mirror
"""

from __future__ import annotations

import argparse
import io
import json
import re
import subprocess
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: repository → (folder in the corpus, licence, commit the corpus was taken at)
REPOS = {
    "huggingface/notebooks": ("hf_notebooks", "Apache-2.0", "5068b1142e8ed1e691c8b1e9f98e4473ebe55790"),
    "huggingface/cookbook": ("hf_cookbook", "Apache-2.0", "ed2c6467015cee5bd962606a5caa0ece10483982"),
    "huggingface/trl": ("trl", "Apache-2.0", "f2cd57710ae345ea6428ae95363267fcf38a3dc8"),
    "huggingface/peft": ("peft", "Apache-2.0", "5d602fdbff04c33c1c4de55cda9d4ae1d7cb7e40"),
    "mrdbourke/pytorch-deep-learning": ("pytorch_dl", "MIT", "baa27b691617461c173ecf3439793cd8cde74e13"),
    "bentrevett/pytorch-sentiment-analysis": ("sentiment", "MIT", "329f654b2cfaed22fee432569ebd7a2674584f79"),
    "rasbt/LLMs-from-scratch": ("llms_from_scratch", "Apache-2.0", "28c65cdfbc3338e2e040016eea4b7fdf556e4d57"),
    "NielsRogge/Transformers-Tutorials": ("transformers_tutorials", "MIT", "1140198d259d5d9e205ba45a5c3b456261fe2491"),
    "pytorch/opacus": ("opacus", "Apache-2.0", "4d0ebc84613d214fbfd37fbfd1390e3747a625ce"),
    "Aisuko/generative-ai": ("generative_ai", "Apache-2.0", "8e1aa00ce79b0ec15e2234301d6d75283b391fbf"),
    "philschmid/deep-learning-pytorch-huggingface": ("philschmid", "MIT", "59b37973074de90004d10e5ff636f98160c9743a"),
    "NVIDIA/NeMo": ("nemo", "Apache-2.0", "ec0b6240c44380ec8552ac8b7c9a0dd41adcffda"),
    "mryab/efficient-dl-systems": ("efficient_dl", "MIT", "e632aa89ca9e6638d52e1b686095e7442faffbb0"),
    "encord-team/encord-notebooks": ("encord", "Apache-2.0", "4bca849e7dff72b07ce8eba388ef78979847d74b"),
    "pytorch/xla": ("pytorch_xla", "BSD-3-Clause", "41398bfff334fc8d3b1c00be6ea8cc5411f6d6bf"),
    "sbercloud-ai/aicloud-examples": ("aicloud", "MIT", "299bcc6d7c8c5ed6e183f7c01fb54f1927f10e72"),
}
UNSLOTH = ("unslothai/notebooks", "LGPL-3.0", "bdda2efc7ad5ae129ea63cd2065d23c391406283")

#: The training notebooks taken from each repository (paths at the commit above).
PATHS = {
    "huggingface/notebooks": [
        "examples/text_classification.ipynb",
        "examples/language_modeling.ipynb",
        "examples/language_modeling_from_scratch.ipynb",
        "examples/token_classification.ipynb",
        "examples/question_answering.ipynb",
        "examples/summarization.ipynb",
        "examples/translation.ipynb",
        "examples/multiple_choice.ipynb",
        "examples/image_classification.ipynb",
        "examples/image_classification_albumentations.ipynb",
        "examples/image_classification_kornia.ipynb",
        "examples/audio_classification.ipynb",
        "examples/speech_recognition.ipynb",
        "examples/multi_lingual_speech_recognition.ipynb",
        "examples/semantic_segmentation.ipynb",
        "examples/protein_language_modeling.ipynb",
        "examples/video_classification.ipynb",
        "examples/image_captioning_blip.ipynb",
        "examples/idefics/finetune_image_captioning_peft.ipynb",
        "examples/paligemma/Fine_tune_PaliGemma.ipynb",
        "examples/nucleotide_transformer_dna_sequence_modelling_with_peft.ipynb",
        "examples/accelerate_examples/simple_nlp_example.ipynb",
        "examples/accelerate_examples/simple_cv_example.ipynb",
        "examples/time-series-transformers.ipynb",
        "examples/patch_tst.ipynb",
        "examples/annotated_diffusion.ipynb",
        "course/en/chapter3/section3.ipynb",
        "course/en/chapter3/section4.ipynb",
        "course/en/chapter7/section2_pt.ipynb",
        "course/en/chapter7/section3_pt.ipynb",
        "course/en/chapter7/section4_pt.ipynb",
        "course/en/chapter7/section5_pt.ipynb",
        "course/en/chapter7/section6_pt.ipynb",
        "course/en/chapter7/section7_pt.ipynb",
    ],
    "huggingface/cookbook": [
        "notebooks/en/fine_tuning_code_llm_on_single_gpu.ipynb",
        "notebooks/en/information_extraction_haystack_nuextract.ipynb",  # predicts only (issue 42)
        "notebooks/en/fine_tuning_llm_grpo_trl.ipynb",
        "notebooks/en/fine_tuning_smol_vlm_sft_trl.ipynb",
        "notebooks/en/fine_tuning_vit_custom_dataset.ipynb",
        "notebooks/en/fine_tuning_vlm_trl.ipynb",
        "notebooks/en/fine_tuning_vlm_dpo_smolvlm_instruct.ipynb",
        "notebooks/en/function_calling_fine_tuning_llms_on_xlam.ipynb",
        "notebooks/en/prompt_tuning_peft.ipynb",
        "notebooks/en/finetune_t5_for_search_tag_generation.ipynb",
        "notebooks/en/optuna_hpo_with_transformers.ipynb",
        "notebooks/en/semantic_segmentation_fine_tuning_inference.ipynb",
    ],
    "huggingface/trl": [
        "examples/notebooks/sft_trl_lora_qlora.ipynb",
        "examples/notebooks/grpo_trl_lora_qlora.ipynb",
        "examples/notebooks/sft_tool_calling.ipynb",
        "examples/notebooks/sft_qwen_vl.ipynb",
        "examples/notebooks/sft_nemotron_3.ipynb",
        "examples/notebooks/grpo_qwen3_vl.ipynb",
    ],
    "huggingface/peft": [
        "examples/sequence_classification/LoRA.ipynb",
        "examples/sequence_classification/IA3.ipynb",
        "examples/sequence_classification/prefix_tuning.ipynb",
        "examples/sequence_classification/P_Tuning.ipynb",
        "examples/sequence_classification/Prompt_Tuning.ipynb",
        "examples/causal_language_modeling/peft_prompt_tuning_clm.ipynb",
        "examples/causal_language_modeling/peft_lora_clm_with_additional_tokens.ipynb",
        "examples/conditional_generation/peft_lora_seq2seq.ipynb",
        "examples/conditional_generation/peft_ia3_seq2seq.ipynb",
        "examples/image_classification/image_classification_peft_lora.ipynb",
        "examples/int8_training/Finetune_opt_bnb_peft.ipynb",
        "examples/int8_training/peft_bnb_whisper_large_v2_training.ipynb",
        "examples/multilayer_perceptron/multilayer_perceptron_lora.ipynb",
        "examples/token_classification/peft_lora_token_cls.ipynb",
        "examples/dora_finetuning/QDoRA_finetuning.ipynb",
        "examples/semantic_segmentation/semantic_segmentation_peft_lora.ipynb",
    ],
    "mrdbourke/pytorch-deep-learning": [
        "01_pytorch_workflow.ipynb",
        "02_pytorch_classification.ipynb",
        "03_pytorch_computer_vision.ipynb",
        "04_pytorch_custom_datasets.ipynb",
        "06_pytorch_transfer_learning.ipynb",
        "07_pytorch_experiment_tracking.ipynb",
        "08_pytorch_paper_replicating.ipynb",
        "09_pytorch_model_deployment.ipynb",
        "going_modular/05_pytorch_going_modular_cell_mode.ipynb",
    ],
    "bentrevett/pytorch-sentiment-analysis": [
        "1 - Neural Bag of Words.ipynb",
        "4 - Transformers.ipynb",
    ],
    "rasbt/LLMs-from-scratch": [
        "ch06/01_main-chapter-code/ch06.ipynb",
    ],
    # issue 28: training nbddp refuses before launch (TensorFlow/Keras, JAX/Flax, Lightning, Opacus without
    # DPDDP), an optimizer over a part of the model (SAM), a Kaggle notebook's bare `pip install` line
    "NielsRogge/Transformers-Tutorials": [
        "SAM/Fine_tune_SAM_(segment_anything)_on_a_custom_dataset.ipynb",
        "CANINE/Fine_tune_CANINE_on_IMDb_(movie_review_binary_classification).ipynb",
    ],
    "pytorch/opacus": ["tutorials/building_image_classifier.ipynb"],
    "Aisuko/generative-ai": ["pytorch/about_the_optimization_loop.ipynb"],
    # issue 28: training started from a shell line (`!python scripts/run_sft.py`, `!torchrun …`, `!deepspeed …`)
    "philschmid/deep-learning-pytorch-huggingface": [
        "training/fine-tune-llms-in-2025.ipynb",
        "training/rl-with-llms-in-2025-dpo.ipynb",
        "training/fsdp-qlora-distributed-llama3.ipynb",
        "training/deepseed-flan-t5-summarization.ipynb",
    ],
    # issue 28: `%%bash` + `torchrun --nproc_per_node=1 …` (NeMo's LoRA tutorial)
    "NVIDIA/NeMo": ["tutorials/llm/llama-3/llama3-lora-nemofw.ipynb"],
    # issue 28: the Kaggle 2×T4 recipe, `%%writefile script.py` then `!torchrun --nproc_per_node 2 script.py`
    # (a course's data-parallel practice: a hand-written all-reduce loop, then DDP, each launched so)
    "mryab/efficient-dl-systems": ["week03_data_parallel/practice.ipynb"],
    # issue 28: SAM fine-tuned in its own repository's style: the optimizer over the mask decoder, the
    # training calling sam_model.image_encoder/prompt_encoder/mask_decoder and never sam_model(…)
    "encord-team/encord-notebooks": ["notebooks/Encord_Notebooks_How_To_Fine_Tuning_SAM.ipynb"],
    # a Kaggle TPU notebook (torch_xla, xmp.spawn): refused before anything runs (issue 39)
    "pytorch/xla": ["contrib/kaggle/distributed-pytorch-xla-basics-with-pjrt.ipynb"],
    # issue 39: the two-GPU notebook idiom `if torch.cuda.device_count() > 1: clf = nn.DataParallel(clf)` with
    # `cuda:0`, a SummaryWriter and an MLflow run around a plain loop
    "sbercloud-ai/aicloud-examples": ["quick-start/notebooks_gpu/pytorch_tensorboard_mlflow.ipynb"],
}
#: More notebooks of a repository above, taken at its commit there (issue 28's TensorFlow and Flax ones).
PATHS["huggingface/notebooks"] += ["examples/text_classification-tf.ipynb", "examples/text_classification_flax.ipynb"]

#: Python modules a notebook imports from its own folder, and scripts and recipes its shell lines run, taken
#: byte for byte (the runnable copies put them next to the notebook).
MODULES = {
    "rasbt/LLMs-from-scratch": ["ch06/01_main-chapter-code/previous_chapters.py"],
    # issue 28: the training script and recipe fine-tune-llms-in-2025's `!python scripts/run_sft.py --config …`
    # runs, and the script its post cell runs (the runnable copy runs them, launched)
    "philschmid/deep-learning-pytorch-huggingface": ["training/scripts/run_sft.py",
                                                     "training/receipes/llama-3-1-8b-qlora.yaml",
                                                     "training/scripts/merge_adapter_weights.py"],
}

#: Style tags read from the code cells.
TAG_PATTERNS = {
    "hf_trainer": r"\b(Seq2Seq)?Trainer\(",
    "trl_sft": r"\bSFTTrainer\(",
    "trl_grpo": r"\bGRPOTrainer\(",
    "trl_dpo": r"\bDPOTrainer\(",
    "accelerate_loop": r"\bAccelerator\(",
    "notebook_launcher": r"\bnotebook_launcher\(",
    "plain_loop": r"\bloss\w*\.backward\(",
    "peft": r"\bget_peft_model\(|\bPeftModel\b",
    "quantized": r"BitsAndBytesConfig|load_in_[48]bit",
    "audio": r"[Ww]av2[Vv]ec2|[Ww]hisper|\baudio\b",
    "vision": r"Image|[Vv]i[Tt]|\bVL\b|[Vv]ision|torchvision",
    "unsloth": r"\bfrom unsloth\b|\bimport unsloth\b",
    "colab_form": r"#\s*@(title|param|markdown)",
    "shell": r"(?m)^\s*!",
    "cell_magic": r"(?m)^%%",
    "shell_launch": r"(?m)^\s*!.*\b(torchrun|deepspeed|accelerate launch|python \S+\.py)\b",
    "loader_factory": None,  # computed by loader_factory()
    "save_then_load": None,  # computed by save_then_load()
}

#: Tags a pattern cannot see, given by reading the notebook.
EXTRA_TAGS = {
    "peft/multilayer_perceptron_lora.ipynb": ["two_models"],
    "pytorch_dl/02_pytorch_classification.ipynb": ["two_models"],
    "pytorch_dl/03_pytorch_computer_vision.ipynb": ["two_models"],
    "pytorch_dl/04_pytorch_custom_datasets.ipynb": ["two_models"],
    "pytorch_dl/07_pytorch_experiment_tracking.ipynb": ["two_models", "helper_import"],
    "pytorch_dl/06_pytorch_transfer_learning.ipynb": ["helper_import"],
    "pytorch_dl/08_pytorch_paper_replicating.ipynb": ["helper_import"],
    "pytorch_dl/09_pytorch_model_deployment.ipynb": ["two_models", "helper_import"],
}


#: An image inlined in markdown as base64 (up to megabytes): its data is dropped, the ``data:…;base64,`` kept.
INLINE_IMAGE = re.compile(r"(data:image/[\w.+-]+;base64,)[A-Za-z0-9+/=\s]+")


def git_show(mirrors: Path, repo: str, commit: str, path: str) -> bytes:
    git_dir = mirrors / repo.replace("/", "+") / "repo"
    return subprocess.run(["git", "-C", str(git_dir), "show", f"{commit}:{path}"], check=True,
                          capture_output=True).stdout


def git_ls(mirrors: Path, repo: str, commit: str, folder: str) -> list[str]:
    git_dir = mirrors / repo.replace("/", "+") / "repo"
    out = subprocess.run(["git", "-C", str(git_dir), "ls-tree", "-r", "--name-only", commit, folder],
                         check=True, capture_output=True, text=True).stdout
    return sorted(p for p in out.splitlines() if p.endswith(".ipynb"))


def strip(nb: dict, *, markdown: bool) -> dict:
    """The notebook with code outputs dropped (and markdown text, unless ``markdown``); all else as is."""
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
        elif cell.get("cell_type") == "markdown" and not markdown:
            cell["source"] = ""
            cell.pop("attachments", None)
        elif cell.get("cell_type") == "markdown":
            source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            cell["source"] = INLINE_IMAGE.sub(r"\1", source)
            cell.pop("attachments", None)
    if markdown:  # the compact collection keeps its metadata whole
        nb.get("metadata", {}).pop("widgets", None)
    return nb


def dump(nb: dict) -> bytes:
    return (json.dumps(nb, indent=1, ensure_ascii=False) + "\n").encode()


def code_of(nb: dict) -> str:
    return "\n".join(
        "".join(c["source"]) if isinstance(c["source"], list) else c["source"]
        for c in nb.get("cells", []) if c.get("cell_type") == "code"
    )


def save_then_load(code: str) -> bool:
    """A model or file saved to a literal path that a later line loads again."""
    for m in re.finditer(r"(?:save_pretrained|torch\.save\([^,]+,|save_model)\(?\s*([\"'][^\"']+[\"'])", code):
        if re.search(r"(from_pretrained|torch\.load)\(\s*" + re.escape(m.group(1)), code[m.end():]):
            return True
    return False


def loader_factory(code: str) -> bool:
    """A function whose body builds a DataLoader (a loader factory)."""
    for m in re.finditer(r"(?m)^def \w+\(.*$", code):
        body = re.match(r"(?:\n(?:[ \t]+[^\n]*|[ \t]*))*", code[m.end():]).group(0)
        if "DataLoader(" in body:
            return True
    return False


def tags_for(key: str, nb: dict) -> list[str]:
    code = code_of(nb)
    tags = [t for t, p in TAG_PATTERNS.items() if p and re.search(p, code)]
    if save_then_load(code):
        tags.append("save_then_load")
    if loader_factory(code):
        tags.append("loader_factory")
    return sorted(set(tags + EXTRA_TAGS.get(key, [])))


def name_for(path: str) -> str:
    parts = Path(path).with_suffix("").parts
    if parts[0] == "course":
        return "course_" + "_".join(parts[-2:])
    if parts[-2:-1] == ("accelerate_examples",):
        return "accelerate_" + parts[-1]
    return parts[-1].replace(" - ", "_").replace(" ", "_")  # "4 - Transformers" → 4_Transformers


def collect(mirrors: Path) -> list[dict]:
    manifest = []
    for repo, paths in PATHS.items():
        folder, licence, commit = REPOS[repo]
        (HERE / folder).mkdir(exist_ok=True)
        for path in paths:
            try:
                nb = strip(json.loads(git_show(mirrors, repo, commit, path)), markdown=True)
            except subprocess.CalledProcessError:  # a snapshot may leave its largest files out
                print(f"skipped {repo}:{path}: not in the snapshot")
                continue
            key = f"{folder}/{name_for(path)}.ipynb"
            (HERE / key).write_bytes(dump(nb))
            manifest.append({"file": key, "repository": repo, "path": path, "commit": commit, "license": licence,
                             "outputs": "dropped",
                             "markdown": "kept; attachments and inline image data dropped",
                             "tags": tags_for(key, nb)})
        for path in MODULES.get(repo, []):
            key = f"{folder}/{Path(path).name}"
            (HERE / key).write_bytes(git_show(mirrors, repo, commit, path))
            manifest.append({"file": key, "repository": repo, "path": path, "commit": commit, "license": licence})
    return manifest


def collect_unsloth(mirrors: Path) -> list[dict]:
    repo, licence, commit = UNSLOTH
    out = io.BytesIO()
    entries = []
    with tarfile.open(fileobj=out, mode="w:xz", preset=9) as tar:
        for path in git_ls(mirrors, repo, commit, "nb"):
            nb = json.loads(git_show(mirrors, repo, commit, path))
            data = dump(strip(nb, markdown=False))
            info = tarfile.TarInfo(path)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))
            entries.append({"file": f"unsloth_nb.tar.xz:{path}", "tags": tags_for(path, nb)})
    (HERE / "unsloth_nb.tar.xz").write_bytes(out.getvalue())
    return [{"file": "unsloth_nb.tar.xz", "repository": repo, "path": "nb/*.ipynb", "commit": commit,
             "license": licence, "outputs": "dropped", "markdown": "kept as cells with empty source",
             "notebooks": len(entries), "tags": sorted({t for e in entries for t in e["tags"]})}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mirrors", type=Path, required=True, help="folder of owner+name/repo git snapshots")
    args = parser.parse_args()
    manifest = collect(args.mirrors) + collect_unsloth(args.mirrors)
    (HERE / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    main()
