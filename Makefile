# Two entry points; both create/reuse .venv through scripts/setup.sh.
.PHONY: setup train test

setup:
	bash scripts/setup.sh

train: setup
	.venv/bin/python launch/train.py --algo dapo $(ARGS)

test: setup
	XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m pytest -q tests $(PYTEST_ARGS)
