# The two commands of the README. Each creates/updates the local virtual environment first.
#   make train [ARGS="model=distilgpt2 trainer.max_steps=100"]   the offline quickstart
#   make test  [PYTEST_ARGS="-k packing"]                          lint, then the test suite
PYTHON ?= python3
VENV ?= .venv
ARGS ?=
PYTEST_ARGS ?=
# The tests are independent: one pytest-xdist worker per core of the 2-core CI machine.
PYTEST_WORKERS ?= 2

.PHONY: train test lint bench clean-venv

# Reinstall only when the package's requirements change.
$(VENV)/.installed: pyproject.toml setup.py
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(VENV)/bin/python -m pip install --quiet -e '.[test]'
	touch $@

train: $(VENV)/.installed
	$(VENV)/bin/flaxlm-train $(ARGS)

test: lint
	$(VENV)/bin/python -m pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

# Style and import order (ruff), and the package's layering with no import cycles
# (import-linter's contracts in pyproject.toml).
lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check src tests benchmarks setup.py
	$(VENV)/bin/lint-imports

bench: $(VENV)/.installed-test
	$(VENV)/bin/python benchmarks/train_step.py --quickstart $(ARGS)

clean-venv:
	rm -rf $(VENV)
