# Two commands on a fresh machine: `make demo` and `make test`. Both bootstrap uv and the venv first.
SHELL := /bin/bash
UV ?= $(shell command -v uv 2>/dev/null || echo $(CURDIR)/.tools/bin/uv)
export UV_PROJECT_ENVIRONMENT ?= $(CURDIR)/.venv

.PHONY: setup demo test demo-data

$(CURDIR)/.tools/bin/uv:
	python3 -m pip install --quiet --disable-pip-version-check --target $(CURDIR)/.tools/pkgs uv
	mkdir -p $(CURDIR)/.tools/bin && ln -sf $(CURDIR)/.tools/pkgs/bin/uv $(CURDIR)/.tools/bin/uv

setup: $(UV)
	$(UV) sync --frozen

demo-data: setup
	$(UV) run --frozen python data/make_demo_dataset.py

demo: demo-data
	$(UV) run --frozen phase1a run --config configs/demo.yaml

test: setup
	$(UV) run --frozen pytest -q
