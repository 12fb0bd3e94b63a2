# Two commands do all the set-up on a fresh machine:
#   make demo   - builds .venv, installs pagedcore, runs `pagedcore generate` on the built-in model
#   make test   - builds .venv, installs pagedcore with its test extras, runs ruff, mypy and the test suite
# On a CUDA machine (docs/gpu.md): the index's torch is a CUDA 13 build, and the `gpu` extra adds xformers 0.0.35 and
# the CUDA 12 runtime its library needs (pagedcore loads it before importing xformers):
#   make EXTRAS=all,gpu install && make gpu-check
# or the CUDA 12.8 build of torch that xformers 0.0.35 was compiled against, which loads that runtime itself:
#   make TORCH=torch==2.10.0 TORCH_INDEX=https://download.pytorch.org/whl/cu128 EXTRAS=all,gpu install
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch first: a plain `torch` requirement with no torch installed pulls a multi-GB CUDA build.
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
EXTRAS ?= all
comma := ,
STAMP := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))
# Wheels for an offline CUDA machine (`make gpu-carry`, docs/gpu.md): its Python and platform.
CARRY ?= carry
CARRY_PYTHON ?= 3.12

.PHONY: install demo test lint typecheck unit bench ray-load gpu-check gpu-carry clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $@

install: $(STAMP)

demo: install
	$(BIN)/pagedcore generate

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

# One GPU, under 8 minutes: versions and the xformers diagnosis, the GPU tests, a decode run (step times, Triton
# compilations, syncs) and the benchmarks; writes gpu-check/report.md. Without CUDA: the CPU-visible parts only.
gpu-check: install
	$(BIN)/python scripts/gpu_check.py --out gpu-check

gpu-carry: install
	mkdir -p $(CARRY)
	$(BIN)/python -m pip download --quiet --no-deps --only-binary=:all: --python-version $(CARRY_PYTHON) \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d $(CARRY) \
		xformers==0.0.35 nvidia-cuda-runtime-cu12==12.8.90 pytest pluggy iniconfig packaging
	$(BIN)/python -m pip wheel --quiet --no-deps --no-build-isolation -w $(CARRY) .

clean:
	rm -rf $(VENV) build bench-out gpu-check $(CARRY) .pytest_cache .mypy_cache .ruff_cache
