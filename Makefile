# The two commands a newcomer needs: `make demo` and `make test`.
# Everything installs into a project-local virtualenv with the tested pins.

PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo demo-multinode test lint bench bench-fanout clean slurm-up slurm-down image-tools

venv: $(STAMP)

# The first build downloads and installs torch and the rest (a few minutes): pip shows
# each package as it goes, but its bar is silent off a terminal (a log, CI) for the
# minute torch takes, so a line every $(HEARTBEAT_S) s says the build is still moving.
HEARTBEAT_S ?= 15
$(STAMP): pyproject.toml constraints.txt
	@echo "== installing stager and its packages into $(VENV) (first time only; a few minutes)"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@start=$$(date +%s); \
	(while sleep $(HEARTBEAT_S); do \
		echo "== still installing: $$(( $$(date +%s) - start )) s, $$(du -sm $(VENV) | cut -f1) MB in $(VENV)"; \
	done) & beat=$$!; \
	trap 'kill $$beat 2>/dev/null' EXIT; \
	run() { echo "$$*"; "$$@"; }; \
	set -e; \
	run $(BIN)/pip install --progress-bar on --upgrade pip; \
	run $(BIN)/pip install --progress-bar on -c constraints.txt -e '.[train,test]'
	touch $(STAMP)
	@echo "== $(VENV) is ready"

demo: $(STAMP)
	$(BIN)/python deploy/demo/run.py $(DEMO_ARGS)

# A 4-node SLURM cluster on this machine (root), one dataset fanned out to every node
# while the shared storage is read once; figures printed, cluster taken down.
demo-multinode: $(STAMP)
	$(BIN)/python deploy/demo/multinode.py

# Two pytest-xdist workers (TEST_WORKERS=0: one process), each module whole on one of
# them, the tests that change the machine itself (users, the SLURM cluster) all on one,
# the slow groups first (tests/conftest.py).
TEST_WORKERS ?= 2

test: $(STAMP) image-tools
	$(BIN)/python -m pytest -q -ra -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder \
		$(PYTEST_ARGS)

# Image mode's Debian packages (FUSE readers, squashfs-tools, erofs-utils), as root.
image-tools:
	deploy/image/packages.sh

lint: $(STAMP)
	$(BIN)/ruff check stager client trainer tests bench deploy
	$(BIN)/ruff format --check stager client trainer tests bench deploy
	shellcheck deploy/install.sh deploy/slurm/*.sh deploy/slurm/local-cluster/*.sh
	shellcheck -x deploy/slurm/multinode/*.sh
	shellcheck -x deploy/image/*.sh

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
	$(BIN)/python -m bench.bench_image

# Multi-node fan-out on the 4-node test cluster (root): 200 MB, N = 1, 2, 4.
bench-fanout: $(STAMP)
	$(BIN)/python bench/bench_fanout.py --compare-modes

clean:
	rm -rf $(VENV) build *.egg-info
