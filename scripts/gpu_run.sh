#!/usr/bin/env bash
# The GPU machine's one command (docs/gpu.md), run from anywhere in the repository with carry/ beside it:
#
#   bash scripts/gpu_run.sh OUT        # OUT: the folder that comes back (default gpu-check)
#
# 1. installs carry/*.whl offline into a folder of its own on PYTHONPATH (the image's venv is left as it is):
#    `pip install --no-index --no-deps`, or, where that python has no pip, the carried pip wheel run by its file name;
# 2. runs scripts/gpu_check.py with HF_HUB_OFFLINE=1 and unbuffered output: its parts (versions and plugins, the
#    GPU tests, the 200-step decode, the sync count, the benchmarks one --only at a time) each write their part of
#    OUT/report.md and OUT/status.json as they finish, under a total cap of GPU_BUDGET_S seconds (default 300).
#
# Settings (environment): GPU_PYTHON (default python3), GPU_BUDGET_S (300), GPU_CARRY (carry), GPU_SITE (where the
# carry is installed, default /tmp/pagedcore-site, emptied first), GPU_CAP_SCALE (1: multiplies each part's cap),
# GPU_INSTALL_ONLY=1 (stop after the install, its exit status). Exit status: 0 when every part passed (or, without
# CUDA, ran its CPU rehearsal cleanly), 1 otherwise.
set -uo pipefail
OUT=${1:-gpu-check}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 1  # as given, from where it was given
cd "$(dirname "$0")/.."
PY=${GPU_PYTHON:-python3}
BUDGET=${GPU_BUDGET_S:-300}
CARRY=${GPU_CARRY:-carry}
SITE=${GPU_SITE:-/tmp/pagedcore-site}
started=$(date +%s)
LOG="$OUT/install.log"

install_carry() {
    echo "== python: $(command -v "$PY") ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"
    local wheels=() fallback=() installer=()
    for wheel in "$CARRY"/*.whl; do
        case "$(basename "$wheel")" in
            pip-*) fallback+=("$wheel") ;;  # run by its file name only where pip is missing; never installed
            *) wheels+=("$wheel") ;;
        esac
    done
    if [ ! -e "${wheels[0]:-}" ]; then
        echo "no wheels in $CARRY/: build them with 'make gpu-carry' and send $CARRY/ with the tree"
        return 1
    fi
    if "$PY" -m pip --version; then
        installer=("$PY" -m pip)
    elif [ -e "${fallback[0]:-}" ]; then
        echo "no pip in $PY: running the carried ${fallback[0]}"
        installer=("$PY" "${fallback[0]}/pip")
    else
        echo "no pip in $PY and no pip wheel in $CARRY/"
        return 1
    fi
    rm -rf "$SITE"
    "${installer[@]}" install --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
        --target "$SITE" "${wheels[@]}"
}

install_carry >"$LOG" 2>&1
install_rc=$?
echo "gpu_run: carry install exit $install_rc ($LOG)"
if [ "${GPU_INSTALL_ONLY:-0}" = 1 ]; then
    cat "$LOG"
    exit "$install_rc"
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
left=$((BUDGET - ($(date +%s) - started)))
command=("$PY" scripts/gpu_check.py --out "$OUT" --budget "$left" --install-exit "$install_rc" --carry "$CARRY"
    --cap-scale "${GPU_CAP_SCALE:-1}")
if command -v timeout >/dev/null; then  # a backstop: gpu_check.py keeps to its budget itself
    exec timeout --kill-after=10 $((left + 30)) "${command[@]}"
fi
exec "${command[@]}"
