# selfspec developer commands. `make test` is what CI runs (.ci/run).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is pinned first and on its own: on a CPU machine an unpinned torch pulls a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: install test demo bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest -n 2 --dist loadgroup $(PYTEST_ARGS)

demo: install
	$(PY) -m selfspec.cli demo

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
