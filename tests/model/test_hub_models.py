"""Hugging Face Hub models, offline: each test lays out HF_HOME's cache the way huggingface_hub 2.4 writes it
(blobs named by content, snapshot symlinks, refs, the cached tree listing), and runs the real resolver on it."""
from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from helpers import make_tiny_model_dir
from helpers.hub_cache import LFS_SUFFIXES, cache_repo, git_blob_id, unique_repo
from phase1a.config.schema import ConfigError, ModelConfig, validate_config
from phase1a.data.hub import HubError, repo_cache_dir, resolve_commit, snapshot
from phase1a.model.loading import load_model, load_tokenizer, model_fingerprint, resolve_model


def files_of(model_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in model_dir.iterdir() if p.is_file()}


@pytest.fixture
def hub_tiny(tiny_model_dir) -> tuple[str, str]:
    repo_id = unique_repo("tiny")
    return repo_id, cache_repo(repo_id, files_of(tiny_model_dir), listed_only=("README.md", "onnx/model.onnx"))


def test_hub_id_resolves_from_the_cache_loads_and_fingerprints_stably(hub_tiny):
    repo_id, commit = hub_tiny
    model_dir = resolve_model(ModelConfig(name_or_path=repo_id))
    assert model_dir == repo_cache_dir(repo_id) / "snapshots" / commit
    assert resolve_commit(repo_id) == commit
    model = load_model(model_dir, dtype=__import__("torch").float32)
    tokenizer = load_tokenizer(model_dir)
    assert model.config.vocab_size == len(tokenizer) and model.num_parameters() > 0
    first = model_fingerprint(model_dir)
    assert first == model_fingerprint(resolve_model(ModelConfig(name_or_path=repo_id)))
    assert len(first) == 64


def test_moved_branch_is_a_new_fingerprint_and_a_pinned_revision_keeps_the_old_commit(tiny_model_dir, tmp_path):
    repo_id = unique_repo("moving")
    first_commit = cache_repo(repo_id, files_of(tiny_model_dir))
    first_fp = model_fingerprint(resolve_model(ModelConfig(name_or_path=repo_id)))

    retrained = make_tiny_model_dir(tmp_path / "retrained", seed=1)  # other weights, same tokenizer and config
    second_commit = cache_repo(repo_id, files_of(retrained))  # refs/main moves, as a push then a download would
    assert second_commit != first_commit and resolve_commit(repo_id) == second_commit
    moved = resolve_model(ModelConfig(name_or_path=repo_id))
    assert moved.name == second_commit and model_fingerprint(moved) != first_fp

    pinned = resolve_model(ModelConfig(name_or_path=repo_id, revision=first_commit))
    assert pinned.name == first_commit and model_fingerprint(pinned) == first_fp
    assert resolve_commit(repo_id, revision=first_commit) == first_commit


def test_pickle_only_repository_needs_allow_pickle_weights(tiny_model_dir):
    import torch
    from safetensors.torch import load_file

    repo_id = unique_repo("pickles")
    files = {name: data for name, data in files_of(tiny_model_dir).items() if not name.endswith(".safetensors")}
    weights = load_file(tiny_model_dir / "model.safetensors")
    buffer = __import__("io").BytesIO()
    torch.save(weights, buffer)
    files["pytorch_model.bin"] = buffer.getvalue()
    commit = cache_repo(repo_id, files)

    with pytest.raises(HubError, match=r"model.name_or_path: .*only pickled weights \(pytorch_model.bin\).*"
                                       r"model.allow_pickle_weights"):
        resolve_model(ModelConfig(name_or_path=repo_id))
    allowed = resolve_model(ModelConfig(name_or_path=repo_id, allow_pickle_weights=True))
    assert allowed.name == commit and (allowed / "pytorch_model.bin").is_file()


def test_repository_without_weights_says_so(tiny_model_dir):
    repo_id = unique_repo("noweights")
    cache_repo(repo_id, {"config.json": (tiny_model_dir / "config.json").read_bytes()})
    with pytest.raises(HubError, match="has no \\*.safetensors weights"):
        resolve_model(ModelConfig(name_or_path=repo_id, allow_pickle_weights=True))


