# The README's two commands: `make serve` and `make test`. Both install first.
PYTHON ?= python3

.PHONY: install serve test
install:
	@# Keep a torch that is already there (a user's CUDA build); else the local CPU build 2.13.0.
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e '.[test]'

serve: install
	$(PYTHON) -m fluxlab serve $(ARGS)

test: install
	$(PYTHON) -m pytest -q $(ARGS)
