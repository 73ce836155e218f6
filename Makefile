# The two commands a newcomer types: `make demo` and `make test`.
# Both create their own virtual environment in .venv on first use; each installs what it runs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# One stamp per install: `make demo` then `make test` (or the other way round) installs what the
# second one lacks, and either reinstalls when pyproject.toml changes.
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
DOCS_STAMP := $(VENV)/.installed-docs

.PHONY: demo test lint format docs bench bench-full clean

$(VENV)/.created:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	touch $@

# The demo's extra: the package and the sandbox provider's server, nothing the tests use.
$(DEMO_STAMP): pyproject.toml $(VENV)/.created
	$(BIN)/pip install --quiet -e '.[demo]'
	touch $@

# The test extra: the demo's packages, PostgreSQL's psycopg, every adapter, pytest, mypy, ruff.
$(STAMP): pyproject.toml $(VENV)/.created
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

# The docs extra: Sphinx, furo and MyST (the site in docs/), beside the package it documents.
$(DOCS_STAMP): pyproject.toml $(VENV)/.created
	$(BIN)/pip install --quiet -e '.[docs]'
	touch $@

demo: $(DEMO_STAMP)
	$(BIN)/agent-outbox demo

# In parallel: twice as many test processes as CPUs (most tests wait on a worker, a server or the
# database), each with its own PostgreSQL database, Redis key prefix and ports (tests/conftest.py).
# Tests are handed out two at a time, the slow-marked first. JOBS=0 runs in this process, serially.
# At most 8 by default: each process holds its own database, workers and servers (PostgreSQL's
# default max_connections is 100), and nproc does not see a container's CPU quota.
JOBS ?= $(shell n=$$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2); echo $$(( n * 2 > 8 ? 8 : n * 2 )))
test: $(STAMP)
	$(BIN)/python -m pytest -n $(JOBS) --dist load --maxschedchunk 2 --durations=30 $(ARGS)

# ruff (configured in pyproject.toml): lint and format check; CI fails on either.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# The site (docs/): warnings are errors and every internal link is checked (-W -n); the reference
# pages are generated from the code during the build (docs/_ext/). Output: docs/_build/html.
docs: $(DOCS_STAMP)
	$(BIN)/sphinx-build -W -n --keep-going -b html docs docs/_build/html

bench: $(STAMP)
	$(BIN)/python -m bench.run

# Every figure of bench/README.md's latest section in one run (~8 minutes on 2 cores).
bench-full: $(STAMP)
	$(BIN)/python -m bench.run --full

clean:
	rm -rf $(VENV) .outbox docs/_build docs/_generated
