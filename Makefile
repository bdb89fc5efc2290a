# The two commands a newcomer needs: `make demo` and `make test`.
# Everything installs into a project-local virtualenv with the tested pins.

PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo demo-multinode demo-prestage test test-debian lint bench bench-fanout clean slurm-up slurm-down image-tools

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

# The same cluster with pre-staging (root): a user's job queued behind another finds its
# declared data already on its node when it starts; then the same with the planner
# stopped. Figures printed, cluster taken down.
demo-prestage: $(STAMP)
	$(BIN)/python deploy/demo/prestage.py

# Two pytest-xdist workers (TEST_WORKERS=0: one process), each module whole on one of
# them, the tests that use what the machine has one of (the SLURM cluster, the installed
# package, a nested test run) all on one, the slow groups first (tests/conftest.py).
TEST_WORKERS ?= 2

PYTEST := -m pytest -q -ra -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

# Debian 12's python3.11 is 3.11.2, what deploy/install.sh installs with; the default
# interpreter may be newer (3.11.4 added to tarfile what stager once relied on). These
# suites need no torch: their venv has stager and its test packages only.
# DEBIAN_PYTHON= (empty) leaves this run out, on a machine that is not Debian 12.
DEBIAN_PYTHON ?= /usr/bin/python3.11
DEBIAN_VENV ?= .venv-debian
DEBIAN_STAMP := $(DEBIAN_VENV)/.installed
# Chosen to be short (a few minutes): the tar corpus against GNU tar on every pool, link
# judging, header reading, hostile archives, image building from tars and trees, and
# the API through a real daemon (tars with links, images, refusals as sentences).
DEBIAN_TESTS := tests/stager/archive/test_links.py tests/stager/archive/test_tar_members.py \
	tests/stager/archive/test_split_tar_review.py tests/stager/ops/test_archive_compat.py \
	tests/stager/ops/test_malicious_archives.py tests/stager/image/test_build.py \
	tests/stager/image/test_links_and_names.py tests/stager/image/test_squashfs.py \
	tests/stager/test_api.py \
	tests/stager/test_image_datasets.py
# test_squashfs runs whole there, its read through squashfuse as a user too (~5 s):
# that reader alone looks names up through the folder indexes stager's writer made
# (unsquashfs reads every listing whole; a wrong index fails only the FUSE read).

# A bare Debian 12 may lack the interpreter or its venv module (ensurepip): as root
# they are installed (fresh machines have empty package lists: updated on a failure).
DEBIAN_APT := DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	python3.11 python3.11-venv

$(DEBIAN_STAMP): pyproject.toml constraints.txt
	@if ! $(DEBIAN_PYTHON) -c 'import ensurepip' 2>/dev/null && [ "$$(id -u)" = 0 ]; then \
		echo "== installing python3.11 python3.11-venv"; \
		$(DEBIAN_APT) || { apt-get update -qq && $(DEBIAN_APT); }; fi
	@$(DEBIAN_PYTHON) -c 'import ensurepip' 2>/dev/null || { echo "make: $(DEBIAN_PYTHON)" \
		"cannot make a venv: install Debian's python3.11 and python3.11-venv" \
		"(apt-get install python3.11-venv), or leave this run out with DEBIAN_PYTHON="; exit 1; }
	@echo "== installing stager and its test packages into $(DEBIAN_VENV) ($(DEBIAN_PYTHON))"
	test -x $(DEBIAN_VENV)/bin/python || $(DEBIAN_PYTHON) -m venv $(DEBIAN_VENV)
	$(DEBIAN_VENV)/bin/pip install --progress-bar on -c constraints.txt -e '.[test]'
	touch $(DEBIAN_STAMP)

ifeq ($(strip $(DEBIAN_PYTHON)),)
DEBIAN_NEEDS :=
DEBIAN_RUN := echo "== DEBIAN_PYTHON is empty: the suites under Debian 12's interpreter are left out"
else
DEBIAN_NEEDS := $(DEBIAN_STAMP)
DEBIAN_RUN := echo "== again under $(DEBIAN_PYTHON): $(DEBIAN_TESTS)" && \
	$(DEBIAN_VENV)/bin/python $(PYTEST) $(DEBIAN_TESTS)
endif

test-debian: image-tools $(DEBIAN_NEEDS)
	$(DEBIAN_RUN)

# The whole suite, then the archive, extraction, image and API suites again under
# Debian 12's own interpreter (test-debian); a failure of either fails the run, and
# the second runs whatever the first said.
test: $(STAMP) image-tools $(DEBIAN_NEEDS)
	status=0; $(BIN)/python $(PYTEST) $(PYTEST_ARGS) || status=$$?; \
	$(DEBIAN_RUN) || status=1; \
	exit $$status

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
	rm -rf $(VENV) $(DEBIAN_VENV) build *.egg-info
