# Two commands do all the set-up on a fresh machine:
#   make demo   - builds .venv, installs what the demo needs (torch's CPU build, transformers, pagedcore: the
#                 `transformers` extra, whatever EXTRAS says), runs `pagedcore generate` on the built-in model
#   make test   - builds .venv, installs pagedcore with every extra (EXTRAS=all), runs ruff, mypy and the test suite
# Both work in either order in one checkout: each set of extras has its own stamp in .venv, so `make test` after
# `make demo` installs the rest, and `make demo` after `make test` finds its packages already there.
#   make install EXTRAS=serve,structured   - the venv with only those extras (see pyproject.toml)
# On a CUDA machine with the package index (docs/gpu.md): the index's torch is a CUDA 13 build, and the `gpu` extra
# adds xformers 0.0.35 and the CUDA 12 runtime its library needs:
#   make EXTRAS=all,gpu install && make gpu-check
# An offline GPU machine: `make gpu-carry` here, then there `bash scripts/gpu_run.sh OUT`; `make gpu-rehearsal`
# rehearses that on a CPU machine.
# or the CUDA 12.8 build of torch that xformers 0.0.35 was compiled against, which loads that runtime itself:
#   make TORCH=torch==2.10.0 TORCH_INDEX=https://download.pytorch.org/whl/cu128 EXTRAS=all,gpu install
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch first: a plain `torch` requirement with no torch installed pulls a multi-GB CUDA build.
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
EXTRAS ?= all
DEMO_EXTRAS := transformers
comma := ,
# One stamp per set of extras: .venv/.installed-serve-structured for EXTRAS=serve,structured.
stamp = $(VENV)/.installed-$(subst $(comma),-,$(1))
STAMP := $(call stamp,$(EXTRAS))
# Wheels for an offline CUDA machine (`make gpu-carry`, docs/gpu.md): what its image (scripts/gpu_image.txt) lacks.
CARRY ?= carry
# make gpu-check installs nothing: the project venv's python where there is one, else $(PYTHON).
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))

.PHONY: install demo test lint typecheck unit bench ray-load gpu-check gpu-carry gpu-rehearsal clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed-%: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install --quiet -e ".[$(subst -,$(comma),$*)]"
	touch $@

install: $(STAMP)

demo: $(call stamp,$(DEMO_EXTRAS))
	$(BIN)/pagedcore generate
	@echo "next: . $(VENV)/bin/activate puts pagedcore on PATH; make install EXTRAS=serve for pagedcore serve"

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install
	$(BIN)/mypy

unit: install
	$(BIN)/pytest

test: lint typecheck unit

bench: install
	$(BIN)/pagedcore bench

# Prefix against random routing through the Ray Serve ingress, on a local Ray cluster (README: Ray).
ray-load: install
	$(BIN)/python examples/ray_serve_load.py

# The GPU check on a machine that has everything installed (it installs nothing): versions and the xformers
# diagnosis, the GPU tests, a decode run (step times, Triton compilations, syncs) and the benchmarks one at a time,
# under 5 minutes; writes gpu-check/report.md part by part. Without CUDA: each part's CPU rehearsal, "no CUDA".
gpu-check:
	$(GPU_PYTHON) scripts/gpu_check.py --out gpu-check

# carry/: the wheels the GPU image lacks (transformers at pyproject's floor, xformers, the CUDA 12 runtime), the pip
# wheel (the fallback where its python has no pip) and a pagedcore wheel of this tree, with carry/MANIFEST.json.
gpu-carry: install
	$(BIN)/python scripts/gpu_carry.py --carry $(CARRY)

# The GPU run rehearsed on this CPU machine: a venv with the image's versions (.gpu-rehearsal/), the carry installed
# as the GPU machine installs it, scripts/gpu_run.sh from the repository root, its report checked (a few minutes).
gpu-rehearsal: install
	GPU_CARRY_PYTHON=$(BIN)/python bash scripts/gpu_rehearsal.sh

clean:
	rm -rf $(VENV) build bench-out gpu-check $(CARRY) .gpu-rehearsal .pytest_cache .mypy_cache .ruff_cache
