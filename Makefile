PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install typecheck test test-fast test-serial test-engines engines engines-vllm demo bench-cpu lint-speed clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml constraints-cpu.txt
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints-cpu.txt -e '.[torch,transformers,test]'
	touch $(STAMP)

install: $(STAMP)

# The pinned engine releases the engine tests run (python sources only, in the ignored .engines/).
engines: $(STAMP)
	$(BIN)/python tests/engines/fetch.py sglang

engines-vllm: $(STAMP)
	$(BIN)/python tests/engines/fetch.py vllm

# pytest-xdist workers for `make test`: auto is one per CPU; 0 runs in one process (as `make test-serial`).
# On 2 idle cores the whole suite takes about 3 minutes with 2 workers (about 6 minutes of CPU time): the kernels
# lane runs in Triton's interpreter and is most of it.
PYTEST_WORKERS ?= auto

# mypy over guardlint.contracts, .lint and .guard (pyproject.toml's [tool.mypy] packages): about 1 s with a warm
# .mypy_cache, 10 s on an empty one (torch's stubs, for guard/). The folders install under other names (lint/ is
# guardlint.lint), so mypy reads them through links named as installed; its paths are written back as the
# checkout's (build/typecheck/guardlint/lint/x.py as lint/x.py).
TYPECHECK := build/typecheck

typecheck: $(STAMP)
	@rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)/guardlint
	@for f in _guardlint/*.py _guardlint/py.typed; do ln -s ../../../$$f $(TYPECHECK)/guardlint/; done
	@for d in contracts guard kernels lint integrations; do ln -s ../../../$$d $(TYPECHECK)/guardlint/$$d; done
	@echo "$(BIN)/mypy"; $(BIN)/mypy > $(TYPECHECK)/mypy.out 2>&1; rc=$$?; \
	  sed -e 's#^$(TYPECHECK)/guardlint/\(contracts\|guard\|kernels\|lint\|integrations\)/#\1/#' \
	      -e 's#^$(TYPECHECK)/guardlint/#_guardlint/#' $(TYPECHECK)/mypy.out; exit $$rc

test: $(STAMP) engines typecheck
	@echo "== ruff, mypy (contracts/, lint/, guard/), then the CPU test suite over $(PYTEST_WORKERS) pytest-xdist workers: about 3 minutes on 2 idle cores"
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) tests

# The same suite in one process: for a debugger, or to compare timings.
test-serial: $(STAMP) engines
	$(BIN)/python -m pytest -q tests

# The linter and guard lanes only (no Triton interpreter, no engine sources): about 20 s on 2 cores (25 s in one
# process).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) tests/lint tests/guard

# The vLLM engine tests (a 340 MB download, so not in every CI run).
test-engines: $(STAMP) engines engines-vllm
	GUARDLINT_ENGINE_VLLM=1 $(BIN)/python -m pytest -q tests/engines

demo: $(STAMP)
	@echo "== 1/3  guardlint examples/   (static: finds the call sites that crash at runtime)"
	@$(BIN)/guardlint examples/; rc=$$?; \
	  if [ $$rc -eq 1 ]; then echo "(exit code 1 = findings, as intended: it is what fails a commit or a CI job)"; \
	  else exit $$rc; fi
	@echo
	@echo "== 2/3  the guarded model forward on the CPU (runtime: derives what the call sites forgot)"
	@$(BIN)/python examples/run_demo.py
	@echo
	@echo "== 3/3  guardlint diagnose examples/traceback.txt   (a production traceback -> rule and fix)"
	@$(BIN)/guardlint diagnose examples/traceback.txt
	@echo
	@echo "What you saw: the linter flagged the call sites in examples/vit.py and examples/engine_backend.py"
	@echo "(vit_fixed.py is clean); the guard derived the missing metadata once per forward instead of"
	@echo "crashing, and both model twins agree; diagnose mapped the engine's error to its rule and fix."
	@echo "Next: guardlint explain GL101, guardlint --diff --unsafe-fixes examples/"

clean:
	rm -rf $(VENV) build *.egg-info
