#!/usr/bin/env bash
# Rehearse benchmarks/gpu_check.sh --wheels on the CPU: a fresh venv holding only the GPU image's
# packages that audioclf relies on (benchmarks/gpu_preflight.py --list-box: torch, torchaudio,
# the scientific stack, pytest, ...), nothing from requirements*.txt, plus the pinned wheels of
# benchmarks/gpu_wheels.sh installed offline as gpu_check.sh --wheels installs them. In it:
#   1. the fast tier collects (pytest --collect-only -m "not slow and not cuda"), with the wheels
#      on PYTHONPATH as on the GPU machine;
#   2. benchmarks/gpu_check.sh --cpu-smoke --wheels DIR passes (skipped with --smoke).
# It downloads (a package index must be reachable; pip's cache makes a second run fast), so it
# is a benchmark, not a test. Exit status 0 when both pass.
#
#   benchmarks/gpu_rehearsal.sh                 # venv in ${TMPDIR:-/tmp}/audioclf_rehearsal
#   benchmarks/gpu_rehearsal.sh --smoke         # the venv and the collection only
#   PYTHON=python3.12 benchmarks/gpu_rehearsal.sh --venv DIR   # the GPU image's Python
#
# The torch pip finds here is a CPU (or CUDA) build of the newest release allowed, not the
# image's 2.11.0+cu130; the Python is PYTHON's (default python3), the image's is 3.12.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

die() { echo "gpu_rehearsal: $*" >&2; exit 2; }
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

SMOKE=0 VENV="${TMPDIR:-/tmp}/audioclf_rehearsal"
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --smoke) SMOKE=1; shift ;;
        --venv) [[ $# -ge 2 ]] || die "--venv needs a folder"; VENV="$2"; shift 2 ;;
        *) die "unknown argument $1 (see --help)" ;;
    esac
done
PY="${PYTHON:-python3}"
command -v "$PY" >/dev/null || die "$PY not found; set PYTHON=/path/to/python3"
VERSION="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"

rm -rf "$VENV" && "$PY" -m venv "$VENV" || die "could not make a venv in $VENV"
mapfile -t BOX < <("$PY" benchmarks/gpu_preflight.py --list-box)
echo "gpu_rehearsal: Python $VERSION venv $VENV with the image's ${#BOX[@]} packages: ${BOX[*]}"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-compile "torch>=2.11" "${BOX[@]}" \
    || die "pip could not install the image's packages (above)"
rm -rf "$VENV/wheels" "$VENV/site"
PYTHON="$PY" benchmarks/gpu_wheels.sh "$VENV/wheels" --python "$VERSION" \
    || die "gpu_wheels.sh failed (above)"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-index --no-deps \
    --no-compile --target "$VENV/site" "$VENV/wheels"/*.whl || die "the wheels did not install"
"$VENV/bin/python" -c 'import torch; print("gpu_rehearsal: torch", torch.__version__)'

FAILED=0
echo "== the fast tier collects"
if PYTHONPATH="$VENV/site" "$VENV/bin/python" -m pytest --collect-only -q -p no:cacheprovider \
    -m "not slow and not cuda" > "$VENV/collect.log" 2>&1; then
    echo "PASS collection: $(tail -n 1 "$VENV/collect.log")"
else
    tail -n 30 "$VENV/collect.log"
    echo "FAIL collection: $(tail -n 1 "$VENV/collect.log")"
    FAILED=1
fi
if [[ $SMOKE == 0 ]]; then
    echo "== gpu_check.sh --cpu-smoke --wheels $VENV/wheels"
    if PYTHON="$VENV/bin/python" benchmarks/gpu_check.sh --cpu-smoke --wheels "$VENV/wheels"; then
        echo "PASS gpu_check --cpu-smoke"
    else
        echo "FAIL gpu_check --cpu-smoke (above)"
        FAILED=1
    fi
fi
echo "gpu_rehearsal: $([[ $FAILED == 0 ]] && echo PASS || echo FAIL) in $SECONDS s"
exit "$FAILED"
