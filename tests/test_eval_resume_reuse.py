"""FinishedResults.would_reuse is the test get_or_run reuses a result by, and base_eval's prepare_bpb skips building a
finished item's rows by: the two must agree on every kind of saved item."""

import json

import pytest

from nanochat.eval_resume import FinishedResults

KEY = {"data_sha256": "ab", "eval_tokens": 64, "rows": (1, 2)}  # a tuple: the file gives a list back
SAVED = {  # item -> what an earlier run left in the file
    "same inputs": {"key": json.loads(json.dumps(KEY)), "result": {"bpb": 1.5}},
    "other inputs": {"key": {**json.loads(json.dumps(KEY)), "eval_tokens": 32}, "result": {"bpb": 1.5}},
    "no result": {"key": json.loads(json.dumps(KEY)), "result": None},
    "no key": {"result": {"bpb": 1.5}},  # a hand-edited file: recomputed, not a KeyError
}


@pytest.mark.parametrize("item,reused", [("same inputs", True), ("other inputs", False), ("no result", False),
                                         ("no key", False), ("never finished", False)])
def test_would_reuse_is_what_get_or_run_does(tmp_path, capsys, item, reused):
    store = FinishedResults(tmp_path / "bpb.partial.json", {"s": 1}, dict(SAVED))
    assert store.would_reuse(item, KEY) is reused
    ran = []
    result = store.get_or_run(item, lambda: KEY, lambda: ran.append(item) or {"bpb": 2.0})
    assert (ran == []) is reused and store.reused == ([item] if reused else [])
    assert result == ({"bpb": 1.5} if reused else {"bpb": 2.0})
    said = capsys.readouterr().out
    assert ("inputs of" in said) is (item in ("other inputs", "no key")), said
