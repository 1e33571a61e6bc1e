# Fresh-machine entry points: `make serve` and `make test` create .venv when it is missing and install into it.
VENV ?= .venv
# Test processes (pytest-xdist): the cores, at most 4. Each starts TensorFlow servers of about 600 MB.
TEST_WORKERS ?= $(shell python3 -c "import os; print(max(1, min(4, len(os.sched_getaffinity(0)))))")
# The speed tests run alone afterwards, collected from the files that mark any (collecting all costs about 10 s).
SERIAL_TESTS = $(shell grep -rl --include="test_*.py" "mark.serial" tests)
PY := $(VENV)/bin/python
STAMP := $(VENV)/.petal-installed

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# uv (PyPI's, into the venv) installs what pip resolves, in less time: a fresh `make install` on 2 cores took 2.5
	# minutes against pip's 7.4 (docs/development.md). pip stays: perf_analyzer's fetch below runs `pip download`.
	# Compiled to bytecode as pip does: where PYTHONDONTWRITEBYTECODE is set (CI) nothing else writes it, and every
	# process that imports TensorFlow and Keras from source took 6 s more to start.
	$(PY) -m pip install -q --upgrade pip uv
	$(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) -e '.[test]'
	# Triton's perf_analyzer binary (a second load generator) into $(VENV)/perf_analyzer: tests download nothing.
	$(PY) -m load_tests.perf_analyzer
	# Azurite, Azure Blob's emulator, for the object-store tests (tests/object_stores.py): 3.35 is the last for Node 20.
	npm install --prefix $(VENV)/azurite azurite@3.35.0 --no-audit --no-fund --loglevel=error
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/petal serve

# The first run lists its 20 slowest tests: CI has about 12 minutes on 2 cores.
test: $(STAMP)
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m "not serial" --durations=20
	$(PY) -m pytest -q -m serial $(SERIAL_TESTS)

.PHONY: install serve test
