# Two commands do all the set-up on a fresh machine: `make train` and `make test`.
# Both create .venv and install the package (CPU torch 2.13.0 first) when missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/fsdp2.yaml
TORCH_SPEC ?= torch==2.13.0

.PHONY: install train test test-full check-guarantees test-slurm test-lightning-range test-torch-range range-venvs lint \
	bench matrix docs clean docs-build

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,bench]"
	touch $@

install: $(VENV)/.installed

train: install
	$(PY) examples/train_llama.py fit --config $(CONFIG)

# JUNIT_DIR: also write pytest's junit XML there (.ci/run does, to check that every test the docs call tested passed).
junit = $(if $(JUNIT_DIR),--junitxml=$(JUNIT_DIR)/$(1).xml)

# tests/docs checks the built site in Chromium: `make docs` runs it, right after the build.
# The `full` tests (longer fault runs) are a stage of their own: `make test-full`; `soak` ones need FSDP_STRATEGIES_FULL=1.
# `make test` runs two passes: the `serial` tests (tests/conftest.py SERIAL_FILES: fault runs timed against their
# own deadlines) one at a time, and every other test on TEST_WORKERS pytest-xdist workers. Where this machine
# allows CPU groups (tests/cpu_group.sh --check: root and the cgroup v1 cpu controller; TEST_CPU_GROUPS=off to
# refuse them) the passes run at once, the serial one in a group weighing 64 times the other's, so its tests get
# the CPU whenever they want it and the other pass takes what they leave (alone, they keep one of the 2 cores idle
# about half the time); its output follows the other pass's. Elsewhere the serial pass runs after the other.
# Either failing fails.
TEST_WORKERS ?= 2
TEST_CPU_GROUPS ?= auto
OTHER_PASS = $(PY) -m pytest tests -m "not full and not serial" -n $(TEST_WORKERS) --dist worksteal -q \
	-p no:cacheprovider --durations=15 --ignore=tests/docs --ignore=tests/slurm $(call junit,test)
SERIAL_PASS = $(PY) -m pytest tests -m "not full and serial" -q -p no:cacheprovider --durations=15 \
	--ignore=tests/docs --ignore=tests/slurm $(call junit,test-serial)
test: install
	$(VENV)/bin/ruff check src examples tests benchmarks docs/hooks
	@rc=0; src=0; \
	if [ "$(TEST_CPU_GROUPS)" != off ] && tests/cpu_group.sh --check; then \
		log=$$(mktemp); \
		tests/cpu_group.sh fsdp-tests-serial 8192 $(SERIAL_PASS) > $$log 2>&1 & serial=$$!; \
		tests/cpu_group.sh fsdp-tests-other 128 $(OTHER_PASS) || rc=$$?; \
		wait $$serial || src=$$?; \
		echo "== make test: the serial pass (it ran beside the pass above, in the CPU group of the larger weight)"; \
		cat $$log; rm -f $$log; \
	else \
		echo "== make test: no CPU groups here (tests/cpu_group.sh): the serial pass runs after the other"; \
		$(OTHER_PASS) || rc=$$?; \
		$(SERIAL_PASS) || src=$$?; \
	fi; \
	[ $$src = 0 ] || rc=$$src; \
	exit $$rc

test-full: install
	$(PY) -m pytest tests -m full -q -p no:cacheprovider --durations=15 --ignore=tests/docs --ignore=tests/slurm \
		$(call junit,test-full)

# The SLURM scripts on a real two-node SLURM cluster on this machine (tests/slurm/cluster.sh: installs the Debian
# packages when missing -- needs root and apt-get, else the suite is skipped with that reason -- and starts
# munged, slurmctld and two slurmd). The cluster is stopped whatever the tests' outcome.
# SLURM_SELECT: a pytest -k expression for a cut (CI runs the hsdp sbatch submit, the scancel --signal=TERM requeue
# and ft_hsdp's group-step kill + heal;
# `make test-slurm` alone runs every test, the preemption by a higher-priority partition and the hang requeue too).
test-slurm: install
	@tests/slurm/cluster.sh start; rc=$$?; \
	if [ $$rc = 3 ]; then echo "test-slurm: SKIPPED -- SLURM cannot be installed on this machine (needs root and apt-get)"; exit 0; fi; \
	[ $$rc = 0 ] || exit $$rc; \
	SLURM_CONF=$${SLURM_TEST_DIR:-/var/tmp/fsdp_strategies-slurm}/slurm.conf $(PY) -m pytest tests/slurm -m slurm -q \
		-p no:cacheprovider --durations=10 $(call junit,slurm) $(if $(SLURM_SELECT),-k "$(SLURM_SELECT)"); rc=$$?; \
	tests/slurm/cluster.sh stop; exit $$rc

