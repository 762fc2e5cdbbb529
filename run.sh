#!/usr/bin/env bash
# audioclf launcher. Every command sets up (or reuses) the virtual environment .venv first.
#
#   ./run.sh demo [--stage N] [--stop-stage N]   generate demo data, train, evaluate, export, embed
#   ./run.sh test [pytest args...]               lint (ruff check + format check, pylint's repeated
#                                                code), then the tests in one worker per core, at
#                                                most 4 (pytest-xdist; -n 0: one process, e.g. for
#                                                --pdb), and the 20 slowest; -m "not slow": the
#                                                fast tier, about a minute
#   ./run.sh [--bg] [--nproc N] CONFIG [key=value ...]   train on N ranks (python -m
#                                                audioclf.train --nproc N: the ranks die with it)
#   ./run.sh stop NAME                           stop a background run started with --bg
#   ./run.sh setup                               only create/refresh .venv
#
# Demo stages: 1 = generate data, 2 = train (2 processes, gloo on CPU / nccl on GPU),
# 3 = offline evaluation, 4 = export, 5 = rank a recording left out of the gallery. A stage that
# is not 1..5 (or a --stop-stage before --stage) is one line on stderr and exit 2.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"

die() { echo "run.sh: $*" >&2; exit 2; }

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

setup_venv() {
    local python="${PYTHON:-python3}"
    command -v "$python" >/dev/null || die "$python not found; install Python 3.10+ or set PYTHON=/path/to/python"
    "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
        || die "audioclf needs Python 3.10 or newer ($("$python" --version) found)"
    if [[ -x "$PY" ]] && ! "$PY" -m pip --version >/dev/null 2>&1; then
        echo "run.sh: .venv is incomplete (an interrupted set-up?): creating it again"
        rm -rf "$VENV"
    fi
    if [[ ! -x "$PY" ]]; then
        echo "run.sh: creating virtual environment .venv"
        "$python" -m venv "$VENV"
    fi
    local stamp="$VENV/.requirements.sha256"
    local want
    want="$(cat requirements.txt requirements-dev.txt | sha256sum | cut -d' ' -f1)"
    if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
        echo "run.sh: installing requirements-dev.txt into .venv (first run takes a few minutes)"
        "$PY" -m pip install --disable-pip-version-check -q -r requirements-dev.txt
        echo "$want" > "$stamp"
    fi
}

run_location() {
    # "<train.name>\t<run dir>" that a config + overrides resolve to (pid and log files go there).
    "$PY" - "$@" <<'PYEOF'
import sys
from pathlib import Path
from audioclf.config import ConfigError, load_config
try:
    cfg = load_config(sys.argv[1], sys.argv[2:]).train
except ConfigError as exc:
    sys.exit(f"run.sh: {exc}")
print(cfg.name, Path(cfg.runs_dir) / cfg.name, sep="\t")
PYEOF
}

stage_number() {
    # stage_number FLAG VALUE: VALUE when it is a demo stage (1..5), else one line and exit 2.
    [[ "$2" =~ ^[1-5]$ ]] || die "demo: $1 takes a stage number from 1 to 5, got '$2'"
    echo "$2"
}

