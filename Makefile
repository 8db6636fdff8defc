# Switchyard: `make run` starts the three services, `make test` runs the tests.
# Both set up the virtual environment on first use.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
SY     := $(VENV)/bin/switchyard
STAMP  := $(VENV)/.installed
INDEX  ?= data/index

.PHONY: install run test proto index lint bench clean k8s-config

install: $(STAMP)

# requirements.lock pins every package CI installs (torch pinned to the CPU
# build; an open range would pull a multi-GB CUDA build).
$(STAMP): pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.lock
	$(PY) -m pip install -q --no-deps -e .
	touch $@

proto: $(STAMP)
	$(PY) tools/gen_proto.py

# An index built before the query encoder was exported beside it gets the encoder alone:
# its passages (perhaps the user's own files) are left as they are.
$(INDEX)/query_encoder.onnx: | $(STAMP)
	if [ -f $(INDEX)/index.faiss ]; then $(SY) index --encoder-only --out $(INDEX); else $(SY) index --out $(INDEX); fi

index: $(INDEX)/query_encoder.onnx

run: $(STAMP) $(INDEX)/query_encoder.onnx
	$(SY) up

# The tests copy the default index from $(INDEX) where it is current (tests/conftest.py).
# TEST_WORKERS=N shares the suite among N processes (pytest-xdist), a test file to one process (--dist loadfile:
# a file's module-scoped servers serve its tests in one process): most of the suite's time is spent waiting on
# the servers it starts, so two take it from about 610 s to 350-390 s on two cores. The default, 0, runs it in
# this process alone: on two cores two processes make load-sensitive tests flaky (2 of 3 clean runs failed one).
TEST_WORKERS ?= 0
test: $(STAMP) $(INDEX)/query_encoder.onnx
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile

bench: $(STAMP) $(INDEX)/query_encoder.onnx
	$(SY) bench compare

# The ConfigMap of deploy/k8s/base carries the shipped config/ unchanged (kustomize reads
# generator files only from inside the kustomization's folder); run before `kubectl apply -k`.
# deploy/k8s/base/config/ holds config/'s files, committed (kustomize reads the ConfigMap's files
# only inside the kustomization's folder); after editing config/, refresh them (a test checks).
k8s-config:
	mkdir -p deploy/k8s/base/config
	cp config/queue.json config/scheduler_config.json config/memory_policy.toml config/switchyard.json \
		deploy/k8s/base/config/

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
