"""scripts.results: which runs count as seeds of a paper row."""

import json


def test_a_run_started_from_another_runs_weights_is_listed_not_averaged(tmp_path):
    """The paper's rows train from scratch: an --init-from run in a row's directory is named under the table and
    neither averaged nor counted as a seed."""
    from scripts import results

    def write(seed, **summary):
        d = tmp_path / "runs" / "d12" / "base" / f"seed{seed}"
        d.mkdir(parents=True)
        d.joinpath("summary.json").write_text(json.dumps(summary))

    done = dict(stop_reason="completed", params_memory=0, params_total=135_000_000, tok_per_sec=1000.0)
    write(42, **done, val_bpb=0.88, init_from=None)
    write(43, **done, val_bpb=0.70, init_from={"run_dir": "/runs/big", "step": 900, "spec": "/runs/big"})
    results.main(["--table", "d12", "--runs-root", str(tmp_path / "runs"), "--out", str(tmp_path / "res")])
    md = (tmp_path / "res" / "d12.md").read_text()
    header = [c.strip() for c in md.splitlines()[0].strip("|").split("|")]
    base = dict(zip(header, (c.strip() for c in next(l for l in md.splitlines() if l.startswith("| Base |"))
                             .strip("|").split("|"))))
    assert base["seeds"] == "1" and base["val bpb"].startswith("0.8800")
    assert "- Base: seed43 started from the weights of /runs/big step 900 (--init-from), not averaged" in md
