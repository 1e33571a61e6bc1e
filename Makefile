# Fresh-machine entry points: `make serve` and `make test` create .venv when it is missing and install into it.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.petal-installed

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/petal serve

test: $(STAMP)
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -q

.PHONY: install serve test