# Supported Lightning range (pyproject.toml: lightning>=2.6,<2.7): the fast tests against the oldest
# supported release and against the newest that pip resolves within the pin. Each is installed without
# dependencies into its own folder, put first on PYTHONPATH (the venv's other packages serve both);
# tests/conftest.py stops the run if another Lightning is imported; the workers of the multi-process tests get the
# same PYTHONPATH. tests/test_lightning_range.py adds one fit per strategy (and a resume) in one process; two real
# multi-process runs (marker lightning_range: fsdp2 on 2 ranks against one process, an ft_hsdp kill + heal) too.
LIGHTNING_OLDEST ?= 2.6.0
LIGHTNING_PIN := $(shell sed -n 's/^ *"\(lightning[<>=!~][^"]*\)",*$$/\1/p' pyproject.toml)
RANGE_TESTS ?= tests/test_lightning_range.py tests/test_lightning_seam.py tests/test_registry_and_errors.py tests/test_blocks.py \
	tests/test_resume.py tests/test_throughput.py tests/test_straggler.py tests/test_ddp_hooks.py tests/test_ft_data.py \
	tests/test_activation_checkpointing.py::test_lightning_single_device_applies_once_before_strategy \
	tests/test_fsdp_hsdp.py::test_fsdp2_two_ranks_matches_single_process_with_accumulation_and_clipping
# $(1) the requirement, $(2) its folder, $(3) "newest": when it resolves to the Lightning of .venv, which `make
# test` has just run every test against, only tests/test_lightning_range.py runs (the fit per strategy that
# `make test` skips); its other range tests would repeat `make test`'s on the same Lightning
define lightning_range_run
	rm -rf $(2) && $(PY) -m pip install -q --no-deps --target $(2) "$(1)"
	v=$$(cd $(2) && ls -d lightning-*.dist-info | sed 's/^lightning-\(.*\)\.dist-info$$/\1/') && \
	tests="$(RANGE_TESTS)" && \
	if [ "$(3)" = newest ] && [ "$$v" = "$$($(PY) -c 'import lightning; print(lightning.__version__)')" ]; then \
		tests=tests/test_lightning_range.py; \
		echo "== lightning $$v ($(1)) is .venv's: make test ran the rest against it"; fi && \
	echo "== fast tests against lightning $$v ($(1))" && \
	FSDP_STRATEGIES_EXPECT_LIGHTNING=$$v FSDP_STRATEGIES_LIGHTNING_DIR=$(abspath $(2)) PYTHONPATH=$(abspath $(2)):$(CURDIR)/src \
		$(PY) -m pytest $$tests -m "not multiprocess or lightning_range" -q -p no:cacheprovider \
		$(call junit,range$(subst .,,$(2)))
endef

test-lightning-range: install
	$(call lightning_range_run,lightning==$(LIGHTNING_OLDEST),.lightning-oldest)
	$(call lightning_range_run,$(LIGHTNING_PIN),.lightning-newest,newest)

