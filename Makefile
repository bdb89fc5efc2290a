# The two commands a newcomer needs: `make demo` and `make test`.
# Everything installs into a project-local virtualenv with the tested pins.

PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test lint bench clean

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
	$(BIN)/ruff check stager client trainer tests bench
	$(BIN)/ruff format --check stager client trainer tests bench

bench: $(STAMP)
	$(BIN)/python bench/ops_bench.py

clean:
	rm -rf $(VENV) build *.egg-info
