# Two commands on a fresh machine: `make demo` and `make test` (each installs first).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST := $(BIN)/python -m pytest
N ?= 2000
SEED ?= 0
ORDER ?= 1

.PHONY: install browser demo demo-small demo-distributed test test-long bench bench-gpu sweep-hf pretend-gpu bench-pretend-gpu check-pretend-cudagraphs lint fuzz explain-demo clean

install: $(VENV)/.installed browser

# Headless Chromium for the explain page's browser test (tests/test_explain_browser.py; under
# CI=true the test fails without it). Installing needs root; elsewhere a warning, and the test skips.
browser:
	@command -v chromium-headless-shell >/dev/null || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium-headless-shell fonts-liberation) \
		|| echo "warning: could not install chromium-headless-shell (not root?); the browser test will skip"

# torch==2.13.0 first: it is the CPU build on these machines; the package's own range then
# installs nothing more (no CUDA wheels).
$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,demo]'
	touch $@

demo: install
	$(BIN)/python examples/train_gpt2.py

# 2 ranks (gloo on CPU, NCCL with CUDA): DDP and FSDP2, eager / aotgrad / inductor; a few minutes on 2 cores.
demo-distributed: install
	$(BIN)/torchrun --standalone --nproc-per-node 2 examples/train_distributed.py

demo-small: install
	$(BIN)/python examples/demo.py

test: install
	$(PYTEST) -q tests

test-long: install
	$(PYTEST) -q -m long tests

bench: install
	$(BIN)/python benchmarks/run_all.py

# ~100 transformers families, tiny, on CPU: each trains like eager under backend=$(SWEEP_BACKEND), or fails
# the same way under $(SWEEP_REFERENCE) (benchmarks/hf_family_sweep.py; 93 families took 84 min on 2 cores; 26 image families 52 min over three runs).
# A family still running after 15 min is stopped and becomes a row (funnel: neither backend finished a first step in 5 min).
SWEEP_BACKEND ?= aotgrad
SWEEP_REFERENCE ?= inductor
sweep-hf: install
	$(BIN)/python benchmarks/hf_family_sweep.py --backend $(SWEEP_BACKEND) --reference $(SWEEP_REFERENCE) $(if $(AUTOCAST),--autocast)

# GPU training suite (issue 41, benchmarks/gpu_suite.py): aotgrad vs Inductor on GPT-2, BERT, Llama, T5,
# ResNet-50, ViT and the small GPT-2 under reduce-overhead, bf16 autocast. Runs with the GPU machine's
# own python and torch (no install: that machine has no network): two runs of < 8 min on an H100/H200,
# or one group with `make bench-gpu GPU_GROUPS=1`. Tables on stdout, raw results in $(GPU_OUT).
GPU_PY ?= python3
GPU_GROUPS ?= 1 2
GPU_OUT ?= .
bench-gpu:
	for g in $(GPU_GROUPS); do PYTHONPATH=src $(GPU_PY) benchmarks/gpu_suite.py --group $$g --deadline 330 \
		--json $(GPU_OUT)/gpu_suite_$$g.json || true; done

# The pretend GPU (scripts/pretend_gpu/README.md): the GPU machine's torch 2.11 CUDA build on this CPU, one
# pretend H100 whose kernels compute nothing. Real: dispatch, autocast, Inductor's CUDA code and Triton
# compiles, the caching allocator's peaks. Not real: values, step times. ~5 GB venv, downloads CUDA wheels.
CUDA_VENV ?= .venv-cuda
PRETEND_LIB := .pretend-gpu
CUDA_INCLUDE ?= /usr/local/cuda/include  # CUDA 13 headers (this machine image ships them with nvcc)
pretend-gpu: $(PRETEND_LIB)/libcuda.so.1 $(PRETEND_LIB)/libcudart-pretend.so

$(CUDA_VENV)/.installed:
	$(PY) -m venv $(CUDA_VENV)
	$(CUDA_VENV)/bin/pip install -q --upgrade pip
	$(CUDA_VENV)/bin/pip install -q torch==2.11.0 transformers==5.17.0 networkx
	touch $@

$(PRETEND_LIB)/libcudart-pretend.so: scripts/pretend_gpu/cudart.c scripts/pretend_gpu/h100.h $(CUDA_VENV)/.installed
	mkdir -p $(PRETEND_LIB)
	cc -shared -fPIC -O1 -I$(CUDA_INCLUDE) -o $@ $< -lpthread

$(PRETEND_LIB)/libcuda.so.1: scripts/pretend_gpu/libcuda.c scripts/pretend_gpu/h100.h
	mkdir -p $(PRETEND_LIB)
	cc -shared -fPIC -O1 -o $@ $<
	ln -sf libcuda.so.1 $(PRETEND_LIB)/libcuda.so

# The GPU suite's full-size models on the pretend H100: whether each trains, and activation peaks. No kernel
# computes there, so one step of each is run and the suite leaves out the step and loss columns.
# One model at a time takes 3-10 min on 2 cores (Triton compiles); PRETEND_MODELS picks them.
PRETEND_MODELS ?= gpt2,bert,llama,t5,resnet50,vit,gpt2_small_ro
bench-pretend-gpu: pretend-gpu
	scripts/pretend_gpu/run $(CUDA_VENV)/bin/python benchmarks/gpu_suite.py --device cuda --models $(PRETEND_MODELS) \
		--steps 1 --warmup 0 --loss-steps 1 --no-process-warmup \
		--json $(GPU_OUT)/pretend_gpu_suite.json

# CUDA graphs (mode="reduce-overhead") on the pretend H100: aotgrad's decisions against Inductor's, case by case.
check-pretend-cudagraphs: pretend-gpu
	scripts/pretend_gpu/run $(CUDA_VENV)/bin/python scripts/pretend_gpu/cudagraph_check.py

fuzz: install
	$(BIN)/python scripts/fuzz.py --n $(N) --seed $(SEED) --order $(ORDER) $(if $(SUBCLASS),--subclass) $(if $(AUTOCAST),--autocast)

# The README's screenshot of an aotgrad.explain page: docs/explain.png, taken by headless Chromium.
explain-demo: install
	$(BIN)/python scripts/explain_screenshot.py --out docs/explain.png

lint: install
	$(BIN)/ruff check src tests benchmarks examples scripts

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
