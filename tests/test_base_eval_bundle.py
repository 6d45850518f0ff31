"""base_eval's CORE bundle: the locator and downloader (nanochat/eval_bundle.py), and the shipped subset
(scripts/make_core_subset.py)."""

import functools
import hashlib
import http.server
import json
import sys
import threading
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _eval_helpers import MC_ROWS, write_bundle  # noqa: E402

from nanochat import eval_bundle as eb  # noqa: E402


# -- bundle locating / downloading -------------------------------------------------------------------------
def _serve(directory: Path):
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(directory))
    handler.log_message = lambda *a, **k: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _zip_bundle(src: Path, zip_path: Path) -> str:
    with zipfile.ZipFile(zip_path, "w") as zf:  # same layout as upstream: a top-level eval_bundle/ folder
        for p in sorted(src.rglob("*")):
            if p.is_file():
                zf.write(p, Path("eval_bundle") / p.relative_to(src))
    return hashlib.sha256(zip_path.read_bytes()).hexdigest()


def test_download_extract_checksum_and_cache(tmp_path, monkeypatch):
    src = write_bundle(tmp_path / "src", {"mc": ("multiple_choice", 0, " ", MC_ROWS)}, {"mc": 25})
    (tmp_path / "www").mkdir()
    digest = _zip_bundle(src, tmp_path / "www" / "eval_bundle.zip")
    server = _serve(tmp_path / "www")
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/eval_bundle.zip"
        monkeypatch.delenv("NANOCHAT_EVAL_BUNDLE", raising=False)
        monkeypatch.setenv("NANOCHAT_EVAL_CACHE", str(tmp_path / "cache"))
        monkeypatch.setenv("NANOCHAT_EVAL_BUNDLE_URL", url)
        monkeypatch.setenv("NANOCHAT_EVAL_BUNDLE_SHA256", "0" * 64)
        with pytest.raises(RuntimeError, match=f"checksum mismatch .* got sha256 {digest}"):
            eb.find_bundle()
        monkeypatch.setenv("NANOCHAT_EVAL_BUNDLE_SHA256", digest)
        got = eb.find_bundle()
        assert got == tmp_path / "cache" / "eval_bundle"
        assert (got / "eval_data" / "cat" / "mc.jsonl").read_bytes() == (src / "eval_data/cat/mc.jsonl").read_bytes()
        assert json.loads((tmp_path / "cache" / "eval_bundle.sha256").read_text())["sha256"] == digest
        assert not list((tmp_path / "cache").glob("*.part"))
    finally:
        server.shutdown()
    assert eb.find_bundle() == got  # cached: no server needed any more


def test_download_failure_is_clear(tmp_path, offline_bundle):
    with pytest.raises(RuntimeError, match=r"after 3 attempts.*--bundle DIR.*--bundle subset"):
        eb.find_bundle()
    assert not list((tmp_path / "cache").glob("eval_bundle.zip*"))


def test_find_bundle_order(tmp_path, monkeypatch):
    a = write_bundle(tmp_path / "a", {}, {})
    b = write_bundle(tmp_path / "b", {}, {})
    monkeypatch.setenv("NANOCHAT_EVAL_BUNDLE", str(b))
    assert eb.find_bundle(str(a)) == a and eb.find_bundle() == b
    assert eb.find_bundle("subset") == eb.SUBSET_DIR
    with pytest.raises(FileNotFoundError, match="--bundle .* has no core.yaml"):
        eb.find_bundle(str(tmp_path))