cmd_demo() {
    # The arguments are checked before anything is set up or run.
    local stage=1 stop_stage=5
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --stage|--stop-stage|--stop_stage)
                [[ $# -ge 2 ]] || die "demo: $1 needs a stage number from 1 to 5"
                if [[ "$1" == --stage ]]; then
                    stage="$(stage_number "$1" "$2")" || exit 2
                else
                    stop_stage="$(stage_number "$1" "$2")" || exit 2
                fi
                shift 2 ;;
            *) die "demo: unknown option $1 (use --stage N, --stop-stage N; N from 1 to 5)" ;;
        esac
    done
    [[ $stop_stage -ge $stage ]] \
        || die "demo: --stop-stage $stop_stage is before --stage $stage: nothing would run"
    setup_venv
    local run_dir="runs/demo_cnn"
    if [[ $stage -le 1 && $stop_stage -ge 1 ]]; then
        echo "== stage 1: demo dataset"
        "$PY" -m audioclf.data.demo --out data/demo
    fi
    if [[ $stage -le 2 && $stop_stage -ge 2 ]]; then
        echo "== stage 2: train (2 processes)"
        # resume=auto: a second ./run.sh demo continues (or, when finished, keeps) the run.
        run_foreground runs/demo_cnn "$PY" -m audioclf.train --nproc 2 \
            --config configs/demo_cnn.yaml checkpoint.resume=auto
    fi
    if [[ $stage -le 3 && $stop_stage -ge 3 ]]; then
        echo "== stage 3: offline evaluation"
        "$PY" -m audioclf.evaluate --checkpoint "$run_dir/best.pt" --out "$run_dir/eval"
    fi
    if [[ $stage -le 4 && $stop_stage -ge 4 ]]; then
        echo "== stage 4: export"
        "$PY" -m audioclf.export --checkpoint "$run_dir/best.pt" --format torchscript \
            --out "$run_dir/export/model.pt"
    fi
    if [[ $stage -le 5 && $stop_stage -ge 5 ]]; then
        echo "== stage 5: rank the gallery's classes for the clips of one recording, left out of it"
        "$PY" -m audioclf.embed --model "$run_dir/best.pt" --gallery data/demo/index.xlsx \
            --top 3 --exclude-own-item data/demo/wav/c00/c00_i0/
        echo "(each clip of recording c00_i0 was ranked against the gallery without c00_i0's own"
        echo " clips: the count is how often a new recording of a known class gets its class first;"
        echo " $run_dir/eval/report.md asks the same of every validation clip: cross-item P@1)"
    fi
}

