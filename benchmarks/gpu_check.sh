#!/usr/bin/env bash
# One-shot GPU check for a CUDA machine (about 5 minutes on one H100/H200):
#   1. the `cuda` tests (pytest -m cuda): bf16/fp16 steps, NCCL collectives, SyncBN under DDP,
#      a GPU checkpoint resumed on CPU and exported, DataParallel under bf16;
#   2. benchmarks/gpu_throughput.py: samples/s of configs/cnn.yaml and configs/conformer.yaml at
#      fp32 / bf16 / fp16, synthetic batches and the real npy loader, peak GPU memory;
#   3. with 2+ GPUs: a 2-rank NCCL DDP training with SyncBN, cross-rank mining and the
#      per-step parameter-consistency check.
# Prints a PASS/FAIL line per check and a summary; exit status 1 if any check failed.
#
#   benchmarks/gpu_check.sh                 # uses .venv/bin/python, else python3
#   PYTHON=/opt/torch/.venv/bin/python3 benchmarks/gpu_check.sh
#   GPU_CHECK_STEPS=10 benchmarks/gpu_check.sh   # shorter throughput runs
set -uo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
    if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
STEPS="${GPU_CHECK_STEPS:-30}"
WORK="$(mktemp -d /tmp/audioclf_gpu_check.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
declare -a SUMMARY=()
FAILED=0

record() {  # record NAME STATUS DETAIL
    SUMMARY+=("$(printf '%-34s %-4s %s' "$1" "$2" "$3")")
    echo "$2 $1${3:+: $3}"
    if [[ "$2" == FAIL ]]; then FAILED=1; fi
}

missing="$("$PY" - <<'EOF'
import importlib.util
need = ["torch", "torchaudio", "numpy", "pandas", "soundfile", "pytorch_metric_learning",
        "sklearn", "yaml", "tqdm", "pyarrow", "openpyxl", "pytest", "hypothesis"]
print(" ".join(n for n in need if importlib.util.find_spec(n) is None))
EOF
)"
if [[ -n "$missing" ]]; then
    echo "gpu_check: $PY lacks: $missing (pip install -r requirements-dev.txt, or install their wheels)"
    exit 2
fi
gpus="$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')"
if [[ "$gpus" == 0 ]]; then
    echo "gpu_check: no CUDA device visible to $PY; run this on a GPU machine"
    exit 2
fi
echo "== $("$PY" -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0))'), $gpus GPU(s)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true

echo "== 1. cuda tests"
if "$PY" -m pytest -m cuda -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$WORK/pytest.log"; then
    record "cuda tests" PASS "$(tail -n 1 "$WORK/pytest.log")"
else
    record "cuda tests" FAIL "$(tail -n 1 "$WORK/pytest.log")"
fi

echo "== 2. throughput (samples/s, $STEPS timed steps per cell)"
"$PY" benchmarks/gpu_throughput.py --steps "$STEPS" 2>&1 | tee "$WORK/throughput.log"
while read -r status rest; do
    record "throughput: ${rest%% (*}" "$status" "${rest#*= }"
done < <(grep -E '^(PASS|FAIL) ' "$WORK/throughput.log")
grep -qE '^(PASS|FAIL) ' "$WORK/throughput.log" || record "throughput" FAIL "no result (see above)"

echo "== 3. 2-rank NCCL DDP"
if [[ "$gpus" -ge 2 ]]; then
    "$PY" -m audioclf.data.demo --out "$WORK/demo" --classes 16 --items 4 --ids 4 --features >/dev/null
    if "$PY" -m torch.distributed.run --standalone --nproc_per_node 2 -m audioclf.train \
        --config configs/cnn.yaml data.index="$WORK/demo/index_features.xlsx" data.num_workers=2 \
        sampler.batch_size=16 model.cnn.width=16 clips.crop_seconds=1.0 train.epochs=2 \
        model.sync_bn=true loss.cross_rank=true train.consistency_every_steps=1 \
        train.precision=bf16 optim.warmup_steps=0 eval.distributed=true checkpoint.every_steps=0 \
        checkpoint.resume='' train.runs_dir="$WORK/runs" train.name=ddp > "$WORK/ddp.log" 2>&1 \
        && grep -q "SyncBatchNorm" "$WORK/runs/ddp/train.log"; then
        record "2-rank NCCL DDP (SyncBN, cross-rank)" PASS "$(grep 'epoch 2/2' "$WORK/runs/ddp/train.log" | tail -n 1 | cut -c21-)"
    else
        tail -n 20 "$WORK/ddp.log"
        record "2-rank NCCL DDP (SyncBN, cross-rank)" FAIL "see the log above"
    fi
else
    record "2-rank NCCL DDP (SyncBN, cross-rank)" SKIP "needs 2 GPUs ($gpus visible)"
fi

echo
echo "== summary"
printf '%s\n' "${SUMMARY[@]}"
exit "$FAILED"
