# The two commands of the README. Each creates/updates the local virtual environment first.
#   make train [ARGS="model=distilgpt2 trainer.max_steps=100"]   the offline quickstart
#   make test  [PYTEST_ARGS="-k packing"]                          lint, docs, then the test suite
#   make test-fast [PYTEST_ARGS=...]                                the suite without `slow` tests
PYTHON ?= python3
VENV ?= .venv
ARGS ?=
PYTEST_ARGS ?=
# The tests are independent: one pytest-xdist worker per core of the 2-core CI machine.
PYTEST_WORKERS ?= 2

.PHONY: train test test-fast lint docs bench bench-accelerator clean-venv

# Every command here writes the bytecode of what it imports, the first time, even where
# PYTHONDONTWRITEBYTECODE is set (CI machines often set it): without it each process (each test
# worker, each flaxlm-train a test starts) would compile JAX, transformers and PyTorch from
# source again. That is also why pip compiles nothing: a run imports a fraction of what the
# packages hold, and compiling all of it ahead took longer than the run's own compiling.
unexport PYTHONDONTWRITEBYTECODE

# The venv with a current pip, then the package (with the extras given, e.g. [test]).
define install
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet --no-compile -e '.$(1)'
endef

# Reinstall only when the package's requirements change.
$(VENV)/.installed: pyproject.toml setup.py
	$(call install,)
	touch $@

# The tpu extra (libtpu) too: tests/test_plan.py compiles for TPU slices with it on the CPU.
# One resolution of everything, which also satisfies `train`.
TEST_EXTRAS := [test,tpu]
$(VENV)/.installed-test: pyproject.toml setup.py
	$(call install,$(TEST_EXTRAS))
	touch $(VENV)/.installed $@

train: $(VENV)/.installed
	$(VENV)/bin/flaxlm-train $(ARGS)

test: lint docs
	$(VENV)/bin/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The inner loop: every test but those marked `slow`, longer than a few seconds (make test runs them too).
test-fast: $(VENV)/.installed-test
	$(VENV)/bin/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile -m "not slow" $(PYTEST_ARGS)

# Style and import order (ruff), and the package's layering with no import cycles
# (import-linter's contracts in pyproject.toml).
lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check src tests benchmarks setup.py
	$(VENV)/bin/lint-imports

# The documentation site (MkDocs) into build/site; a broken link or anchor is an error.
docs: $(VENV)/.installed-test
	$(VENV)/bin/mkdocs build --strict --quiet

# make bench [ROUNDS=3] [ARGS="model=llama-tiny"] [FINETUNE_ARGS="--batch 32"]: the training
# step, then the fine-tuning step, against their peers (each contender in processes of its own,
# alternating over ROUNDS rounds), and the quickstart's time to its first step.
bench: $(VENV)/.installed-test
	$(VENV)/bin/python benchmarks/train_step.py --rounds $(or $(ROUNDS),3) --quickstart $(ARGS)
	$(VENV)/bin/python benchmarks/finetune_step.py --rounds $(or $(ROUNDS),3) $(FINETUNE_ARGS)

# make bench-accelerator [ARGS="--models gpt2 --max-batch 256"], on a GPU or TPU machine: GPT-2
# and distilgpt2 at sequence 1024 in bfloat16, the largest batch that fits, tokens/s and MFU.
bench-accelerator: $(VENV)/.installed-test
	$(VENV)/bin/python benchmarks/accelerator.py $(ARGS)

clean-venv:
	rm -rf $(VENV)