# Supported torch / transformers / Python range (pyproject.toml: torch>=2.11, transformers>=5.17, Python
# 3.11-3.12), tested at both ends, each in a venv of its own under $(RANGE_DIR)/ (created when missing, reused
# after; a cache outside the clone, named after pyproject.toml's content, so that a fresh clone of the same
# dependencies does not unpack two CUDA builds of torch again -- ~4.6 GB each; RANGE_DIR=.range keeps them in the
# clone): the floor -- torch 2.11.0 on Python 3.12 with transformers 5.17.0, what the GPU
# machines lent here run -- and the newest -- torch 2.14.1 (the newest this machine's pip installs from its
# disk) on Python 3.11 with the newest transformers pip resolves. Both are CUDA builds from PyPI (they run
# on CPU). Each venv's first install prints its time. tests/conftest.py stops the run if another torch (or
# transformers) than the one asked for is imported. TORCH_RANGE_TESTS: the seam tests and the other fast
# single-process tests of the Lightning range, the HF load and export, MFU counting, the asynchronous
# writers; of the multi-process tests there, the ones marked torch_range: fsdp2 on 2 ranks against one
# process, hsdp 1x2x2 with tensor parallel on an HF Llama (GQA) and a memory budget, an ft_hsdp kill + heal
# (forkserver runner), a pretrained fine-tune + export + reload, an asynchronous checkpoint and its exact
# resume.
TORCH_FLOOR ?= 2.11.0
TORCH_FLOOR_PYTHON ?= python3.12
TRANSFORMERS_FLOOR ?= 5.17.0
TORCH_NEWEST ?= 2.14.1
TORCH_NEWEST_PYTHON ?= python3.11
# e.g. `make test-torch-range TORCH_NEWEST=2.15.0 RANGE_PIP_ENV=PIP_CONSTRAINT=/dev/null`: a torch above this
# machine's pip cap (/etc/xdg/pip, torch<=2.14.1), from the registry
RANGE_PIP_ENV ?=
RANGE_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/fsdp-strategies
RANGE_DIR ?= $(RANGE_CACHE)/range-$(shell (cat pyproject.toml; echo '$(TORCH_FLOOR) $(TORCH_FLOOR_PYTHON) \
	$(TRANSFORMERS_FLOOR) $(TORCH_NEWEST) $(TORCH_NEWEST_PYTHON) $(RANGE_PIP_ENV)') | sha256sum | cut -c1-16)
TORCH_RANGE_TESTS ?= tests/test_lightning_seam.py tests/test_registry_and_errors.py tests/test_blocks.py \
	tests/test_straggler.py tests/test_ddp_hooks.py tests/test_throughput.py tests/test_torch_range.py \
	tests/test_activation_checkpointing.py::test_lightning_single_device_applies_once_before_strategy \
	tests/test_tensor_parallel.py tests/test_hf_pretrained.py tests/test_hf_export.py \
	tests/test_async_checkpoint.py \
	tests/test_fsdp_hsdp.py::test_fsdp2_two_ranks_matches_single_process_with_accumulation_and_clipping \
	tests/test_ft_hsdp.py::test_forkserver_runner_restarts_preimported_groups_that_heal
# python3.N's path: the one on PATH if it runs, else pyenv's newest 3.N.x (its shims run only the selected
# version)
find_python = $(firstword $(shell for p in $(1) \
	$$(ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/$(1:python%=%).*/bin/$(1) 2>/dev/null | sort -rV); \
	do "$$p" -c "" 2>/dev/null && echo "$$p"; done))
# $(1) venv folder, $(2) its Python (python3.N), $(3) torch requirement, $(4) transformers requirement
# (one build at a time per venv: flock; the package itself is installed as a copy, not editable -- the clone
# that built the venv may be gone -- and the runs put this clone's src/ first on PYTHONPATH; other caches of
# this kind unused for 3 days are removed)
define torch_range_venv
	@start=$$(date +%s); set -e; py="$(call find_python,$(2))"; \
	[ -n "$$py" ] || { echo "test-torch-range: no $(2) here (on PATH or under pyenv)"; exit 2; }; \
	mkdir -p $(dir $(1)); exec 9> $(1).lock; flock 9; \
	if [ ! -f $(1)/.installed ]; then \
		rm -rf $(1); "$$py" -m venv $(1); \
		$(RANGE_PIP_ENV) $(1)/bin/python -m pip install -q "$(3)"; \
		$(RANGE_PIP_ENV) $(1)/bin/python -m pip install -q ".[test,hf,bench]" "$(4)"; \
		echo "== $(1): venv ($(2), $(3), $(4)) installed in $$(( $$(date +%s) - start )) s"; \
		touch $(1)/.installed; \
	fi; \
	find $(RANGE_CACHE) -mindepth 1 -maxdepth 1 -name 'range-*' ! -path '$(RANGE_DIR)' -mtime +3 \
		-exec rm -rf {} + 2>/dev/null || true; touch $(RANGE_DIR)
