"""An hf: rebuild with the same flags and no --revision streamed the hub dataset again: a change upstream silently
replaced the data under the same name. The build now records the hub commit it streamed (the builder `datasets`
resolved, whose hash is that commit: no extra network call) and refuses a rebuild that would stream another one
without --overwrite, naming both commits and --revision to pin one. The hub itself is out of reach here: the data
comes from a local folder and the resolved commit is stubbed (prepare_data.resolved_commit)."""

import json
from types import SimpleNamespace

import pytest

from nanochat.dataset import iter_documents, load_manifest
from scripts import prepare_data
from scripts.prepare_data import main

OLD, NEW = "a" * 40, "b" * 40


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A local jsonl dataset streamed as if from the hub: ``state["head"]`` is the commit it resolves to."""
    src = tmp_path / "ds"
    src.mkdir()
    (src / "train.jsonl").write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(40)))
    state = {"head": OLD}
    monkeypatch.setattr(prepare_data, "resolved_commit", lambda path, builder: state["head"])
    return f"hf:{src}", state


def test_a_rebuild_that_would_stream_another_commit_is_refused(hub, tmp_path, capsys):
    spec, state = hub
    out = tmp_path / "out"
    base = ["--dataset", spec, "--data-dir", str(out), "--no-progress"]
    assert main(base) == 0
    assert load_manifest(out)["hf"]["commit"] == OLD
    first = list(iter_documents(out, "train"))
    assert main(base) == 0  # the same commit: built again, as before
    state["head"] = NEW  # the dataset changed upstream
    capsys.readouterr()
    assert main(base) == 2
    err = capsys.readouterr().err
    assert err == (f"error: --data-dir {out} holds --dataset {spec} streamed at hub commit {OLD}; this build streams "
                   f"commit {NEW} (the dataset changed upstream, or --revision names another commit) and would "
                   f"replace it under the same name: pass --revision {OLD} to build that commit again, or "
                   "--overwrite to replace it (or give this build a --data-dir of its own)\n")
    assert load_manifest(out)["hf"]["commit"] == OLD and list(iter_documents(out, "train")) == first  # untouched
    # pinning the recorded commit builds it (--revision OLD is the same data as the recorded --revision none),
    # where another --revision's commit is refused as above
    state["head"] = OLD  # what --revision OLD resolves to
    assert main([*base, "--revision", OLD]) == 0
    assert load_manifest(out)["hf"]["commit"] == OLD and list(iter_documents(out, "train")) == first
    state["head"] = NEW
    assert main([*base, "--revision", "v2"]) == 2
    assert main([*base, "--overwrite"]) == 0
    assert load_manifest(out)["hf"]["commit"] == NEW


def test_an_older_manifest_without_a_commit_is_not_compared(hub, tmp_path):
    spec, state = hub
    out = tmp_path / "out"
    base = ["--dataset", spec, "--data-dir", str(out), "--no-progress"]
    assert main(base) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["hf"]["commit"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    state["head"] = NEW
    assert main(base) == 0
    assert load_manifest(out)["hf"]["commit"] == NEW


def test_resolved_commit_is_the_hub_builders_hash(tmp_path):
    """`datasets` gives a hub dataset's builder the commit it resolved as its hash; a local folder (read before the
    hub) has no commit, nor has a builder whose hash is not a commit (another `datasets`)."""
    real = prepare_data.resolved_commit
    assert real("org/name", SimpleNamespace(hash=OLD)) == OLD
    assert real("org/name", SimpleNamespace(hash="not-a-commit")) is None
    assert real("org/name", SimpleNamespace()) is None
    assert real(str(tmp_path), SimpleNamespace(hash=OLD)) is None
