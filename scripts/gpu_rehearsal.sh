#!/usr/bin/env bash
# make gpu-rehearsal: the GPU machine's run, rehearsed on a CPU machine (docs/gpu.md, "The rehearsal").
#
# 1. a venv standing in for the GPU image: the versions of scripts/gpu_image.txt's third column (transformers 5.17,
#    tokenizers 0.23, ...; the CPU build of torch 2.13 on Python 3.11, since PyPI has no CPU torch for 3.12), none
#    of what the image lacks (xformers, fastapi, uvicorn, ray, openai, mypy);
# 2. the carry, built as `make gpu-carry` builds it (scripts/gpu_carry.py, into carry/);
# 3. the carry installed by Python 3.12 with no pip, as gpu_run.sh does there where pip is missing: the carried pip
#    wheel run by its file name, installing the cp312 wheels;
# 4. `bash scripts/gpu_run.sh OUT` from the repository root with the image venv's python, exactly the GPU machine's
#    command (its budget and caps widened: a loaded CPU is slow), then `gpu_check.py --verify OUT`: every part ran
#    or reported "no CUDA" cleanly, the report is whole, the files are what that machine sends back;
# 5. under the image venv plus the carry: the whole suite collects (every optional dependency is importorskip'ped),
#    and tests/test_cuda_backends.py runs on the CPU standing in for CUDA: PagedCache, enable() and the Engine on
#    transformers' declared floor (pyproject), which is what the carry brings.
#
# Settings: GPU_REHEARSAL_DIR (.gpu-rehearsal), GPU_REHEARSAL_PYTHON (python3: must be 3.11 for the CPU torch),
# GPU_REHEARSAL_PY312 (python3.12, else pyenv's 3.12), GPU_CARRY_PYTHON (.venv/bin/python: runs gpu_carry.py).
set -euo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)
DIR=${GPU_REHEARSAL_DIR:-.gpu-rehearsal}
PY=${GPU_REHEARSAL_PYTHON:-python3}
CARRY_PY=${GPU_CARRY_PYTHON:-.venv/bin/python}
say() { echo "== gpu-rehearsal ($(($(date +%s) - started)) s): $*"; }
fail() { echo "gpu-rehearsal: FAILED: $*" >&2; exit 1; }

PY312=${GPU_REHEARSAL_PY312:-$(command -v python3.12 2>/dev/null || true)}
if [ -z "$PY312" ] || ! "$PY312" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    PY312=$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 2>/dev/null | tail -1 || true)
fi
[ -n "$PY312" ] && "$PY312" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null ||
    fail "no Python 3.12 (the GPU image's): put python3.12 on PATH or set GPU_REHEARSAL_PY312"
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null ||
    fail "$PY is not Python 3.11 (the CPU torch stand-in is a cp311 wheel): set GPU_REHEARSAL_PYTHON"
[ -x "$CARRY_PY" ] || fail "$CARRY_PY missing: run make install (gpu_carry.py needs packaging, setuptools, pip)"

