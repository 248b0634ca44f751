# Two entry points; both create/reuse .venv through scripts/setup.sh.
.PHONY: setup train test

setup:
	bash scripts/setup.sh

train: setup
	.venv/bin/python launch/train.py --algo dapo $(ARGS)

# Two pytest-xdist workers (TEST_WORKERS=0: one process); tests/conftest.py keeps each module on one worker and
# the tests that start Ray clusters, vLLM engines or trainer processes on one worker between them.
TEST_WORKERS ?= 2

test: setup
	XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m pytest -q tests -n $(TEST_WORKERS) \
		--dist loadfile $(PYTEST_ARGS)
