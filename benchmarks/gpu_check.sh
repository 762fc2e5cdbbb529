#!/usr/bin/env bash
# One-shot check of a CUDA machine, offline: an estimated 6 minutes on one H100/H200 with 16
# cores, 8 at most (GPU_CHECK_BUDGET=480 s: each step's time limit is cut to what is left), so
# it fits a machine lent for 10 minutes with the wheels' install.
#   preflight (~10 s): every module imports (a missing one is named with its wheel), torch at
#      requirements.txt's floor, a GPU visible;
#   cuda tests (pytest -m cuda tests/project/test_cuda.py tests/search/test_search.py; ~1-2 min): bf16/fp16
#      steps, NCCL collectives, SyncBN under DDP, a GPU checkpoint resumed on CPU and exported,
#      exact search on the GPU against the CPU's (after trainings in the same process: each
#      puts back the TF32 and autotuning flags it found);
#   throughput (benchmarks/gpu_throughput.py; ~2.5 min): samples/s of configs/cnn.yaml and
#      configs/conformer.yaml at fp32 (IEEE, train.tf32=false) / tf32 / bf16 / fp16 on synthetic
#      batches, the real .npy loader and a feature pack of the same files (+pack) at the auto
#      precision, peak GPU memory, a cnn cell with train.compile=true (its compilation in the
#      warm-up steps); targets: conformer bf16 >= 1.8x IEEE fp32, each loader keeps the GPU
#      >= 90 % busy; bf16 is SKIP on a GPU without native bfloat16;
#   ddp (~1 min): audioclf.train under torchrun with NCCL, 1 rank (2 with 2+ GPUs), on the demo
#      features: SyncBN, cross-rank mining, the parameter-consistency check every step, the EMA,
#      validation every epoch, last.pt, then a second run that resumes it for one more epoch
#      (checked in train.log and metrics.csv); precision auto (bf16, or fp16 on older GPUs).
#      (dist.strategy=ddp keeps the process group at WORLD_SIZE=1 under torchrun);
#   cpu tests (pytest -m "not slow and not cuda", the fast tier: 6 min of one 2-core VM's CPU,
#      in 4 shards started before the GPU steps, beside them): the CPU suite on a GPU machine.
# Each check prints `PASS|FAIL|SKIP <name>: <detail>`; the summary repeats them at the end.
# Exit status 0; 1 if a check failed; 2 if the check could not start.
#
#   benchmarks/gpu_check.sh                                  # .venv/bin/python, else python3
#   PYTHON=python3 benchmarks/gpu_check.sh --wheels /path/wheels   # an offline machine
#   GPU_CHECK_STEPS=10 benchmarks/gpu_check.sh               # shorter throughput runs
#   benchmarks/gpu_check.sh --cpu-smoke                      # on a CPU, tiny (~2 min on 2 cores)
#
# --wheels DIR installs DIR/*.whl (from benchmarks/gpu_wheels.sh) offline into a temporary
# folder put first on PYTHONPATH for this run; the machine's own packages are not touched.
# --cpu-smoke: the preflight without a GPU, then throughput and ddp on the CPU with tiny models
# (ddp: 2 gloo ranks, each run limited to 180 s instead of 90: a run of ~9 s took over 90 once
# in a CI run, beside the rest of the suite); the pytest steps are SKIP.
# tests/project/test_gpu_scripts.py runs it.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

die() { echo "gpu_check: $*" >&2; exit 2; }
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

WHEELS="" SMOKE=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --wheels) [[ $# -ge 2 ]] || die "--wheels needs a folder"; WHEELS="$2"; shift 2 ;;
        --cpu-smoke) SMOKE=1; shift ;;
        *) die "unknown argument $1 (see --help)" ;;
    esac
done
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
    if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
