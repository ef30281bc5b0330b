# One command each for a fresh machine: `make serve` and `make test` create .venv and install what they need.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed-dev

.PHONY: serve test explore lint format install bench clean

$(INSTALLED): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(INSTALLED)

install: $(INSTALLED)

serve: $(INSTALLED)
	$(BIN)/deepinfer-gateway serve $(ARGS)

lint: $(INSTALLED)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench
	$(BIN)/mypy src

test: lint
	$(BIN)/pytest $(PYTEST_ARGS)

# The property and fuzz tests with fresh random examples (`make test` draws the same ones every run).
explore: $(INSTALLED)
	HYPOTHESIS_PROFILE=explore $(BIN)/pytest -p no:cacheprovider $(PYTEST_ARGS) $(shell grep -rl --include='test_*.py' 'from hypothesis' tests)

format: $(INSTALLED)
	$(BIN)/ruff check --fix src tests bench
	$(BIN)/ruff format src tests bench

bench: $(INSTALLED)
	$(BIN)/python bench/serving_overhead.py $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .ruff_cache
