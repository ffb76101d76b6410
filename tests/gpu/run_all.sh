#!/usr/bin/env bash
# Every GPU proof in one go, on a machine with 2+ GPUs (the device machine, a Kaggle T4 x2 box).
# Prints PASS/FAIL/SKIP per check and a summary; writes each check's log to $LOGS (default ./gpu-logs).
#   quickstart   nbddp run notebooks/quickstart.ipynb on every GPU (nccl): trains, loss falls, adapter once
#   magic        notebooks/magics.ipynb executed in a real kernel (nbclient): %%ddp_train on every GPU
#   ckpt         the checkpointing shim on GPUs: the two DDP failures reproduced with it off, fixed with it on
#   t4-fp16      precision as on a T4: bf16 refused, fp16 with a GradScaler, the quickstart trains, loss falls
#   templates    tests/gpu/prove_templates_and_export.py: QLoRA 4-bit template via papermill + Kaggle export
#   each-template  tests/gpu/prove_each_template.py: every template via `nbddp run` and `%ddp_train` in a kernel
#   unsloth      tests/gpu/prove_unsloth.py: Unsloth's Kaggle Alpaca notebook via `nbddp run` and `%%ddp_train`
#                (SKIP without Unsloth: on the device machine, tar -xJf .gpu/site.tar.xz -C /tmp first)
set -u
cd "$(dirname "$0")/../.."
LOGS=${LOGS:-gpu-logs}; mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 NBDDP_CACHE=${NBDDP_CACHE:-/tmp/nbddp-cache}
declare -a RESULTS
check() {  # name, command...
  local name=$1; shift
  local t0=$SECONDS
  if "$@" >"$LOGS/$name.log" 2>&1; then RESULTS+=("PASS $name ($((SECONDS - t0)) s)")
  else local rc=$?; RESULTS+=("$([ $rc = 2 ] && echo SKIP || echo FAIL) $name ($((SECONDS - t0)) s)"); tail -25 "$LOGS/$name.log"; fi
  echo "${RESULTS[-1]}"
}
quickstart() {
  python3 -m nbddp.cli run notebooks/quickstart.ipynb --skip-installs --runs-dir /tmp/gpu-runs || return 1
  grep -q "backend nccl" "$LOGS/quickstart.log" && grep -q "Adapter saved" "$LOGS/quickstart.log"
}
magic() {
  python3 -m ipykernel install --user --name python3 >/dev/null 2>&1
  python3 - <<'PY'
import nbformat, nbclient, sys
nb = nbformat.read("notebooks/magics.ipynb", 4)
nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": "notebooks"}}).execute()
text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
print(text[-4000:])
ok = "backend nccl" in text and "adapter:" in text
sys.exit(0 if ok else 1)
PY
}
ckpt() { python3 -m pytest -q -p no:cacheprovider tests/test_grad_ckpt.py -k "find_unused or parameters_used_change"; }
t4_fp16() {  # NBDDP_ASSUME_CC makes the precision shim decide as on a compute-capability-7.5 GPU
  NBDDP_ASSUME_CC=7.5 python3 -m nbddp.cli run notebooks/quickstart.ipynb --skip-installs --runs-dir /tmp/gpu-runs || return 1
  grep -q "fp16" "$LOGS/t4-fp16.log" && grep -q "Adapter saved" "$LOGS/t4-fp16.log"
}
templates() { python3 tests/gpu/prove_templates_and_export.py; }
each_template() {
  python3 -m ipykernel install --user --name python3 >/dev/null 2>&1
  python3 tests/gpu/prove_each_template.py
}
unsloth() { python3 tests/gpu/prove_unsloth.py --nproc "$(python3 -c 'import torch; print(torch.cuda.device_count())')"; }
for c in ${CHECKS:-quickstart magic ckpt t4-fp16 templates each-template unsloth}; do check "$c" "${c//-/_}"; done
printf '%s\n' "== GPU proofs" "${RESULTS[@]}"