def test_offline_with_nothing_cached_and_unknown_revision_say_what_to_do(hub_tiny):
    with pytest.raises(HubError, match=r"model.name_or_path: HF_HUB_OFFLINE=1 and no cached snapshot of "
                                       r"Hugging Face model 'org/never-downloaded'.*run once online"
                                       r".*unset HF_HUB_OFFLINE"):
        resolve_model(ModelConfig(name_or_path="org/never-downloaded"))
    with pytest.raises(HubError, match="HF_HUB_OFFLINE=1 and no cached snapshot"):
        resolve_commit("org/never-downloaded")

    repo_id, _ = hub_tiny
    with pytest.raises(HubError, match=r"model.revision: HF_HUB_OFFLINE=1 and revision 'v9' of .* is not in the "
                                       r"cache \(cached: main\)"):
        resolve_model(ModelConfig(name_or_path=repo_id, revision="v9"))
    with pytest.raises(HubError, match="model.revision: .*'0{40}' .*not in the cache"):
        resolve_model(ModelConfig(name_or_path=repo_id, revision="0" * 40))
    # A dataset repository goes through the same code, and its messages name the dataset's field.
    with pytest.raises(HubError, match="data.source: HF_HUB_OFFLINE=1 and no cached snapshot of Hugging Face dataset"):
        snapshot("org/some-data", repo_type="dataset", field="data.source")


def test_revision_on_a_local_model_is_a_config_error(tiny_model_dir):
    with pytest.raises(ConfigError, match="model.revision: 'main' applies to Hugging Face Hub ids"):
        resolve_model(ModelConfig(name_or_path=str(tiny_model_dir), revision="main"))
    # Local directories keep their content fingerprint.
    assert resolve_model(ModelConfig(name_or_path=str(tiny_model_dir))) == tiny_model_dir


class _FakeHub(BaseHTTPRequestHandler):
    """The Hub's HTTP API as huggingface_hub 2.4 calls it for snapshot_download: repo info, the recursive tree,
    and HEAD/GET of `/<repo>/resolve/<commit>/<file>` (ETag = blob id, X-Repo-Commit); plus the failures we
    explain, with the status and X-Error-Code huggingface.co sends. It stands in for the third-party Hub, never
    for our code. `repos` maps a repository id to its files; `fetched` records every file downloaded."""

    repos: dict[str, dict[str, bytes]] = {}
    fetched: list[str] = []

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, code: str | None = None):
        self.send_response(status)
        for key, value in {**(headers or {}), **({"X-Error-Code": code} if code else {})}.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, value) -> None:
        self._send(200, json.dumps(value).encode(), {"Content-Type": "application/json"})

    def do_GET(self):  # noqa: N802 - http.server's name
        path = self.path.split("?")[0]
        if path.startswith("/api/models/"):
            return self._api(path.removeprefix("/api/models/"))
        repo_id, _, rest = path.lstrip("/").partition("/resolve/")
        commit, _, name = rest.partition("/")
        files = self.repos.get(repo_id, {})
        if name not in files:
            return self._send(404, code="EntryNotFound")
        data = files[name]
        blob = hashlib.sha256(data).hexdigest() if name.endswith(LFS_SUFFIXES) else git_blob_id(data)
        if self.command == "GET":
            _FakeHub.fetched.append(name)
        self._send(200, data, {"X-Repo-Commit": commit, "ETag": f'"{blob}"',
                               **({"X-Linked-Etag": f'"{blob}"'} if name.endswith(LFS_SUFFIXES) else {})})

    do_HEAD = do_GET

    def _api(self, rest: str) -> None:
        if rest.startswith("org/gated"):
            return self._send(403, code="GatedRepo")
        repo_id = "/".join(rest.split("/")[:2])
        if repo_id not in self.repos:
            return self._send(401, code="RepoNotFound")  # what the Hub answers an anonymous caller
        files = self.repos[repo_id]
        commit = hashlib.sha1(repr(sorted(files)).encode()).hexdigest()
        kind, _, revision = rest[len(repo_id) + 1:].partition("/")
        if kind == "revision" and revision not in ("main", commit):
            return self._send(404, code="RevisionNotFound")
        if kind == "revision" or not kind:
            return self._json({"id": repo_id, "sha": commit, "siblings": [{"rfilename": n} for n in files]})
        entries = []
        for name, data in files.items():
            entry = {"type": "file", "path": name, "size": len(data), "oid": git_blob_id(data)}
            if name.endswith(LFS_SUFFIXES):
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 130}
            entries.append(entry)
        self._json(entries)

    def log_message(self, *args):
        pass


@pytest.fixture
def online(monkeypatch):
    """huggingface_hub reads HF_HUB_OFFLINE and HF_ENDPOINT once, at import: set its constants (the endpoint and
    the file URL template derived from it)."""
    from huggingface_hub import constants

    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    endpoint = f"http://127.0.0.1:{server.server_port}"
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    _FakeHub.repos, _FakeHub.fetched = {}, []
    yield constants
    server.shutdown()
    server.server_close()


