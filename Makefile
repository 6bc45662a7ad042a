# Quickstart targets. Each one installs what it needs into .venv first.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# No model hub is reachable from CI or this dev box: use the local Hugging Face cache only.
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install seed-cache demo test typecheck test-e2e test-all docs bench gpu-wheels gpu-check image image-test clean

$(BIN)/.installed: pyproject.toml requirements.txt requirements-test.txt requirements-test-nodeps.txt requirements-docs.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned: on the dev/CI machines this takes the local CPU wheel.
	$(BIN)/python -m pip install -q "$$(grep '^torch==' requirements.txt)"
	# requirements-test.txt includes requirements.txt (the image installs only the latter).
	$(BIN)/python -m pip install -q -r requirements-test.txt
	# pins whose own requirements conflict with the ones above (see the file): without their dependencies
	$(BIN)/python -m pip install -q --no-deps -r requirements-test-nodeps.txt
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $@

install: $(BIN)/.installed

# The MLflow tracking server the MLflow tests start (a service of its own: requirements-mlflow-server.txt).
MLFLOW_VENV := .venv-mlflow
$(MLFLOW_VENV)/.installed: requirements-mlflow-server.txt
	$(PYTHON) -m venv $(MLFLOW_VENV)
	$(MLFLOW_VENV)/bin/python -m pip install -q -r requirements-mlflow-server.txt
	touch $@

seed-cache: install
	$(BIN)/kubetune seed-hf-cache

demo: seed-cache
	# --overwrite: a second `make demo` replaces the first one's model (kubetune refuses a finished run otherwise)
	$(BIN)/kubetune run examples/sentiment-minilm.yaml --overwrite
	$(BIN)/kubetune predict runs/sentiment-minilm "I love how smooth this ride is" "I would never trust a self-driving car with my kids" "The car has four wheels"
	$(BIN)/python -m kubetune.summary runs/sentiment-minilm

# The two tiers (README, Development). Each prints its 25 slowest tests and its total at the end, so a slip
# is seen when it happens. PYTEST_ARGS adds to both (e.g. PYTEST_ARGS="-x -k serve").
PYTEST_ARGS ?=
DURATIONS   := --durations=25 --durations-min=1
# make test's test processes (pytest-xdist): 2 for the 2 cores CI has; TEST_PROCS=0 runs them in this one.
# --dist loadgroup: each module's tests in one process, and the modules sharing a session run together
# (tests/conftest.py).
TEST_PROCS  ?= 2
PARALLEL    := $(if $(filter-out 0,$(TEST_PROCS)),-n $(TEST_PROCS) --dist loadgroup)

# make test: every unit test and one end-to-end run of each user path (pyproject's addopts leave out the
# e2e, slow and gpu markers).
test: install $(MLFLOW_VENV)/.installed
	# Formatting and lint first (seconds): ruff format and ruff check, 120 columns (pyproject.toml).
	$(BIN)/ruff format --check --quiet .
	$(BIN)/ruff check --quiet .
	# The type checker (make typecheck) runs beside the tests, niced: its ~30 s of one core fill the cores' idle
	# moments rather than adding to the wall clock; its output comes after the tests', and either failing fails.
	nice $(BIN)/python -m mypy --cache-dir $(VENV)/.mypy_cache > $(VENV)/typecheck.log 2>&1 & types=$$!; \
	$(BIN)/python -m pytest -q $(PARALLEL) $(DURATIONS) $(PYTEST_ARGS); tests=$$?; \
	wait $$types; typed=$$?; echo "make typecheck:"; cat $(VENV)/typecheck.log; exit $$(( tests || typed ))