# torch in the image venv as hard links to .venv's files where both hold the same CPU wheel (the same filesystem):
# a second copy is 750 MB, and a CI machine once ran out of disk while pip wrote it. pip then finds it installed.
link_torch() {
    local want source target
    want=$(printf '%s\n' "${requirements[@]}" | sed -n 's/^torch==//p')
    source=$("$CARRY_PY" -c 'import importlib.metadata as m, torch, pathlib
print(m.version("torch"), pathlib.Path(torch.__file__).parent.parent)' 2>/dev/null) || return 0
    [ -n "$want" ] && [ "${source%% *}" = "$want+cpu" ] || return 0
    source=${source#* }
    target=$("$IMAGE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    if cp -al "$source"/torch "$source"/functorch "$source"/torchgen "$source/torch-$want+cpu.dist-info" "$target"/ 2>/dev/null; then
        say "torch $want hard-linked from $source"
    else
        rm -rf "$target"/torch "$target"/functorch "$target"/torchgen "$target/torch-$want+cpu.dist-info"
    fi
}

# 1. the image venv (kept between runs while scripts/gpu_image.txt is unchanged)
IMAGE="$DIR/image"
stamp="$IMAGE/.image-$(sha256sum scripts/gpu_image.txt | cut -c1-16)"
if [ ! -e "$stamp" ]; then
    say "building the image venv in $IMAGE"
    rm -rf "$IMAGE"
    "$PY" -m venv "$IMAGE"
    mapfile -t requirements < <("$CARRY_PY" scripts/gpu_carry.py --rehearsal-requirements)
    link_torch
    "$IMAGE/bin/python" -m pip install --quiet --retries 5 "${requirements[@]}"
    touch "$stamp"
fi
IMG_PY="$IMAGE/bin/python"
"$IMG_PY" -c 'import importlib.util as u, sys
missing = [m for m in ("xformers", "fastapi", "uvicorn", "ray", "openai", "mypy") if u.find_spec(m)]
sys.exit(f"the image venv has {missing}, which the image lacks" if missing else 0)'

# 2. the carry, as make gpu-carry builds it
say "building the carry (scripts/gpu_carry.py)"
"$CARRY_PY" scripts/gpu_carry.py --carry carry

# 3. Python 3.12 with no pip: the fallback, on the cp312 wheels
say "installing the carry with Python 3.12 and no pip ($PY312)"
rm -rf "$DIR/py312" "$DIR/site312" "$DIR/out312"
"$PY312" -m venv --without-pip "$DIR/py312"
GPU_PYTHON="$DIR/py312/bin/python" GPU_SITE="$DIR/site312" GPU_INSTALL_ONLY=1 \
    bash scripts/gpu_run.sh "$DIR/out312" >"$DIR/install312.log" 2>&1 || { cat "$DIR/install312.log"; fail "the pip-less install"; }
grep -q "no pip in" "$DIR/install312.log" || fail "the 3.12 venv had pip: the fallback was not rehearsed"
"$DIR/py312/bin/python" - "$DIR/site312" <<'EOF' || fail "the carry did not install on 3.12"
import json, sys
from importlib import metadata
site = sys.argv[1]
carried = json.load(open("carry/MANIFEST.json"))["carried"]
found = {d.metadata["Name"].lower(): d.version for d in metadata.distributions(path=[site])}
assert all(found.get(name) == version for name, version in carried.items()), (carried, found)
assert "pagedcore" in found and "pip" not in found, found
print(f"python 3.12 without pip installed {sorted(found.items())}")
EOF
rm -rf "$DIR/py312" "$DIR/site312"  # checked: their disk is the next steps'

# 4. the GPU machine's command, from the repository root
say "bash scripts/gpu_run.sh $DIR/out (the image venv's python)"
rm -rf "$DIR/out" "$DIR/site"
run_rc=0
GPU_PYTHON="$IMG_PY" GPU_SITE="$DIR/site" GPU_BUDGET_S=1200 GPU_CAP_SCALE=4 bash scripts/gpu_run.sh "$DIR/out" || run_rc=$?
"$IMG_PY" scripts/gpu_check.py --verify "$DIR/out" || fail "the report in $DIR/out is not what a GPU run must leave"
[ "$run_rc" = 0 ] || fail "scripts/gpu_run.sh exited $run_rc"

# 5. the suite on the image: it collects; the adapter runs on the declared transformers floor
say "the suite's collection and tests/test_cuda_backends.py (CPU for CUDA) on the image venv + the carry"
export PYTHONPATH="$DIR/site" HF_HUB_OFFLINE=1
"$IMG_PY" -m pytest --collect-only -q -p no:cacheprovider >"$DIR/collect.log" 2>&1 || { tail -30 "$DIR/collect.log"; fail "the suite does not collect on the image"; }
tail -1 "$DIR/collect.log"
PAGEDCORE_CUDA_TESTS_DEVICE=cpu "$IMG_PY" -m pytest -q -p no:cacheprovider tests/test_cuda_backends.py
"$IMG_PY" -c 'import transformers; print("transformers", transformers.__version__, transformers.__file__)'
say "passed"
