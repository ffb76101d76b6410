#!/usr/bin/env bash
# Every GPU proof in one go, on a machine with GPUs (the device machine, a Kaggle T4 x2 box).
# Prints PASS/FAIL/SKIP per check and a summary; writes each check's log to $LOGS (default ./gpu-logs).
# A check that needs more GPUs than the machine has (NEEDS below) is SKIP without running: on one GPU every
# check one GPU can show passes or fails on its own merits. NGPU overrides the count torch gives (the test
# suite runs the SKIP logic on CPU with it); CHECKS picks checks. Exit status 1 when a check failed.
#   quickstart   nbddp run notebooks/quickstart.ipynb on every GPU (nccl): trains, loss falls, adapter once
#   magic        tests/gpu/check_magics.py: notebooks/magics.ipynb in a real kernel (nbclient), %%ddp_train on every GPU
#   ckpt         the checkpointing shim on GPUs: the two DDP failures reproduced with it off, fixed with it on
#   t4-fp16      precision as on a T4: bf16 refused, fp16 with a GradScaler, the quickstart trains, loss falls
#   templates    tests/gpu/prove_templates_and_export.py: QLoRA 4-bit template via papermill + Kaggle export
#   each-template  tests/gpu/prove_each_template.py: every template via `nbddp run` and `%ddp_train` in a kernel
#   forked       tests/gpu/check_forked_ranks.py: with GPUs, ranks forked from torchrun's process join NCCL, each on its GPU
#   loopback     tests/gpu/check_loopback.py: the quickstart's job listens on loopback only (stores, NCCL's bootstrap)
#   kaggle-idioms  tests/gpu/prove_kaggle_idioms.py: DataParallel and f"cuda:{gpu}" notebooks via `nbddp run` and
#                `%%ddp_train`, each rank on its own GPU, samples shared, replicas equal, files once
#   pipeline-dataset  tests/gpu/prove_pipeline_dataset.py: `for out in pipe(KeyDataset(ds, "text"))` split over the
#                GPUs by `nbddp run`, each rank's pipeline on its card, preds.csv byte for byte one process's
#   unsloth      tests/gpu/prove_unsloth.py: Unsloth's Kaggle Alpaca notebook via `nbddp run` and `%%ddp_train`
#                (SKIP without Unsloth: on the device machine, tar -xJf .gpu/site.tar.xz -C /tmp first)
set -u
cd "$(dirname "$0")/../.."
LOGS=${LOGS:-gpu-logs}; mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 NBDDP_CACHE=${NBDDP_CACHE:-/tmp/nbddp-cache}
NGPU=${NGPU:-$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)}
# GPUs each check needs: DDP across GPUs (ckpt), the 2-GPU template and export proofs; the rest run on one
declare -A NEEDS=([quickstart]=1 [magic]=1 [ckpt]=2 [t4-fp16]=1 [templates]=2 [each-template]=2 [forked]=1 [loopback]=1 [kaggle-idioms]=2 [pipeline-dataset]=2 [unsloth]=1)
declare -a RESULTS
check() {  # name, command...
  local name=$1; shift
  if [ "$NGPU" -lt "${NEEDS[$name]:-1}" ]; then
    RESULTS+=("SKIP $name (needs ${NEEDS[$name]:-1} GPU(s), this machine has $NGPU)"); echo "${RESULTS[-1]}"; return
  fi
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
  python3 tests/gpu/check_magics.py --backend nccl
}
ckpt() { python3 -m pytest -q -p no:cacheprovider tests/test_grad_ckpt.py; }
t4_fp16() {  # NBDDP_ASSUME_CC makes the precision shim decide as on a compute-capability-7.5 GPU
  NBDDP_ASSUME_CC=7.5 python3 -m nbddp.cli run notebooks/quickstart.ipynb --skip-installs --runs-dir /tmp/gpu-runs || return 1
  grep -q "fp16" "$LOGS/t4-fp16.log" && grep -q "Adapter saved" "$LOGS/t4-fp16.log"
}
templates() { python3 tests/gpu/prove_templates_and_export.py; }
each_template() {
  python3 -m ipykernel install --user --name python3 >/dev/null 2>&1
  python3 tests/gpu/prove_each_template.py
}
forked() { python3 tests/gpu/check_forked_ranks.py --nproc "$NGPU"; }
loopback() { python3 tests/gpu/check_loopback.py; }
kaggle_idioms() {
  python3 -m ipykernel install --user --name python3 >/dev/null 2>&1
  python3 tests/gpu/prove_kaggle_idioms.py
}
pipeline_dataset() { python3 tests/gpu/prove_pipeline_dataset.py; }
unsloth() { python3 tests/gpu/prove_unsloth.py --nproc "$NGPU"; }
for c in ${CHECKS:-quickstart magic ckpt t4-fp16 templates each-template forked loopback kaggle-idioms pipeline-dataset unsloth}; do check "$c" "${c//-/_}"; done
printf '%s\n' "== GPU proofs ($NGPU GPU(s))" "${RESULTS[@]}"
! printf '%s\n' "${RESULTS[@]}" | grep -q '^FAIL'
