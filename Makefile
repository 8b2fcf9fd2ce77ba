# One command for each thing a developer does; each sets up the virtual environment first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# One environment, set up in two steps, each with its stamp: make serve needs only the first.
#   SERVER_STAMP: the project (editable) with its core dependencies: the server (grpcio,
#     protobuf, numpy...) and the `tannery` command, no torch: the server never imports it.
#   STAMP: the rest, on top: the client library's [client] extra (torch, safetensors, rich),
#     the [dev] extra the tests need and pytannic. make setup/test/bench/fuzz/proto use it.
# Both are pinned by constraints.txt (torch==2.13.0 among them).
SERVER_STAMP := $(VENV)/.server-stamp
STAMP := $(VENV)/.dev-stamp
PIP := $(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt

.PHONY: setup serve dist test test-quick postgresql nats-server chromium container bench bench-docs fuzz proto clean

setup: $(STAMP)

# `make serve` and `make test` may start at once on a fresh clone: each step of the set-up holds
# the lock directory $(LOCK) (mkdir is atomic), so the second make waits for the first instead
# of installing into the environment at the same time. It stops waiting as soon as the step it
# needs is done (its stamp, touched last, newer than what it was made from): `make serve` starts
# the server while `make test` goes on installing what STAMP adds. Those installs add packages and
# never replace one the server loaded (the same pins; not the project itself), so they may.
# A lock left by a set-up killed with SIGKILL is reported after a minute; remove it then.
LOCK := $(VENV).lock
# Exits the recipe when its stamp is newer than all its prerequisites: another make did the step.
done_already = up=yes; for f in $^; do [ $@ -nt $$f ] || up=; done; [ -z "$$up" ] || exit 0
take_lock = waited=0; until mkdir $(LOCK) 2>/dev/null; do \
	  $(done_already); \
	  if [ $$waited -eq 0 ]; then echo "waiting for another make to finish setting up $(VENV) ($(LOCK))"; fi; \
	  waited=$$((waited + 1)); \
	  if [ $$waited -eq 60 ]; then echo "still waiting: if no other make runs, rmdir $(LOCK)"; fi; \
	  sleep 1; \
	done; \
	trap 'rmdir $(LOCK)' EXIT; trap 'exit 130' INT TERM

$(SERVER_STAMP): pyproject.toml constraints.txt
	@$(take_lock); $(done_already); \
	set -ex; \
	$(PYTHON) -m venv $(VENV); \
	$(PIP) -e .; \
	touch $@

# The extras' requirements alone, read from pyproject.toml (as docker/Dockerfile reads the core
# ones), not `-e '.[client,dev]'`, which would reinstall the project under a server starting
# from it. pytannic goes in with --no-deps --ignore-requires-python: its metadata asks for
# Python 3.12, although it runs on 3.11.
$(STAMP): $(SERVER_STAMP) pyproject.toml constraints.txt
	@$(take_lock); $(done_already); \
	set -ex; \
	$(PY) -c 'import tomllib; extras = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]; \
	          print("\n".join(extras["client"] + extras["dev"]))' > $(VENV)/dev-requirements.txt; \
	$(PIP) -r $(VENV)/dev-requirements.txt; \
	$(PIP) --no-deps --ignore-requires-python pytannic; \
	touch $@

# The server alone: it never needs what STAMP adds (tests/test_cli_process.py runs it without torch).
serve: $(SERVER_STAMP)
	$(VENV)/bin/tannery serve

# A wheel of the project in $(DIST)/ (tannery-<version>-py3-none-any.whl), to install elsewhere with
# its extras: pip install "dist/tannery-0.1.0-py3-none-any.whl[client]" (README, "Install without
# make"). Built with .venv's setuptools, no download; build/ first emptied, so that no module
# deleted since an earlier build slips into the wheel.
DIST ?= dist
dist: $(SERVER_STAMP)
	rm -rf build
	$(PIP) "setuptools>=70.1"
	$(PY) -m pip wheel --quiet --disable-pip-version-check --no-deps --no-build-isolation -w $(DIST) .
	@ls $(DIST)/tannery-*.whl

# The whole suite (what CI runs: .ci/run).
test: $(STAMP) postgresql nats-server chromium container
	$(PY) -m pytest $(PYTEST_ARGS)

# The quick run, for between edits: all but the tests marked slow and those of servers outside
# the project (marked external: PostgreSQL, SeaweedFS, NATS, a container engine; tests/conftest.py
# marks them), so none of those is needed. About 2.5 minutes on 2 cores; make test runs them all.
test-quick: $(STAMP)
	$(PY) -m pytest -m "not slow and not external" $(PYTEST_ARGS)

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

# The web page's tests (tests/test_web_browser.py) drive a headless Chromium through chromedriver,
# both from Debian's packages: installed here when absent, left alone when present.
chromium:
	@if ! command -v chromedriver >/dev/null 2>&1 || ! { command -v chromium >/dev/null 2>&1 || [ -x /usr/bin/chromium ]; }; then \
	  echo "installing Debian's chromium and chromium-driver packages (the web page's tests run a headless browser)"; \
	  sudo=; [ "$$(id -u)" -eq 0 ] || sudo=sudo; \
	  $$sudo apt-get update -qq && \
	  $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null \
	  || echo "could not install chromium: the browser tests will skip (and fail under CI)"; \
	fi

# The image's tests (tests/test_container.py) build docker/Dockerfile and run it and the compose
# files with podman, on a local base image (Debian's python3): ../shared/tools/container-env.sh
# installs podman from Debian's packages and builds that image (as root, a few minutes the first
# time), here when either is absent. Without the script (no ../shared) those tests skip.
CONTAINER_ENV := ../shared/tools/container-env.sh
BASE_IMAGE ?= localhost/python-base:bookworm
container:
	@if command -v podman >/dev/null 2>&1 && podman image exists $(BASE_IMAGE) 2>/dev/null; then :; \
	elif [ -f $(CONTAINER_ENV) ]; then \
	  echo "setting up podman and the base image $(BASE_IMAGE) ($(CONTAINER_ENV); a few minutes)"; \
	  sudo=; [ "$$(id -u)" -eq 0 ] || sudo=sudo; \
	  $$sudo env BASE_IMAGE_NAME=$(BASE_IMAGE) bash $(CONTAINER_ENV) \
	  || echo "could not set up podman: the container tests will skip (and fail under CI)"; \
	else \
	  echo "no $(CONTAINER_ENV): the container tests will skip (and fail under CI)"; \
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

# Regenerates the Python modules of protos/ into protocol/tannery_protocol/v1 (they are committed).
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Itannery_protocol/v1=protos/tannery/v1 --python_out=protocol --pyi_out=protocol --grpc_python_out=protocol protos/tannery/v1/*.proto

clean:
	rm -rf $(VENV) $(LOCK) build dist *.egg-info .fuzz-work