endef
# $(1) venv folder, $(2) the torch version it must import, $(3) the transformers one (empty: pip's choice)
define torch_range_run
	@echo "== fast tests against torch $(2) ($$($(1)/bin/python -c 'import sys, transformers; \
		print(sys.version.split()[0], "python, transformers", transformers.__version__)'))"
	FSDP_STRATEGIES_EXPECT_TORCH=$(2) FSDP_STRATEGIES_EXPECT_TRANSFORMERS=$(3) PYTHONPATH=$(CURDIR)/src \
		$(1)/bin/python -m pytest $(TORCH_RANGE_TESTS) -m "not multiprocess or torch_range" -q -p no:cacheprovider \
		--durations=10 \
		$(call junit,torch-range-$(2))
endef
$(RANGE_DIR)/torch-$(TORCH_FLOOR)/.installed:
	$(call torch_range_venv,$(RANGE_DIR)/torch-$(TORCH_FLOOR),$(TORCH_FLOOR_PYTHON),torch==$(TORCH_FLOOR),$\
		transformers==$(TRANSFORMERS_FLOOR))
$(RANGE_DIR)/torch-$(TORCH_NEWEST)/.installed:
	$(call torch_range_venv,$(RANGE_DIR)/torch-$(TORCH_NEWEST),$(TORCH_NEWEST_PYTHON),torch==$(TORCH_NEWEST),$\
		transformers)

# the two venvs alone (no tests): .ci/run builds them in the background while `make test` runs
range-venvs: $(RANGE_DIR)/torch-$(TORCH_FLOOR)/.installed $(RANGE_DIR)/torch-$(TORCH_NEWEST)/.installed

test-torch-range: $(RANGE_DIR)/torch-$(TORCH_FLOOR)/.installed $(RANGE_DIR)/torch-$(TORCH_NEWEST)/.installed
	$(call torch_range_run,$(RANGE_DIR)/torch-$(TORCH_FLOOR),$(TORCH_FLOOR),$(TRANSFORMERS_FLOOR))
	$(call torch_range_run,$(RANGE_DIR)/torch-$(TORCH_NEWEST),$(TORCH_NEWEST),)

lint: install
	$(VENV)/bin/ruff check src examples tests benchmarks docs/hooks

# The full real-models matrix (models x strategies x callbacks x precision, ~25 min on 2 cores);
# `make test` runs its representative cut.
matrix: install
	$(PY) tests/matrix/cells.py --full

bench: install
	$(PY) benchmarks/run.py all

# Documentation site (mkdocs.yml, docs/): strict build into site/ (a broken link or a missing reference
# fails), then tests/docs opens the built pages in headless Chromium (the Debian package `chromium`,
# installed here when missing) and checks every strategy and callback page's option table.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
$(VENV)/.docs-installed: $(VENV)/.installed pyproject.toml
	$(PY) -m pip install -q -e ".[docs]"
	touch $@

# docs-build: the strict build alone (no root, no browser), e.g. to read site/ with `python -m http.server -d site`
# (Material's search box needs a server: it does not load under file://)
docs-build: $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

docs: docs-build
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
		{ echo "installing chromium (apt-get)"; $(SUDO) apt-get update -qq && \
		  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }
	$(PY) -m pytest tests/docs -q -p no:cacheprovider $(call junit,docs)

# Every test the docs call tested (tests/guarantees.py) passed in one of this run's stages (their junit XML).
check-guarantees: install
	@test -n "$(JUNIT_DIR)" || { echo "check-guarantees: set JUNIT_DIR to the folder the stages wrote their junit XML to"; exit 2; }
	$(PY) tests/check_guarantees.py $(JUNIT_DIR)/*.xml

clean:
	rm -rf $(VENV) lightning_logs checkpoints site
