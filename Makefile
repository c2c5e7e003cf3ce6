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

# The main job on the embedded default: train Medusa heads with the default recipe (self-generated, self-distilled
# data; no dataset or hub needed), index the conversations the model wrote for it into a datastore, calibrate the
# heads' tree to this machine, then answer three sample prompts with and without them (heads + prompt lookup +
# datastore in one tree), and with the committed feature drafter as lookup's fallback (+ the datastore) beside
# them. `make demo DEMO_TRAIN=0` skips training and uses the committed heads with prompt lookup.
DEMO_DIR ?= runs/demo
DEMO_TRAIN ?= 1
demo: install
ifeq ($(DEMO_TRAIN),1)
	$(PY) train/medusa.py --config configs/medusa/smollm2-135m.yaml output_dir=$(DEMO_DIR) heads_dir=$(DEMO_DIR)/heads
	$(PY) -m selfspec.cli datastore --data $(DEMO_DIR)/data/distilled --out $(DEMO_DIR)/datastore
	# Pick the tree that is fastest on this machine (verification cost differs a lot between CPUs and GPUs), merged
	# with lookup and the datastore as the demo decodes.
	$(PY) -m selfspec.cli calibrate --heads $(DEMO_DIR)/heads --sizes 1,2,3,4,6,8,16 --repeats 5 --no-measure \
		--merged-with lookup+datastore:$(DEMO_DIR)/datastore
	$(PY) -m selfspec.cli demo --heads $(DEMO_DIR)/heads --datastore $(DEMO_DIR)/datastore
else
	$(PY) -m selfspec.cli demo
endif

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