def test_download_fetches_only_what_training_needs(online, tiny_model_dir):
    repo_id = unique_repo("served")
    files = files_of(tiny_model_dir) | {"pytorch_model.bin": b"pickle", "README.md": b"# tiny", "onnx/model.onnx": b"x",
                                         "original/consolidated.safetensors": b"y"}
    _FakeHub.repos[repo_id] = files
    model_dir = resolve_model(ModelConfig(name_or_path=repo_id, allow_pickle_weights=True))
    assert sorted(_FakeHub.fetched) == sorted(n for n in files_of(tiny_model_dir))  # no pickle, README or subfolder
    assert sorted(p.name for p in model_dir.iterdir()) == sorted(files_of(tiny_model_dir))
    assert load_tokenizer(model_dir) is not None
    assert (repo_cache_dir(repo_id) / "refs" / "main").read_text() == model_dir.name

    pickled = unique_repo("served-pickles")
    _FakeHub.repos[pickled] = {"config.json": files["config.json"], "pytorch_model.bin": b"pickle"}
    with pytest.raises(HubError, match="only pickled weights .*model.allow_pickle_weights"):
        resolve_model(ModelConfig(name_or_path=pickled))
    assert "pytorch_model.bin" not in _FakeHub.fetched
    allowed = resolve_model(ModelConfig(name_or_path=pickled, allow_pickle_weights=True))
    assert (allowed / "pytorch_model.bin").read_bytes() == b"pickle"


def test_online_errors_name_the_field_and_the_fix(online):
    _FakeHub.repos["org/exists"] = {"config.json": b"{}"}
    with pytest.raises(HubError, match=r"model.name_or_path: Hugging Face model 'org/gated' is gated: accept its "
                                       r"licence on http://127.0.0.1:\d+/org/gated .*huggingface-cli login.*HF_TOKEN"):
        resolve_model(ModelConfig(name_or_path="org/gated"))
    with pytest.raises(HubError, match="model.name_or_path: Hugging Face model 'org/missing' not found: check the "
                                       "id; a private repository needs a token"):
        resolve_model(ModelConfig(name_or_path="org/missing"))
    with pytest.raises(HubError, match="model.revision: revision 'v9' not found in Hugging Face model 'org/exists'"):
        resolve_model(ModelConfig(name_or_path="org/exists", revision="v9"))
    with pytest.raises(HubError, match="model.revision: revision 'v9' not found"):
        resolve_commit("org/exists", revision="v9")
    with pytest.raises(HubError, match="is gated"):
        resolve_commit("org/gated")


def test_unreachable_hub_without_a_cache_says_check_the_network(online, monkeypatch):
    import socket

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setattr(online, "ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(HubError, match="model.name_or_path: cannot reach the Hugging Face Hub .* check the network"):
        resolve_model(ModelConfig(name_or_path="org/not-cached"))


def test_unreachable_hub_falls_back_to_the_cache(online, monkeypatch, hub_tiny):
    repo_id, commit = hub_tiny
    monkeypatch.setattr(online, "ENDPOINT", "http://127.0.0.1:9")  # discard port: connection refused
    assert resolve_commit(repo_id) == commit
    assert resolve_model(ModelConfig(name_or_path=repo_id)).name == commit


@pytest.mark.prefect_server
def test_flow_trains_a_hub_model(config_tree, hub_tiny):
    from flows.phase1a import phase1a

    repo_id, commit = hub_tiny
    config_tree["model"] = {"name_or_path": repo_id}
    config_tree["method"]["epochs"] = 0.5
    config_tree["validation"]["max_examples"] = 8
    state = phase1a(validate_config(config_tree), return_state=True)
    assert state.is_completed(), state.message
    report = json.loads(Path(state.result()).read_text())
    assert report["status"] == "passed" and report["config"]["model"]["name_or_path"] == repo_id
    assert report["stages"]["train"]["result"]["tokens_per_second"] > 0
    assert report["stages"]["validate"]["result"]["model_fingerprint"] == model_fingerprint(
        repo_cache_dir(repo_id) / "snapshots" / commit)


def test_the_flow_stager_runs_for_local_and_s3_sources_only(tiny_model_dir, hub_tiny):
    staged = []

    def stage(source: str) -> Path:
        staged.append(source)
        return tiny_model_dir

    assert resolve_model(ModelConfig(name_or_path="s3://bucket/models/tiny/"), stage=stage) == tiny_model_dir
    assert resolve_model(ModelConfig(name_or_path=str(tiny_model_dir)), stage=stage) == tiny_model_dir
    repo_id, commit = hub_tiny
    assert resolve_model(ModelConfig(name_or_path=repo_id), stage=stage).name == commit  # the HF cache, not staging
    assert staged == ["s3://bucket/models/tiny/", str(tiny_model_dir)]
