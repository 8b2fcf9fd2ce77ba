# One command for each thing a developer does; each sets up the virtual environment first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: setup serve test postgresql nats-server bench bench-docs fuzz proto clean

setup: $(STAMP)

# The environment: the project (editable) with everything the tests need, pinned by
# constraints.txt (torch==2.13.0 among them), and pytannic, whose metadata asks for
# Python 3.12 although it runs on 3.11.
#
# `make serve` and `make test` may start at once on a fresh clone: the set-up holds the lock
# directory $(LOCK) (mkdir is atomic), so the second waits for the first to finish installing
# and then finds the environment ready instead of installing into it at the same time. A lock
# left by a set-up killed with SIGKILL is reported after a minute; remove it then.
LOCK := $(VENV).lock
$(STAMP): pyproject.toml constraints.txt
	@waited=0; until mkdir $(LOCK) 2>/dev/null; do \
	  if [ $$waited -eq 0 ]; then echo "waiting for another make to finish setting up $(VENV) ($(LOCK))"; fi; \
	  waited=$$((waited + 1)); \
	  if [ $$waited -eq 60 ]; then echo "still waiting: if no other make runs, rmdir $(LOCK)"; fi; \
	  sleep 1; \
	done; \
	trap 'rmdir $(LOCK)' EXIT; trap 'exit 130' INT TERM; \
	if [ -f $@ ] && [ $@ -nt pyproject.toml ] && [ $@ -nt constraints.txt ]; then exit 0; fi; \
	set -ex; \
	$(PYTHON) -m venv $(VENV); \
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[client,dev]'; \
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --ignore-requires-python -c constraints.txt pytannic; \
	touch $@

serve: $(STAMP)
	$(VENV)/bin/tannery serve

test: $(STAMP) postgresql nats-server
	$(PY) -m pytest $(PYTEST_ARGS)

# The shared-catalog tests start a private PostgreSQL (tests/postgres_harness.py) from Debian's
# postgresql package, whose binaries live in /usr/lib/postgresql/*/bin: installed here when
# absent (apt-get as root, or through sudo), left alone when present.
postgresql:
	@if ! command -v initdb >/dev/null 2>&1 && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then \
	  echo "installing Debian's postgresql package (the catalog tests run a private PostgreSQL)"; \
	  sudo=; [ "$$(id -u)" -eq 0 ] || sudo=sudo; \
	  $$sudo apt-get update -qq && \
	  $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends postgresql >/dev/null \
	  || echo "could not install postgresql: the PostgreSQL tests will skip (and fail under CI)"; \
	fi

# The channel tests across replicas start a private NATS (tests/nats_harness.py) from Debian's
# nats-server package: installed here when absent, left alone when present.
nats-server:
	@if ! command -v nats-server >/dev/null 2>&1 && [ ! -x /usr/sbin/nats-server ]; then \
	  echo "installing Debian's nats-server package (the cross-replica channel tests run a private NATS)"; \
	  sudo=; [ "$$(id -u)" -eq 0 ] || sudo=sudo; \
	  $$sudo apt-get update -qq && \
	  $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nats-server >/dev/null \
	  || echo "could not install nats-server: the NATS tests will skip (and fail under CI)"; \
	fi

# The benchmarks (docs/benchmarks.md): tables and plots go to a new folder bench-results/<UTC time>/
# (git-ignored). `make bench-docs` runs the same but draws the plots into docs/bench/, replacing
# the committed ones the README and docs/benchmarks.md show (its tables still go to bench-results/).
bench: $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[client,dev,bench]'
	$(PY) -m tests.benchmarks $(BENCH_ARGS)

bench-docs: $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[client,dev,bench]'
	$(PY) -m tests.benchmarks --docs $(BENCH_ARGS)

# Longer fuzzing than CI's: the server fuzz test with FUZZ_CASES seeded cases (FUZZ_SEED), then
# each atheris target of tests/fuzz/ for FUZZ_SECONDS on its kept corpus (new inputs go to
# .fuzz-work/, crashes to .fuzz-work/crash-*; the kept corpus is read, never written).
FUZZ_CASES ?= 50000
FUZZ_SEED ?= 1101
FUZZ_SECONDS ?= 60
FUZZ_TARGETS := codec deframer
fuzz: $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[client,dev,fuzz]'
	TANNERY_FUZZ_CASES=$(FUZZ_CASES) TANNERY_FUZZ_SEED=$(FUZZ_SEED) $(PY) -m pytest -o timeout=0 -s -q tests/test_server_fuzz.py
	for target in $(FUZZ_TARGETS); do \
		mkdir -p .fuzz-work/$$target && \
		$(PY) tests/fuzz/fuzz_$$target.py -max_total_time=$(FUZZ_SECONDS) -artifact_prefix=.fuzz-work/crash-$$target- \
			.fuzz-work/$$target tests/fuzz/corpus/$$target || exit 1; \
	done

# Regenerates the Python modules of protos/ into client/tannery/v1 (they are committed).
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -I protos --python_out=client --pyi_out=client --grpc_python_out=client protos/tannery/v1/*.proto

clean:
	rm -rf $(VENV) $(LOCK) build *.egg-info .fuzz-work