# make typecheck: mypy over src/kubetune with pyproject.toml's [tool.mypy], zero errors. Strictness: mypy's
# defaults (the bodies of unannotated functions are not checked; a package without types is Any) plus strict
# equality and no unused or redundant ignores everywhere; on config/ (the job spec), tasks/base.py (the task
# seam) and training/ also every function typed in full, their bodies checked, no bare generics, no Any
# returned and no implicit re-exports. Its cache lives in the venv (rebuilt with it, nothing in the tree):
# cold, 25 s of CPU on the dev box (the packages pyproject.toml names are read as Any, not analysed); warm, 2 s.
typecheck: install
	$(BIN)/python -m mypy --cache-dir $(VENV)/.mypy_cache

# make test-e2e: the heavier end-to-end variants (marker e2e): SIGKILL/resume matrices, world-size changes,
# long comparisons. CI runs it after make test (.ci/run).
test-e2e: install $(MLFLOW_VENV)/.installed
	$(BIN)/python -m pytest -q -m "e2e and not slow and not gpu" $(DURATIONS) $(PYTEST_ARGS)

# make docs: the documentation site (mkdocs.yml, docs/) in strict mode into build/docs (ignored), after checking that
# its generated reference pages are what the code makes now (scripts/docs_reference.py --write regenerates them).
docs: install
	$(BIN)/python scripts/docs_reference.py --check
	$(BIN)/python -m mkdocs build --strict -d build/docs

test-all: install $(MLFLOW_VENV)/.installed
	$(BIN)/python -m pytest -q -m "" $(DURATIONS) $(PYTEST_ARGS)

# kubetune against the seed loop and HF Trainer (about 12 minutes on 2 cores; results in benchmarks/results/)
bench: seed-cache
	$(BIN)/python benchmarks/run.py $(BENCH_ARGS)

# The wheels the GPU machine lacks (Python 3.12, manylinux x86-64), into gpu-wheels/ (ignored), checked to fit
# 48 MiB of the 64 MiB that travel with the tree: scripts/gpu_wheels.py says which and why.
gpu-wheels: install
	$(BIN)/python scripts/gpu_wheels.py --dest gpu-wheels

# On the GPU machine (its own python3; no .venv, no network; 9 minutes at most): gpu-wheels/ and kubetune (--no-deps) into a
# temporary site, then `pytest -m gpu` and benchmarks/gpu_llm.py; results.md and results.json into OUT.
GPU_PYTHON ?= python3
OUT        ?= gpu-results
gpu-check:
	$(GPU_PYTHON) scripts/gpu_check.py --wheels gpu-wheels --out $(OUT)

VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE   ?= ghcr.io/kubetune/trainer
# docker or podman. BASE_IMAGE and TORCH_INDEX: empty = the Dockerfile's production defaults
# (python:3.11-slim-bookworm, the PyTorch index of the variant); scripts/image_test.py passes both
# on a host without Docker Hub and the PyTorch index.
ENGINE      ?= docker
BASE_IMAGE  ?=
TORCH_INDEX ?=
IMAGE_ARGS  := $(if $(BASE_IMAGE),--build-arg BASE_IMAGE=$(BASE_IMAGE)) $(if $(TORCH_INDEX),--build-arg TORCH_INDEX=$(TORCH_INDEX))
# The tags rendered manifests use by default (kubetune.config.cluster.default_image).
image:
	$(ENGINE) build -f docker/Dockerfile --build-arg VARIANT=cpu $(IMAGE_ARGS) -t $(IMAGE):$(VERSION)-cpu .
	$(ENGINE) build -f docker/Dockerfile --build-arg VARIANT=cuda $(IMAGE_ARGS) -t $(IMAGE):$(VERSION)-cuda .

# The CPU image built for real with podman (tools installed when missing, a debootstrapped base),
# smoke-tested as uid 1000 without network, the CUDA build's check, and a rendered PyTorchJob's pods
# run as containers (scripts/image_test.py). Needs root (apt-get, podman); 5 min 11 s cold here.
image-test: install
	ENGINE=podman $(BIN)/python scripts/image_test.py

clean:
	rm -rf runs .pytest_cache