command -v "$PY" >/dev/null || die "$PY not found; set PYTHON=/path/to/python3"
STEPS="${GPU_CHECK_STEPS:-$([[ $SMOKE == 1 ]] && echo 2 || echo 30)}"
BUDGET="${GPU_CHECK_BUDGET:-480}"
CPU_SHARDS=4
WORK="$(mktemp -d "${TMPDIR:-/tmp}/audioclf_gpu_check.XXXXXX")"
declare -a SHARD_PIDS=()
cleanup() {
    local pid
    for pid in "${SHARD_PIDS[@]}"; do kill "$pid" 2>/dev/null; done  # timeout passes it on
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM  # through the EXIT trap: the shards and the work folder go too
declare -a SUMMARY=()
FAILED=0

record() {  # record STATUS NAME DETAIL
    SUMMARY+=("$(printf '%-4s %-36s %s' "$1" "$2" "$3")")
    echo "$1 $2: $3"
    if [[ "$1" == FAIL ]]; then FAILED=1; fi
}

time_left() {  # time_left WANT_S: WANT_S, or what the budget still allows (at least 5)
    local left=$((BUDGET - SECONDS - 10))
    ((left < $1)) || left=$1
    ((left > 5)) || left=5
    echo "$left"
}

last_line() {  # last_line LOG: its last non-empty line, shortened
    grep -v '^[[:space:]]*$' "$1" | tail -n 1 | cut -c1-160
}

install_wheels() {  # install_wheels DIR: into $WORK/site, first on PYTHONPATH
    local wheels=("$1"/*.whl)
    [[ -e "${wheels[0]}" ]] || die "--wheels $1 holds no .whl files (benchmarks/gpu_wheels.sh $1 fetches them)"
    if "$PY" -m pip --version >/dev/null 2>&1; then
        "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
            --target "$WORK/site" "${wheels[@]}" \
            || die "could not install the wheels of $1 (above); for $PY fetch them with benchmarks/gpu_wheels.sh DIR --python $("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
    else  # no pip: a wheel is a zip of what goes into site-packages
        echo "gpu_check: $PY has no pip; unpacking the wheels of $1 instead"
        local wheel
        for wheel in "${wheels[@]}"; do
            "$PY" -m zipfile -e "$wheel" "$WORK/site" || die "could not unpack $wheel"
        done
    fi
    export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
    echo "gpu_check: ${#wheels[@]} wheels from $1 in $WORK/site (on PYTHONPATH for this run)"
}

# ------------------------------------------------------------------------------ pytest steps

check_cuda_tests() {  # PASS needs a test that passed: skipped cuda tests check nothing
    local log="$WORK/cuda_tests.log" limit rc passed
    limit="$(time_left 180)"
    timeout -k 10 "$limit" "$PY" -m pytest -q -p no:cacheprovider --basetemp="$WORK/cuda_tmp" \
        -m cuda tests/project/test_cuda.py tests/search/test_search.py > "$log" 2>&1
    rc=$?
    tail -n 15 "$log"
    passed="$(grep -oE '[0-9]+ passed' "$log" | tail -n 1 | cut -d' ' -f1)"
    if [[ $rc == 0 && ${passed:-0} -gt 0 ]]; then
        record PASS "cuda tests" "$(last_line "$log")"
    elif [[ $rc == 0 || $rc == 5 ]]; then
        record FAIL "cuda tests" "none passed: $(last_line "$log")"
    elif [[ $rc == 124 || $rc == 137 ]]; then
        record FAIL "cuda tests" "stopped after $limit s: $(last_line "$log")"
    else
        record FAIL "cuda tests" "$(last_line "$log")"
    fi
}

start_cpu_tests() {  # the fast tier in CPU_SHARDS background shards of test files, niced
    local files limit shard i
    mapfile -t files < <(find tests -name 'test_*.py' | sort)
    limit="$(time_left 420)"
    for ((shard = 0; shard < CPU_SHARDS; shard++)); do
        local mine=()
        for ((i = shard; i < ${#files[@]}; i += CPU_SHARDS)); do mine+=("${files[i]}"); done
        timeout -k 10 "$limit" nice "$PY" -m pytest -q -p no:cacheprovider \
            --basetemp="$WORK/cpu$shard" -m "not slow and not cuda" "${mine[@]}" \
            > "$WORK/cpu$shard.log" 2>&1 &
        SHARD_PIDS+=($!)
    done
    echo "gpu_check: the cpu tests run in $CPU_SHARDS shards beside the GPU steps (limit $limit s)"
}

check_cpu_tests() {  # wait for the shards; one line for all of them
    local shard rc passed=0 count bad=()
    for ((shard = 0; shard < CPU_SHARDS; shard++)); do
        wait "${SHARD_PIDS[shard]}"
        rc=$?
        count="$(grep -oE '[0-9]+ passed' "$WORK/cpu$shard.log" | tail -n 1 | cut -d' ' -f1)"
        passed=$((passed + ${count:-0}))
        if [[ $rc != 0 && $rc != 5 ]]; then  # 5: every test of the shard's files deselected
            tail -n 25 "$WORK/cpu$shard.log"
            bad+=("shard $shard exit $rc$( ((rc == 124 || rc == 137)) && echo ' (time limit)'): $(last_line "$WORK/cpu$shard.log")")
        fi
    done
    SHARD_PIDS=()
    if [[ ${#bad[@]} -eq 0 && $passed -gt 0 ]]; then
        record PASS "cpu tests" "$passed passed in $CPU_SHARDS shards (-m \"not slow and not cuda\")"
    else
        record FAIL "cpu tests" "$passed passed; ${bad[*]:-no test ran}"
    fi
}

# ------------------------------------------------------------------------------ throughput

check_throughput() {  # the table; its PASS/FAIL/SKIP lines are recorded as they are
    local log="$WORK/throughput.log" device=cuda limit rc status rest
    local -a extra=()
    if [[ $SMOKE == 1 ]]; then
        device=cpu
        extra=(--files 256 --set sampler.batch_size=8 sampler.m=2 data.num_workers=1
            clips.crop_seconds=0.5 model.embedding_dim=16 model.cnn.width=8 model.cnn.depth=2
            model.conformer.d_model=32 model.conformer.num_heads=2 model.conformer.ffn_dim=64
            model.conformer.num_layers=1 model.conformer.kernel_size=7)
    fi
    limit="$(time_left 240)"
    timeout -k 10 "$limit" "$PY" benchmarks/gpu_throughput.py --device "$device" \
        --steps "$STEPS" "${extra[@]}" > "$log" 2>&1
    rc=$?
    grep -vE '^(PASS|FAIL|SKIP) ' "$log" | tail -n 40
    while read -r status rest; do
        record "$status" "throughput ${rest%%: *}" "${rest#*: }"
    done < <(grep -E '^(PASS|FAIL|SKIP) ' "$log")
    if ! grep -q '^gpu_throughput: ' "$log"; then
        record FAIL throughput "no result line (exit status $rc, limit $limit s; see above)"
    fi
}

# ------------------------------------------------------------------------------ ddp

ddp_train() {  # ddp_train NPROC DEVICE BACKEND EPOCHS: one torchrun into $WORK/runs/ddp
    local limit  # --cpu-smoke: 2 gloo ranks on what may be a 2-core machine running tests beside
    limit="$(time_left $((SMOKE == 1 ? 180 : 90)))"
    timeout -k 20 "$limit" "$PY" -m torch.distributed.run --standalone --nproc_per_node "$1" \
        -m audioclf.train --config configs/cnn.yaml \
        data.index="$WORK/demo/index_features.xlsx" data.num_workers=2 sampler.batch_size=16 \
        model.cnn.width=16 model.cnn.depth=3 model.embedding_dim=64 clips.crop_seconds=1.0 \
        model.sync_bn=true loss.cross_rank=true train.consistency_every_steps=1 \
        train.ema_decay=0.99 train.precision=auto train.device="$2" dist.strategy=ddp \
        dist.backend="$3" optim.warmup_steps=0 eval.every=1 eval.distributed=true \
        checkpoint.every_steps=0 checkpoint.resume=auto train.epochs="$4" \
        train.runs_dir="$WORK/runs" train.name=ddp >> "$WORK/ddp.log" 2>&1
}

lacks() {  # lacks WHAT PATTERN: add WHAT to LACKS when train.log has no line matching PATTERN
    grep -qE -- "$2" "$WORK/runs/ddp/train.log" 2>/dev/null || LACKS+=("$1")
}

record_lacks() {  # record_lacks NAME PASS_DETAIL: PASS, or FAIL naming what LACKS holds
    if [[ ${#LACKS[@]} -eq 0 ]]; then
        record PASS "$1" "$2"
    else
        record FAIL "$1" "missing: $(printf '%s; ' "${LACKS[@]}" | sed 's/; $//')"
    fi
}

check_ddp() {  # two lines: the distributed set-up, and the training with its resume
    local nproc=1 device=cuda backend=nccl bn="SyncBatchNorm: BatchNorm layers synchronised"
    if [[ $SMOKE == 1 ]]; then
        nproc=2 device=cpu backend=gloo bn="SyncBatchNorm needs CUDA"
    elif [[ $GPUS -ge 2 ]]; then
        nproc=2
    fi
    local name="ddp $nproc rank(s) $backend" log="$WORK/runs/ddp/train.log" seen rows
    if ! "$PY" -m audioclf.data.demo --out "$WORK/demo" --classes 16 --items 4 --ids 4 \
        --features > "$WORK/ddp.log" 2>&1; then
        tail -n 20 "$WORK/ddp.log"
        record FAIL "$name" "the demo data could not be generated (above)"
        return
    fi
    local -a runs=()
    ddp_train "$nproc" "$device" "$backend" 1 || runs+=("run 1 exit status $?")
    if [[ -f "$WORK/runs/ddp/last.pt" ]]; then  # epoch 1 saved: run 2 resumes it
        ddp_train "$nproc" "$device" "$backend" 2 || runs+=("run 2 exit status $?")
    fi
    [[ ${#runs[@]} -eq 0 ]] || tail -n 30 "$WORK/ddp.log"

    LACKS=("${runs[@]}")
    lacks "'rank 0 of $nproc, ddp'" "\(rank 0 of $nproc, ddp, device $device"
    lacks "'$bn'" "$bn"
    seen="$(grep -oE 'rank 0 of [0-9]+, [a-z]+, device [a-z0-9:]+' "$log" 2>/dev/null | head -n 1)"
    if [[ ${#LACKS[@]} -gt 0 ]]; then
        LACKS+=("train.log says: ${seen:-no run directory line}")
        if [[ "$seen" == *", single,"* ]]; then
            LACKS+=("audioclf.distributed.setup ran dist.strategy=ddp at WORLD_SIZE=$nproc as one process without a process group, so $backend was not exercised")
        fi
    fi
    record_lacks "$name" "$seen; $(grep -oE "${bn}[^;(]*" "$log" | head -n 1)"

    LACKS=("${runs[@]}")
    lacks "the EMA" "train\.ema_decay=0\.99: an EMA of the weights is kept"
    lacks "a validated epoch 1/1" "epoch 1/1: loss .*map_at_r="
    lacks "'resumed from .../last.pt at epoch 1'" "resumed from .*/last\.pt at epoch 1,"
    lacks "a validated epoch 2/2" "epoch 2/2: loss .*map_at_r="
    rows="$(tail -n +2 "$WORK/runs/ddp/metrics.csv" 2>/dev/null | cut -d, -f1 | tr '\n' ' ')"
    [[ "$rows" == "1 2 " ]] || LACKS+=("metrics.csv rows of epochs 1 and 2 (has: ${rows:-none})")
    if grep -qE " (ERROR|CRITICAL) |Traceback" "$log" 2>/dev/null; then
        LACKS+=("a train.log without errors")
    fi
    record_lacks "train and resume" "$(grep -oE 'epoch 2/2: loss [0-9.]+.*map_at_r=[0-9.]+' "$log" \
        | head -n 1 | sed 's|^epoch 2/2: ||') in epoch 2 after a resume at epoch 1 (EMA, consistency every step)"
}

# ------------------------------------------------------------------------------ the check

if [[ -n "$WHEELS" ]]; then install_wheels "$WHEELS"; fi
preflight=()
[[ $SMOKE == 1 ]] && preflight=(--cpu)
"$PY" benchmarks/gpu_preflight.py "${preflight[@]}" || exit 2
GPUS=0
if [[ $SMOKE == 1 ]]; then
    echo "== CPU smoke: throughput and ddp on the CPU with tiny models; no GPU is checked"
else
    GPUS="$("$PY" -c 'import torch; print(torch.cuda.device_count())')"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
    start_cpu_tests
fi

echo "== cuda tests"
if [[ $SMOKE == 1 ]]; then record SKIP "cuda tests" "--cpu-smoke"; else check_cuda_tests; fi

echo "== throughput ($STEPS timed steps per cell)"
check_throughput

echo "== ddp training and its resume"
check_ddp

echo "== cpu tests (the fast tier, on this machine)"
if [[ $SMOKE == 1 ]]; then
    record SKIP "cpu tests" "--cpu-smoke (the suite itself is the CPU tier)"
else
    check_cpu_tests
fi

echo
echo "== summary ($SECONDS s)"
printf '%s\n' "${SUMMARY[@]}"
exit "$FAILED"
