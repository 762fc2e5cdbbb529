#!/usr/bin/env bash
# Download the wheels an offline GPU machine lacks for benchmarks/gpu_check.sh. Run it where a
# package index is reachable, copy DIR to the GPU machine with the repository, and run
# `benchmarks/gpu_check.sh --wheels DIR` there.
#
#   benchmarks/gpu_wheels.sh DIR                          # CPython 3.12, manylinux x86-64
#   benchmarks/gpu_wheels.sh DIR --python 3.11
#   benchmarks/gpu_wheels.sh DIR --platform manylinux_2_28_aarch64 --platform manylinux2014_aarch64
#
# The wheels are benchmarks/gpu_preflight.py's pinned list (soundfile with cffi and pycparser,
# openpyxl with et-xmlfile, python-calamine, pytorch-metric-learning, faiss-cpu, starlette,
# uvicorn, python-multipart, prometheus-client, safetensors): binary only,
# --no-deps, every dependency named, one version each. --platform (repeatable) replaces the
# default manylinux x86-64 tags. PYTHON picks the interpreter whose pip downloads (default
# python3; it need not be the target version). Prints each wheel and the total; fails when DIR
# holds other wheels (gpu_check.sh installs DIR/*.whl) or the total is over 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."

LIMIT_MIB=64
DEFAULT_PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64
    manylinux2014_x86_64 manylinux1_x86_64)

die() { echo "gpu_wheels: $*" >&2; exit 2; }
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

DIR="" TARGET_PYTHON=3.12
declare -a PLATFORMS=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --python) [[ $# -ge 2 ]] || die "--python needs a version (3.12)"; TARGET_PYTHON="$2"; shift 2 ;;
        --platform) [[ $# -ge 2 ]] || die "--platform needs a tag"; PLATFORMS+=("$2"); shift 2 ;;
        -*) die "unknown option $1 (see --help)" ;;
        *) [[ -z "$DIR" ]] || die "one DIR only (got $DIR and $1)"; DIR="$1"; shift ;;
    esac
done
[[ -n "$DIR" ]] || { usage; exit 2; }
[[ "$TARGET_PYTHON" =~ ^3\.[0-9]+$ ]] || die "--python takes a version such as 3.12, not $TARGET_PYTHON"
[[ ${#PLATFORMS[@]} -gt 0 ]] || PLATFORMS=("${DEFAULT_PLATFORMS[@]}")
PY="${PYTHON:-python3}"
command -v "$PY" >/dev/null || die "$PY not found; set PYTHON=/path/to/python3"

mapfile -t WHEELS < <("$PY" benchmarks/gpu_preflight.py --list-wheels)
[[ ${#WHEELS[@]} -gt 0 ]] || die "benchmarks/gpu_preflight.py --list-wheels listed nothing"
declare -a platform_args=()
for tag in "${PLATFORMS[@]}"; do platform_args+=(--platform "$tag"); done

mkdir -p "$DIR"
echo "gpu_wheels: ${#WHEELS[@]} wheels for CPython $TARGET_PYTHON (${PLATFORMS[*]}) into $DIR"
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "$TARGET_PYTHON" --implementation cp "${platform_args[@]}" \
    -d "$DIR" "${WHEELS[@]}" \
    || die "pip found no wheel for one of them (above); add --platform manylinux_2_N_x86_64 for another N"

# Wheel files spell a name with underscores, in any case: faiss-cpu==1.15.1 is faiss_cpu-1.15.1-*.whl.
declare -A wanted=()
for spec in "${WHEELS[@]}"; do
    name="${spec%%==*}" version="${spec#*==}"
    wanted["$(echo "${name//-/_}" | tr '[:upper:]' '[:lower:]')-$version"]="$spec"
done
total=0 found=0
declare -a stray=()
shopt -s nullglob
for wheel in "$DIR"/*.whl; do
    file="$(basename "$wheel")"
    key="$(echo "$file" | cut -d- -f1-2 | tr '[:upper:]' '[:lower:]')"
    if [[ -z "${wanted[$key]:-}" ]]; then stray+=("$file"); continue; fi
    bytes="$(stat -c %s "$wheel")"
    total=$((total + bytes)) found=$((found + 1))
    printf '  %7.1f MiB  %s\n' "$(echo "$bytes" | awk '{ print $1 / 1048576 }')" "$file"
done
[[ ${#stray[@]} -eq 0 ]] || die "$DIR also holds ${stray[*]}; gpu_check.sh installs every wheel there: use an empty folder"
[[ $found -eq ${#WHEELS[@]} ]] || die "$found of ${#WHEELS[@]} wheels are in $DIR"
total_mib="$(echo "$total" | awk '{ printf "%.1f", $1 / 1048576 }')"
if [[ $total -gt $((LIMIT_MIB * 1048576)) ]]; then
    die "the wheels total $total_mib MiB, over the $LIMIT_MIB MiB limit"
fi
echo "gpu_wheels: $found wheels, $total_mib MiB in $DIR; on the GPU machine: benchmarks/gpu_check.sh --wheels $DIR"
