# vllmini: two commands.
#   make course   create .venv (once), install the pinned set, start JupyterLab on notebooks/
#   make test     create/use the same .venv, run every test and re-run every notebook strictly (nbval)
#
# Options: PYTHON=python3.12 (any Python >= 3.11)
#          TORCH_INDEX=https://download.pytorch.org/whl/cpu   (a CPU-only torch build, much smaller;
#          PyPI's Linux torch is the CUDA build and also runs on a CPU)

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.vllmini-installed
PYTEST_ARGS ?=

.PHONY: course test setup lint clean gpu-check

# as root (containers, cloud machines) JupyterLab refuses to start without --allow-root
JUPYTER_ARGS ?= $(if $(filter 0,$(shell id -u)),--allow-root,)

course: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks $(JUPYTER_ARGS)

test: $(STAMP)
	$(VENV)/bin/python -m pytest --nbval --nbval-current-env --nbval-sanitize-with notebooks/nbval_sanitize.cfg \
		--nbval-cell-timeout=600 notebooks tests $(PYTEST_ARGS)

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), f"vllmini needs Python >= 3.11, this is {sys.version.split()[0]}: run make PYTHON=python3.11 ..."'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade "pip>=24"
	@if [ -n "$(TORCH_INDEX)" ]; then \
		$(PY) -m pip install --quiet -c constraints.txt torch --index-url "$(TORCH_INDEX)"; fi
	$(PY) -m pip install --quiet -c constraints.txt -e ".[course,test]"
	@touch $(STAMP)
	@echo "vllmini: environment ready in $(VENV)"

lint: $(STAMP)
	$(VENV)/bin/ruff check vllmini tests benchmarks scripts

# On a machine with an NVIDIA GPU and CuPy: the GPU tests, GPU notebooks, sanitizer and benchmarks.
gpu-check:
	$(PY) scripts/gpu_check.py all

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build dist
