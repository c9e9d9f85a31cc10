# Two commands on a fresh machine: `make demo` and `make test`. Both bootstrap uv and the venv first.
SHELL := /bin/bash
UV ?= $(shell command -v uv 2>/dev/null || echo $(CURDIR)/.tools/bin/uv)
export UV_PROJECT_ENVIRONMENT ?= $(CURDIR)/.venv

.PHONY: setup demo test test-postgres test-fast lint docs demo-data server server-stop pools deploy worker automations gpu-wheels gpu-check image image-tools test-image

$(CURDIR)/.tools/bin/uv:
	python3 -m pip install --quiet --disable-pip-version-check --target $(CURDIR)/.tools/pkgs uv
	mkdir -p $(CURDIR)/.tools/bin && ln -sf $(CURDIR)/.tools/pkgs/bin/uv $(CURDIR)/.tools/bin/uv

# torch's build (docs/gpu.md): TORCH=cpu installs the CPU wheel in /opt/wheels (machines of this kind: CI,
# development), TORCH=cuda PyPI's torch (the CUDA build on Linux). Default: cpu where that wheel lies and no NVIDIA GPU
# answers, else cuda. Every uv command here names it: without `--extra cpu`, `uv run` would sync to CUDA torch.
CPU_TORCH_WHEEL := $(wildcard /opt/wheels/torch-2.13.0+cpu-cp311-*.whl)
GPU_PRESENT := $(shell nvidia-smi -L 2>/dev/null | grep -q GPU && echo yes)
TORCH ?= $(if $(and $(CPU_TORCH_WHEEL),$(if $(GPU_PRESENT),,no)),cpu,cuda)
$(if $(filter-out cpu cuda,$(TORCH)),$(error TORCH=$(TORCH): torch's build is cpu or cuda))
UV_FLAGS := --frozen --extra $(TORCH)

# --compile-bytecode: the venv's modules compiled once, here (72 s on two cores). Where PYTHONDONTWRITEBYTECODE is set
# (CI, sandboxes) Python never writes them, and every process (each CLI run, flow run, rank) compiled torch,
# transformers and prefect again on import: 32 s against 14 s measured.
#
# setup syncs only when the lock, the project or torch's build changed since the venv's last sync (a stamp in the venv
# names the build and the two files' content: `make image` sets their times back to their commit's), and the targets'
# `uv run` does not sync again: with compile-bytecode on (pyproject.toml), every sync byte-compiles the whole venv once
# more, 2.5 s and 4.5 CPU-seconds (29,299 files) where nothing changed, which every `make` a user or a test runs paid
# once or three times.
SYNCED := $(UV_PROJECT_ENVIRONMENT)/.synced-$(TORCH)-$(shell cat pyproject.toml uv.lock | sha256sum | cut -c1-12)
UV_RUN := $(UV) run $(UV_FLAGS) --no-sync
setup: $(SYNCED)

$(SYNCED): | $(UV)
	$(UV) sync $(UV_FLAGS) --compile-bytecode
	@rm -f $(UV_PROJECT_ENVIRONMENT)/.synced-* && touch $@

demo-data: setup
	$(UV_RUN) python data/make_demo_dataset.py

demo: demo-data
	$(UV_RUN) phase1a run --config configs/demo.yaml

# The suite's files spread over the cores (pytest-xdist), a file to one worker: a file's tests share its fixtures
# (servers, reference runs), which a finer split would start once per worker; the slowest files first (tests/conftest.py).
# TEST_WORKERS=0 runs them in one process.
# Tests marked alone time seconds on an unloaded host: they run afterwards, with the cores to themselves.
# The PostgreSQL test runs among the others where the machine has PostgreSQL's binaries (it skips elsewhere): alone it
# took 172 s, its processes 138 CPU-seconds of them; beside the others it shares the cores, after them it added all.
TEST_WORKERS ?= auto
test: setup
	$(UV_RUN) pytest -q -m "not image and not alone" -n $(TEST_WORKERS) --dist loadfile \
	  --no-loadscope-reorder
	$(UV_RUN) pytest -q -m "alone and not image"

# Prefect on a throwaway PostgreSQL server (tests/operations/test_operations_postgres.py): two hosts, a lost host, a
# resume. `make test` runs it too; this runs it alone.
test-postgres: setup
	$(UV_RUN) pytest -q -m postgres

# The inner loop: every test not marked slow, prefect_server, s3, gpu or image (pyproject.toml), in under two minutes.
test-fast: setup
	$(UV_RUN) pytest -q -m "not slow and not prefect_server and not s3 and not gpu and not image"

lint: setup
	$(UV_RUN) ruff check .

# docs/configuration.md, generated from the config schema (phase1a/config/reference.py); tests/project/test_docs.py checks it.
docs: setup
	$(UV_RUN) python -m phase1a.config.reference --write

# GPU proof (docs/gpu.md). Here, with git and network: what a bare GPU host lacks (wheels, tokenizer, old tree) into .gpu/.
# There: `make gpu-check` with the host's own python3 (CUDA torch); DRY_RUN=1 runs every part on a CPU, in the venv.
GPU_PYTHON ?= python3
gpu-wheels: setup
	$(UV_RUN) --with pip python benchmarks/gpu_check.py --prepare $(GPU_WHEELS_ARGS)

gpu-check: $(if $(DRY_RUN),setup)
	$(if $(DRY_RUN),$(UV_RUN) python,$(GPU_PYTHON)) benchmarks/gpu_check.py $(if $(DRY_RUN),--dry-run) $(GPU_CHECK_ARGS)

# The image (Containerfile; docs/operations.md#the-image): docker where its daemon answers, else buildah. It is named
# PHASE1A_IMAGE, the image `make deploy` gives the image deployments (phase1a:latest by default, set below).
# IMAGE_TORCH is torch's build in it (cuda: PyPI's, for GPU hosts; cpu: the local wheel, buildah only: the build
# mounts /opt/wheels); IMAGE_EXTRAS the extras in it (demo: the built-in model of configs/h100.yaml; add eval,
# tracking, kubernetes as jobs need them); IMAGE_BASE, IMAGE_UV other bases.
IMAGE_TORCH ?= cuda
IMAGE_EXTRAS ?= demo
IMAGE_BASE ?=
IMAGE_UV ?=
# buildah here (machines of this kind: no Docker daemon, no user namespaces): every RUN in a chroot (BUILDAH_ISOLATION,
# which buildah reads); overlay storage where the kernel has it, else vfs, which copies the whole root at every step.
BUILDAH_STORAGE ?= $(if $(shell grep -qw overlay /proc/filesystems && echo yes),overlay,vfs)
BUILDAH ?= buildah --storage-driver $(BUILDAH_STORAGE)
export BUILDAH_ISOLATION ?= chroot
IMAGE_BUILDER ?= $(if $(shell docker info > /dev/null 2>&1 && echo yes),docker,$(BUILDAH))
# buildah only: the local wheel, and the CA bundle SSL_CERT_FILE names (PyPI behind a TLS-inspecting proxy).
# --force-rm: a failed build's containers removed too (each holds a copy of its step's root).
IMAGE_MOUNTS = $(if $(filter docker,$(IMAGE_BUILDER)),,--layers --force-rm \
  $(if $(filter cpu,$(IMAGE_TORCH)),--volume /opt/wheels:/opt/wheels:ro) \
  $(if $(SSL_CERT_FILE),--volume $(SSL_CERT_FILE):$(SSL_CERT_FILE):ro --build-arg SSL_CERT_FILE=$(SSL_CERT_FILE)))

# buildah's layer cache keys a copied file on its modification time too: a fresh clone's pyproject.toml and uv.lock,
# when unchanged since their last commit, get that commit's time, so a new clone of the same lock reuses the layer
# of the dependencies (1 to 2 minutes) as docker's cache does. buildah 1.28 leaves the container it made for each
# RUN's mount of uv's image behind, mounted: removed after the build, whether it succeeded or not.
image:
	@$(if $(filter docker,$(IMAGE_BUILDER)),,for file in pyproject.toml uv.lock; do \
	  git diff --quiet HEAD -- $$file 2> /dev/null && touch -d @$$(git log -1 --format=%ct -- $$file) $$file; done; true)
	$(IMAGE_BUILDER) build -f Containerfile -t $(PHASE1A_IMAGE) --build-arg TORCH=$(IMAGE_TORCH) \
	  --build-arg EXTRAS="$(IMAGE_EXTRAS)" $(if $(IMAGE_BASE),--build-arg BASE=$(IMAGE_BASE)) \
	  $(if $(IMAGE_UV),--build-arg UV_IMAGE=$(IMAGE_UV)) $(IMAGE_MOUNTS) . ; status=$$?; \
	$(if $(filter docker,$(IMAGE_BUILDER)),,$(IMAGE_BUILDER) rm \
	  $$($(IMAGE_BUILDER) containers -q --filter name=uv-working-container) > /dev/null 2>&1;) exit $$status

# The image's test here (tests/operations/test_image.py, CI after the other tests): buildah and debootstrap from apt if missing,
# a Debian base and uv's image made locally (image/local-base.sh: no registry needed), the image with the local CPU
# torch, then the tiny job in a container. Each step reuses what exists: a second run rebuilds only what changed.
IMAGE_TEST := localhost/phase1a:test
IMAGE_TEST_BASE := localhost/phase1a-base:bookworm
IMAGE_WORK ?= /var/tmp/phase1a-image

image-tools:
	@command -v buildah > /dev/null && command -v debootstrap > /dev/null || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq buildah debootstrap > /dev/null; }

# uv's image is named by its version (expanded when the recipe runs, after setup has installed uv).
IMAGE_TEST_UV = localhost/uv:$(word 2,$(shell $(UV) --version))

test-image: setup image-tools
	BUILDAH="$(BUILDAH)" image/local-base.sh $(IMAGE_TEST_BASE) $(IMAGE_TEST_UV) $(UV) $(IMAGE_WORK)
	$(MAKE) --no-print-directory image IMAGE_BUILDER="$(BUILDAH)" PHASE1A_IMAGE=$(IMAGE_TEST) IMAGE_TORCH=cpu \
	  IMAGE_BASE=$(IMAGE_TEST_BASE) IMAGE_UV=$(IMAGE_TEST_UV)
	@# The test image a rebuild replaced, untagged (2 GB each): removed, with the layers only it used.
	$(BUILDAH) rmi --prune > /dev/null
	PHASE1A_TEST_IMAGE=$(IMAGE_TEST) BUILDAH="$(BUILDAH)" $(UV_RUN) pytest -q -m image tests/operations/test_image.py

# Operations (docs/operations.md): a local Prefect server, its work pools, the deployments, a worker.
# Each target is idempotent. They talk to PREFECT_API_URL when it is set (a shared server), else to the
# local server that `make server` starts on PREFECT_PORT with SQLite under PREFECT_HOME (./.prefect).
# Nothing is exported globally: `make demo` keeps running on Prefect's embedded server.
VENV_BIN := $(UV_PROJECT_ENVIRONMENT)/bin
PREFECT_HOME ?= $(CURDIR)/.prefect
PREFECT_PORT ?= 4200
PREFECT_HOST ?= 127.0.0.1
SERVER_URL := http://127.0.0.1:$(PREFECT_PORT)/api
PREFECT_API_URL ?= $(SERVER_URL)
PHASE1A_TZ ?= UTC
# The image the image-based deployments run (phase1a/k8s-h100, phase1a/docker-h100): `make deploy PHASE1A_IMAGE=...`.
PHASE1A_IMAGE ?= phase1a:latest
POOL ?= phase1a-cpu
NAME ?=
HEARTBEAT ?= 60
ZOMBIE_AFTER ?= 600
CRASH_RETRIES ?= 3
NOTIFY_BLOCK ?=
SERVER_PID := $(PREFECT_HOME)/server.pid
# True while the pid file names a live `prefect server start` (not a stale pid reused by another process). -ww: where
# COLUMNS is set (pytest-xdist's workers set 80), ps cuts the command line to it, and a long venv path cut the words.
SERVER_ALIVE = [ -f $(SERVER_PID) ] && ps -ww -p $$(cat $(SERVER_PID)) -o args= 2>/dev/null | grep -q "prefect server start"
PREFECT_ENV := PREFECT_HOME=$(PREFECT_HOME) PREFECT_API_URL=$(PREFECT_API_URL) PREFECT_SERVER_ANALYTICS_ENABLED=false

# The server runs in its own session (setsid) so that server-stop can end it and its children as a group.
# A fresh SQLite database migrates on first start, which takes a while on 2 cores: wait up to 180 s. While waiting,
# the server is alive while its process is, and is not a zombie: its state, not its command line (SERVER_ALIVE's test
# of a pid file that may be stale), which once said "exited" of a server that went on to start, on two loaded cores
# (2026-11-28).
server: setup
	@mkdir -p $(PREFECT_HOME)
	@if $(SERVER_ALIVE); then \
	  echo "prefect server already running (pid $$(cat $(SERVER_PID))) at $(SERVER_URL)"; \
	else \
	  PREFECT_HOME=$(PREFECT_HOME) PREFECT_SERVER_ANALYTICS_ENABLED=false PREFECT_API_URL=$(SERVER_URL) \
	    setsid nohup $(VENV_BIN)/prefect server start --host $(PREFECT_HOST) --port $(PREFECT_PORT) \
	    > $(PREFECT_HOME)/server.log 2>&1 < /dev/null & echo $$! > $(SERVER_PID); \
	  echo "prefect server starting (pid $$(cat $(SERVER_PID))), log $(PREFECT_HOME)/server.log"; \
	fi
	@for i in $$(seq 180); do \
	  if $(VENV_BIN)/python -c "import urllib.request as u; u.urlopen('$(SERVER_URL)/health', timeout=2)" 2>/dev/null; then \
	    echo "prefect server ready at $(SERVER_URL)"; exit 0; fi; \
	  case "$$(ps -p $$(cat $(SERVER_PID)) -o stat= 2>/dev/null)" in ""|Z*) \
	    echo "prefect server exited:"; tail -n 30 $(PREFECT_HOME)/server.log; exit 1;; esac; \
	  sleep 1; \
	done; echo "prefect server not ready after 180 s:"; tail -n 30 $(PREFECT_HOME)/server.log; exit 1

