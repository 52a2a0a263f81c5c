# The README's commands. Each one sets up .venv first (scripts/setup.sh), so a fresh clone works.
PY := .venv/bin/python
# Test files run in parallel, one file per process (their fixtures are per file); at most 4 processes, since
# many tests start 2-4 processes of their own. Files go to the workers in collection order, which
# tests/conftest.py makes longest first (--no-loadscope-reorder: xdist would otherwise order them by their number
# of tests). make test takes one process more than the CPUs (up to 4): the real-SLURM file, handed out first,
# mostly waits on its jobs. TEST_JOBS=0 (FAST_JOBS=0) runs them all in this one process.
FAST_JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ "$$n" -gt 4 ] && n=4; echo $$n)
TEST_JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ "$$n" -gt 3 ] && n=3; echo $$((n + 1)))

.PHONY: setup setup-test test test-fast refresh-upstream-record demo table clean-venv

# the runtime dependencies only (demo, table); setup-test adds the test extra
setup:
	@bash scripts/setup.sh

setup-test:
	@bash scripts/setup.sh test

test: setup-test
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder

# The unit tier (tests/unit: no subprocess or loader worker inside a test), before every commit; its files in
# parallel as in `make test`.
test-fast: setup-test
	$(PY) -m pytest -q -n $(FAST_JOBS) --dist loadfile --no-loadscope-reorder tests/unit

# The plain run of upstream's own tests at the pinned commit, recorded for test_upstream_suite.py: after a new pin,
# another list of upstream's files, or another torch or timm.
refresh-upstream-record: setup-test
	$(PY) tests/upstream_suite.py

demo: setup
	.venv/bin/naflex-accum demo

table: setup
	.venv/bin/naflex-accum table

clean-venv:
	rm -rf .venv
