#!/usr/bin/env bash
# The GPU half of the kept-job and fresh-job benchmarks, in one device call (one GPU is enough):
#   1. a random-weight Qwen2.5-0.5B shape saved to disk (benchmarks/varlen_workload.py), which Unsloth loads in 4 bits;
#   2. benchmarks/job_overhead.py --gpu: `nbddp run --nproc 1` of a notebook training it with real Unsloth (30 steps)
#      against plain `torchrun --nproc_per_node=1` of the same code as a script;
#   3. benchmarks/kept_cells.py --gpu: start, a %%ddp print cell, kept training cells and a fresh %%ddp_train.
# On the device machine (carry .gpu, built by ../shared/tools/gpu-wheels --unsloth):
#   tar -xJf .gpu/site.tar.xz -C /tmp && export PYTHONPATH=$PWD/src:/tmp/site312 HF_HUB_OFFLINE=1 &&
#   bash benchmarks/gpu_kept_and_overhead.sh $OUT      (ONLY_OVERHEAD=1: the fresh-job comparison alone)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results}; mkdir -p "$out"
work=$(mktemp -d)
model=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import varlen_workload as v; print(v.prepare_checkpoint('$work/qwen05b'))")
python3 - "$work" "$model" <<'EOF'
import sys
from pathlib import Path

import nbformat

sys.path.insert(0, "benchmarks")
from kept_cells import SETUP_GPU  # the same job the kept benchmark keeps

work, model = Path(sys.argv[1]), sys.argv[2]
code = SETUP_GPU.format(model=model).split("\n", 1)[1]  # without its %%ddp_setup line
nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code), nbformat.v4.new_code_cell("trainer.train()")])
nbformat.write(nb, work / "unsloth_30_steps.ipynb")
(work / "unsloth_30_steps.py").write_text(code + "\ntrainer.train()\n")
EOF
python3 -m ipykernel install --user --name python3 >/dev/null 2>&1 || true
python3 benchmarks/job_overhead.py --gpu "$work/unsloth_30_steps.ipynb" --plain "$work/unsloth_30_steps.py" \
  --repeat "${REPEAT:-1}" --out "$out"
[ -n "${ONLY_OVERHEAD:-}" ] || python3 benchmarks/kept_cells.py --gpu "$model" --out "$out"
