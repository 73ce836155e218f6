# The two commands a newcomer types: `make demo` and `make test`.
# Both create their own virtual environment in .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint format bench bench-full clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/agent-outbox demo

test: $(STAMP)
	$(BIN)/python -m pytest $(ARGS)

# ruff (configured in pyproject.toml): lint and format check; CI fails on either.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: $(STAMP)
	$(BIN)/python -m bench.run

# Every figure of bench/README.md's latest section in one run (~8 minutes on 2 cores).
bench-full: $(STAMP)
	$(BIN)/python -m bench.run --full

clean:
	rm -rf $(VENV) .outbox
