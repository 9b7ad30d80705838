# Two entry points: `make demo` runs the main job on shipped data, `make test` runs the suite.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,ray,plot,s3,hf]'
	touch $(STAMP)

.PHONY: demo test test-fast lint bench
demo: $(STAMP)
	$(VENV)/bin/tokenmill demo

test: $(STAMP) lint
	$(PY) -m pytest -q -x

# unit tests only (no Ray, torchrun, killed processes or demo): under a minute
test-fast: $(STAMP)
	$(PY) -m pytest -q -x -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check tokenmill tests benchmarks
	$(VENV)/bin/ruff format --check tokenmill tests benchmarks
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) benchmarks/run_all.py
