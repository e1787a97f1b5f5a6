# Two commands on a fresh machine:
#   make run   - install into .venv (if missing) and run the quick-start experiment
#   make test  - install into .venv (if missing), fetch the offline datasets, run the tests
#   make claims - the claims tier: the published results re-run and asserted (pytest -m claims)
#   make docs  - the documentation site into site/ (open site/index.html)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
FMNIST := /usr/share/datasets/fashion-mnist

.PHONY: run test claims install data lint bench docs

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

# Fashion-MNIST comes from the Debian package (IDX files); nothing is downloaded at run time.
data:
	@test -d $(FMNIST) || { apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist; } \
	  || echo "warning: could not install dataset-fashion-mnist; its tests will be skipped"
# Chromium (the Debian package) renders p2pfl report's page in tests/test_report.py, headless.
	@command -v chromium >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium; } \
	  || echo "warning: could not install chromium; the report page's browser tests will be skipped"

run: install
	$(VENV)/bin/p2pfl run experiments/quickstart.yaml --out runs/quickstart --force

# The default suite on both cores (pytest-xdist), each test file whole on one of them and in
# its order, as one process runs it (--dist loadfile: a file's module-scoped fixtures, such
# as the fuzzed receiver, stay in one process): 8-9 minutes against 12 min 42 s one test at
# a time on 2 cores.
test: install data
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadfile

# The claims tier: every published result (README and docs/ tables) re-run and asserted, on
# both cores (pytest-xdist); pytest's exit status 5 (nothing collected) is not a failure.
claims: install data
	$(VENV)/bin/python -m pytest -q -m claims -n 2 || test $$? -eq 5

lint: install
	$(VENV)/bin/ruff check p2pfl tests benchmarks examples
	$(VENV)/bin/ruff format --check p2pfl tests benchmarks examples
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

bench: install
	$(PY) benchmarks/overhead.py

# The documentation site (mkdocs.yml, docs/) into site/: warnings are errors, every internal
# link and anchor is checked; the YAML and command-line references are generated from the code.
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet
