"""wic.json says what its intervals depend on (session 34 review)."""

import json

from scripts import wic_probe
from test_analysis import make_run
from test_wic_probe import FIXTURE


def test_wic_json_records_the_bootstrap_seed(tmp_path, monkeypatch):
    """The 95% intervals are a function of --seed: without it in wic.json another run of the probe could not
    reproduce them (the default 0 and a --seed 7 run wrote the same report fields)."""
    run, _, _ = make_run(tmp_path, "mome")
    monkeypatch.setattr(wic_probe, "write_maps", lambda *args: None)  # the figures are not what is tested here
    out = tmp_path / "wic"
    assert wic_probe.main(["--run", str(run), "--wic", str(FIXTURE), "--bootstrap", "41", "--seed", "7",
                           "--out-dir", str(out), "--no-progress"]) == 0
    report = json.loads((out / "wic.json").read_text())
    assert (report["bootstrap"], report["bootstrap_seed"]) == (41, 7)