# -- the shipped subset ---------------------------------------------------------------------------------------
def test_core_inputs_follow_the_run(tmp_path, monkeypatch):
    """--bundle run / --max-per-task run (base_eval's and the analyses' defaults): the run's --bundle (subset keeps
    its meaning), else the bundle its search found, and its --core-max-per-task (an older run's 0 is all), from
    config.json before the checkpoint; an explicit flag as given; a run that records none gets the search order
    and every example, and the source says so."""
    def meta(bundle=None, cap=None, found=None):
        return {"config": {"args": {"bundle": bundle, "core_max_per_task": cap}, "data": {"bundle": found}}}

    got = eb.run_core_inputs("run", "run", meta("subset", 24, str(eb.SUBSET_DIR)))
    assert got == eb.CoreInputs("subset", "the run's bundle, its checkpoint", 24,
                                "the run's --core-max-per-task, its checkpoint")
    assert got.describe() == ("CORE bundle subset (the run's bundle, its checkpoint); examples per task 24 (the "
                              "run's --core-max-per-task, its checkpoint)")
    assert eb.run_core_inputs("/b", 5, meta("subset", 24)) == eb.CoreInputs("/b", "--bundle", 5, "--max-per-task")
    none = eb.CoreInputs(None, "default: the run records no bundle", -1,
                         "default: the run records no --core-max-per-task")
    assert eb.run_core_inputs("run", "run", {"reason": "imported"}) == none
    assert eb.run_core_inputs("run", "run", {"config": {"args": None}}) == none
    assert "the first found (NANOCHAT_EVAL_BUNDLE, the cache, a download)" in none.describe()
    assert eb.run_core_inputs("run", "run", meta(cap=0)).max_per_task == -1  # an older version's "all"
    # no --bundle: the one its search order found (here NANOCHAT_EVAL_BUNDLE's), which can differ from ours
    found = write_bundle(tmp_path / "found", {}, {})
    assert eb.recorded_bundle(meta(found=str(found))) == (str(found), "the run's bundle, its checkpoint")
    # config.json first: a final evaluation resumed with other flags saves no new checkpoint
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(json.dumps(meta("subset", 3)["config"]))
    assert eb.run_core_inputs("run", "run", meta(str(found), 24), tmp_path / "run") == eb.CoreInputs(
        "subset", "the run's bundle, its config.json", 3, "the run's --core-max-per-task, its config.json")
    # a relative path is read from here, where it holds a bundle; else an error naming the run's value and the flag
    monkeypatch.chdir(tmp_path)
    assert eb.recorded_bundle(meta("found")) == ("found", "the run's bundle, its checkpoint, relative to this directory")
    monkeypatch.chdir(tmp_path / "run")
    with pytest.raises(ValueError, match=r"^--bundle run: the run evaluated CORE on the bundle 'found' \(its "
                       r"checkpoint\) \(a relative path: .*does not record; from here it is .*/run/found\), which holds "
                       r"no core.yaml here; pass --bundle PATH"):
        eb.run_core_inputs("run", 2, meta("found"))
    with pytest.raises(ValueError, match=r"the bundle '/gone/bundle' \(its checkpoint\), which holds no core.yaml"):
        eb.run_core_inputs("run", "run", meta(found="/gone/bundle"))
    assert eb.run_core_inputs("subset", "run", meta("found")).bundle == "subset"  # an explicit flag: not checked


def test_shipped_subset_is_labelled_and_small():
    tasks = eb.load_core_tasks(eb.SUBSET_DIR)
    info = eb.bundle_info(eb.SUBSET_DIR)
    assert len(tasks) == 22 and info["subset"] is True and info["missing_tasks"] == ["coqa"]
    assert set(info["approx_tasks"]) == {"hellaswag", "hellaswag_zeroshot"}
    baselines = eb.load_random_baselines(eb.SUBSET_DIR)
    for t in tasks:
        path = eb.SUBSET_DIR / "eval_data" / t.dataset_uri
        if t.label == "coqa":
            assert not path.exists()
            continue
        rows = eb.load_task_data(path, t.task_type)
        assert 0 < len(rows) <= 100 and len(rows) == info["tasks"][t.label]["rows"]
        assert t.label in baselines
    assert "subset" in (eb.SUBSET_DIR / "README.md").read_text().lower()


def test_subset_rebuild_is_identical(shared_dir, tmp_path):
    from scripts.make_core_subset import build

    build(shared_dir, tmp_path / "s", 100)
    for p in sorted((eb.SUBSET_DIR).rglob("*")):
        if p.is_file() and p.name != "README.md":
            assert (tmp_path / "s" / p.relative_to(eb.SUBSET_DIR)).read_bytes() == p.read_bytes(), p


def test_subset_file_evaluates_like_max_per_task_on_the_full_file(tmp_path):
    """The evaluator shuffles every task file and draws few-shot examples by position: the subset must give the
    same ordered examples as --max-per-task on the full file (not only the same set), for 100 and fewer rows."""
    from nanochat.core_eval import fewshot_for, order_task_data
    from scripts.make_core_subset import subset_rows

    for n_rows, n in ((250, 100), (32, 100)):
        rows = [{"query": f"q{i}", "choices": ["a", "b"], "gold": i % 2} for i in range(n_rows)]
        full = tmp_path / f"full{n_rows}.jsonl"
        full.write_text("".join(json.dumps(r) + "\n" for r in rows))
        sub = subset_rows(full, "multiple_choice", n)
        expect = order_task_data(rows, n)
        assert order_task_data(sub) == expect
        assert all(fewshot_for(order_task_data(sub), i, 5) == fewshot_for(expect, i, 5) for i in range(len(expect)))


def test_shipped_subset_equals_max_per_task_100(shared_dir):
    bundle = shared_dir / "eval_bundle"
    for task in eb.load_core_tasks(bundle):
        full = bundle / "eval_data" / task.dataset_uri
        if not full.is_file():
            continue
        from nanochat.core_eval import order_task_data

        sub = eb.load_task_data(eb.SUBSET_DIR / "eval_data" / task.dataset_uri, task.task_type)
        assert order_task_data(sub) == order_task_data(eb.load_task_data(full, task.task_type), 100), task.label


def test_shared_bundle_n_comes_from_file(shared_dir):
    arc = eb.load_task_data(shared_dir / "eval_bundle/eval_data/world_knowledge/arc_challenge.jsonl", "multiple_choice")
    assert len(arc) == 1172  # eval_meta_data.csv claims 2,376
