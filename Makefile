# hf-vit: `make train` runs the main job, `make test` the test suite. Both create .venv and install into it first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Nothing in the main job or the tests may reach the Hugging Face Hub.
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export HF_HUB_DISABLE_TELEMETRY := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup train test lint bench clean

# make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu: torch's CPU build (a plain install is CUDA's on Linux).
# torch alone comes from that index, asked once (an index that does not answer fails in seconds, not minutes of
# retries); its dependencies come from PyPI with the package's.
TORCH_INDEX ?=

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt torch==2.13.0 \
		$(if $(TORCH_INDEX),--no-deps --retries 0 --timeout 30 --index-url $(TORCH_INDEX))
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev]"
	touch $@

# make train QUICK=1: a short version (a tenth of the training) into outputs/quick.
train: setup
	$(PY) scripts/main_job.py $(if $(QUICK),--quick,--output_dir outputs/main)

# The test files run in TEST_WORKERS processes side by side (pytest-xdist), each file whole in one of them.
# make test TESTS=tests/test_data.py PYTEST_ARGS="-k corrupt -x": some files, and pytest's own arguments.
TEST_WORKERS ?= 2
TESTS ?= tests
PYTEST_ARGS ?=
test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS) $(TESTS)

lint: setup
	$(VENV)/bin/ruff check hf_vit hf_vit_cli scripts tests benchmarks
	$(VENV)/bin/ruff format --check hf_vit hf_vit_cli scripts tests benchmarks

# The default run (no compiled rows, no size sweep) takes under 15 minutes on 2 CPU cores. timm's and torchvision's
# columns need an environment that has them: `bash benchmarks/peer_env.sh` builds one, then
# make bench BENCH_PY=~/.cache/hfvit-peer-env/bin/python.
BENCH_PY ?= $(PY)
bench: setup
	$(BENCH_PY) benchmarks/benchmark.py --steps 2 --repeats 5 --profile --json docs/benchmarks.json \
		--doc docs/benchmarks.md

clean:
	rm -rf outputs .pytest_cache