cmd_train() {
    local bg=0 nproc=1
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --bg) bg=1; shift ;;
            --nproc) nproc="$2"; shift 2 ;;
            -h|--help) usage; exit 0 ;;
            *) break ;;
        esac
    done
    [[ $# -ge 1 ]] || die "train: missing CONFIG (e.g. ./run.sh --nproc 4 configs/conformer.yaml)"
    local config="$1"; shift
    [[ -f "$config" ]] || die "config $config not found"
    # audioclf.train's own launcher (torchrun's, as --standalone): its ranks die with it.
    local launch=("$PY" -m audioclf.train --nproc "$nproc" --config "$config" "$@")
    local name run_dir
    IFS=$'\t' read -r name run_dir < <(run_location "$config" "$@") || exit 2
    if [[ $bg -eq 0 ]]; then
        run_foreground "$run_dir" "${launch[@]}"
        exit 0
    fi
    mkdir -p "$run_dir"
    if [[ -f "$run_dir/pid" ]] && alive "$(cat "$run_dir/pid")"; then
        die "run $name is already running (pid $(cat "$run_dir/pid")); ./run.sh stop $name first"
    fi
    # setsid: the job gets its own process group, so `stop` can signal the launcher and its ranks.
    nohup setsid "${launch[@]}" > "$run_dir/nohup.log" 2>&1 < /dev/null &
    echo $! > "$run_dir/pid"
    echo "started $name in the background (pid $(cat "$run_dir/pid"))"
    echo "  follow:  tail -f $run_dir/nohup.log     (rank-0 log: $run_dir/train.log)"
    echo "  stop:    ./run.sh stop $name            (writes last.pt, then exits)"
}

run_foreground() {
    # run_foreground RUN_DIR COMMAND...: the launcher in its own session, so that the terminal's
    # Ctrl-C reaches this script alone. Ctrl-C here (or SIGTERM, or the terminal's SIGHUP) sends
    # the ranks SIGTERM, as ./run.sh stop does: they finish the step, save last.pt and exit; then
    # this exits 130. A second Ctrl-C kills the run at once. The launcher gets SIGTERM when this
    # script dies (setpriv --pdeathsig: a kill -9 too), and its ranks die with it.
    # Without a Ctrl-C it returns the command's status, so the demo goes on to its next stage.
    local run_dir="$1"; shift
    local interrupts=0 status=0 pid log_start
    log_start="$(stat -c %s "$run_dir/train.log" 2>/dev/null || echo 0)"
    local with_us=()
    setpriv --pdeathsig TERM true 2>/dev/null && with_us=(setpriv --pdeathsig TERM --)
    setsid "${with_us[@]}" "$@" &
    pid=$!
    trap 'interrupts=$((interrupts + 1)); interrupt "$pid" "$interrupts"' INT TERM HUP
    while :; do
        wait "$pid" 2>/dev/null && status=0 || status=$?  # 2>/dev/null: no "Killed" notice
        alive "$pid" || break
    done
    trap - INT TERM HUP
    [[ $interrupts -eq 0 ]] && return "$status"  # a failure ends the script (set -e)
    if [[ $interrupts -ge 2 ]]; then
        echo "run.sh: stopped at once by a second Ctrl-C; last.pt is the last one saved; resume" \
             "with checkpoint.resume=auto" >&2
        exit 130
    fi
    local stopped
    stopped="$(tail -c "+$((log_start + 1))" "$run_dir/train.log" 2>/dev/null \
               | grep "stopped on request" | tail -n 1 | sed 's/.*stopped on request at /stopped at /' \
               || true)"  # no such line: stopped before a step finished
    echo "run.sh: ${stopped:-stopped before a step finished; see $run_dir/train.log}" >&2
    exit 130
}

interrupt() {
    # The first Ctrl-C (or SIGTERM) asks the launcher's ranks to stop; the second kills the group.
    if [[ $2 -eq 1 ]]; then
        echo "run.sh: stopping: the workers finish their step and save last.pt (Ctrl-C again to kill at once)" >&2
        pkill -TERM -P "$1" 2>/dev/null || kill -TERM "$1" 2>/dev/null || true
    else
        echo "run.sh: second Ctrl-C: killing the run at once; last.pt is the last one saved" >&2
        # The launcher starts each rank in a session of its own: kill them, then its group.
        pkill -KILL -P "$1" 2>/dev/null || true
        kill -KILL -- "-$1" 2>/dev/null || true
    fi
}

alive() {
    # kill -0 also succeeds on a zombie (a process that exited but whose parent has not reaped
    # it, e.g. in a container without an init): that one has stopped.
    kill -0 "$1" 2>/dev/null || return 1
    [[ "$(ps -o stat= -p "$1" 2>/dev/null)" != Z* ]]
}

cmd_stop() {
    [[ $# -eq 1 ]] || die "stop: usage ./run.sh stop NAME [runs dir from RUNS_DIR, default runs]"
    local pidfile="${RUNS_DIR:-runs}/$1/pid"
    [[ -f "$pidfile" ]] || die "no pid file $pidfile: was $1 started with ./run.sh --bg?"
    local pid
    pid="$(cat "$pidfile")"
    if ! alive "$pid"; then
        rm -f "$pidfile"
        echo "run $1 is not running"
        return 0
    fi
    # SIGTERM to the launcher's ranks: they finish their step, write last.pt and exit 0, and
    # then the launcher exits normally (a launcher without ranks yet gets the SIGTERM itself).
    if ! pkill -TERM -P "$pid" 2>/dev/null; then
        kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid"
    fi
    for _ in $(seq 1 120); do
        alive "$pid" || { rm -f "$pidfile"; echo "stopped $1"; return 0; }
        sleep 1
    done
    die "run $1 (pid $pid) still running after 120 s; kill -9 -- -$pid to force"
}

cmd_lint() {
    # The guards the next feature must keep: ruff's lint (complexity C901 <= 12, imports) and
    # its formatter; pylint's duplicate-code check (R0801, alone: pyproject's [tool.pylint]) for
    # code copied inside the package; tests/project/test_code_shape.py checks function sizes, the root
    # and the layering.
    "$PY" -m ruff check --quiet . || die "lint failed: fix the lines above (ruff check --fix fixes some)"
    "$PY" -m ruff format --check --quiet . || die "formatting differs: run .venv/bin/ruff format ."
    "$PY" -m pylint audioclf || die "repeated code (above): give it one home that both places call"
}

main() {
    [[ $# -ge 1 ]] || { usage; exit 2; }
    case "$1" in
        -h|--help|help) usage ;;
        setup) setup_venv ;;
        demo) shift; cmd_demo "$@" ;;
        test) shift; setup_venv; cmd_lint; exec "$PY" -m pytest -n auto --maxprocesses 4 --durations=20 "$@" ;;
        stop) shift; cmd_stop "$@" ;;
        *) setup_venv; cmd_train "$@" ;;
    esac
}

main "$@"
