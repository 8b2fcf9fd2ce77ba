# One command for each thing a developer does; each sets up the virtual environment first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: setup serve test bench proto clean

setup: $(STAMP)

# The environment: the project (editable) with everything the tests need, pinned by
# constraints.txt (torch==2.13.0 among them), and pytannic, whose metadata asks for
# Python 3.12 although it runs on 3.11.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[client,dev]'
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --ignore-requires-python -c constraints.txt pytannic
	touch $@

serve: $(STAMP)
	$(VENV)/bin/tannery serve

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[client,dev,bench]'
	$(PY) -m tests.benchmarks $(BENCH_ARGS)

# Regenerates the Python modules of protos/ into client/tannery/v1 (they are committed).
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -I protos --python_out=client --pyi_out=client --grpc_python_out=client protos/tannery/v1/*.proto

clean:
	rm -rf $(VENV) build *.egg-info
