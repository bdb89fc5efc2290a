# The two commands a newcomer needs: `make demo` and `make test`.
# Everything installs into a project-local virtualenv with the tested pins.

PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test lint bench clean slurm-up slurm-down

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[train,test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python deploy/demo/run.py

test: $(STAMP)
	$(BIN)/python -m pytest -q -ra $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check stager client trainer tests bench deploy
	$(BIN)/ruff format --check stager client trainer tests bench deploy
	shellcheck deploy/slurm/*.sh deploy/slurm/local-cluster/*.sh

# A real one-node SLURM cluster on this (Debian) machine, wired with deploy/slurm's
# prolog and epilog; needs root. The SLURM test brings it up by itself.
slurm-up:
	deploy/slurm/local-cluster/up.sh

slurm-down:
	deploy/slurm/local-cluster/down.sh

# Each prints ratios measured side by side in one run; see docs/benchmarks.md.
bench: $(STAMP)
	$(BIN)/python -m bench.bench_copy
	$(BIN)/python -m bench.bench_extract
	$(BIN)/python bench/bench_api.py
	$(BIN)/python bench/bench_cache.py
	$(BIN)/python bench/bench_client.py
	$(BIN)/python -m bench.bench_recipes
	$(BIN)/python bench/input_pipeline.py

clean:
	rm -rf $(VENV) build *.egg-info
