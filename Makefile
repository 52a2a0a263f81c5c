# The README's commands. Each one sets up .venv first (scripts/setup.sh), so a fresh clone works.
PY := .venv/bin/python

.PHONY: setup test demo table clean-venv

setup:
	@bash scripts/setup.sh

test: setup
	$(PY) -m pytest -q

demo: setup
	.venv/bin/naflex-accum demo

table: setup
	.venv/bin/naflex-accum table

clean-venv:
	rm -rf .venv
