# The README's two commands: `make serve` and `make test`. Both install first, once: a stamp file
# per Python environment remembers the install until pyproject.toml or setup.py change.
PYTHON ?= python3
# One stamp per interpreter prefix (a venv), so switching environments installs into the new one.
STAMP := .make/installed-$(shell $(PYTHON) -c 'import hashlib, sys; print(hashlib.sha1(sys.prefix.encode()).hexdigest()[:10])')

.PHONY: install serve test
install: $(STAMP)

$(STAMP): pyproject.toml setup.py
	@echo "fluxlab: installing into $$($(PYTHON) -c 'import sys; print(sys.prefix)') (first run, or pyproject.toml/setup.py changed; later runs skip this)"
	@# Keep a torch that is already there (a user's CUDA build); else the local CPU build 2.13.0.
	@$(PYTHON) -c "import torch" 2>/dev/null || { echo "fluxlab: installing torch==2.13.0 (CPU build)"; $(PYTHON) -m pip install -q torch==2.13.0; }
	$(PYTHON) -m pip install -q -e '.[test]'
	@mkdir -p $(dir $@) && touch $@

serve: install
	$(PYTHON) -m fluxlab serve $(ARGS)

# Two pytest-xdist workers, a test file each at a time (a file's servers and fixtures stay together; only
# tests/test_front_door.py binds port 8000), one torch thread each (tests/conftest.py): ~11 min on 2 cores, not 18.
test: install
	$(PYTHON) -m pytest -q -n 2 --dist loadfile $(ARGS)