server-stop:
	@if $(SERVER_ALIVE); then \
	  pid=$$(cat $(SERVER_PID)); kill -TERM -- -$$pid; \
	  for i in $$(seq 20); do kill -0 $$pid 2>/dev/null || break; sleep 1; done; \
	  kill -0 $$pid 2>/dev/null && kill -KILL -- -$$pid; \
	  echo "prefect server stopped (pid $$pid)"; \
	else echo "prefect server not running"; fi
	@rm -f $(SERVER_PID)

pools: setup
	@$(PREFECT_ENV) $(VENV_BIN)/python deployments/ops.py pools

# Every deployment, or some: make deploy NAME="cpu h100". PHASE1A_TZ sets the nightly schedule's zone.
deploy: setup
	$(PREFECT_ENV) PHASE1A_TZ=$(PHASE1A_TZ) PHASE1A_IMAGE=$(PHASE1A_IMAGE) $(VENV_BIN)/prefect --no-prompt deploy \
	  --prefect-file deployments/prefect.yaml $(if $(strip $(NAME)),$(foreach n,$(NAME),--name $(n)),--all)

# In the foreground (run it under systemd, tmux or `&`). The pools target runs first: a worker started on a
# missing pool would create it without the GPU pools' concurrency limit.
worker: pools
	$(PREFECT_ENV) PREFECT_FLOWS_HEARTBEAT_FREQUENCY=$(HEARTBEAT) $(VENV_BIN)/prefect worker start --pool $(POOL)

automations: setup
	@$(PREFECT_ENV) $(VENV_BIN)/python deployments/ops.py automations --zombie-after $(ZOMBIE_AFTER) \
	  --crash-retries $(CRASH_RETRIES) \
	  $(if $(strip $(NOTIFY_BLOCK)),--notify-block $(NOTIFY_BLOCK))
