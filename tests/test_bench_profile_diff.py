"""bench/profile_diff.py as dev/gpu/run_all.sh's ``diff`` step calls it on the device machine: a profile name
that bench/train_step.py did not write (a design without MoME is profiled under mix "auto", so VE beside
``--mix row`` is ve_auto_auto.json, not ve_row_auto.json) is one error line that lists the profiles there, so a
15-minute GPU session can rerun the diff here from the returned files without guessing. The other input checks
are in tests/test_profile_diff.py."""

import json

from conftest import load_bench


def _profile(path) -> None:
    path.write_text(json.dumps({"steps": 1, "time": "device", "total_us": 1.0,
                                "kernels": [{"name": "k", "category": "gemm", "calls": 1, "total_us": 1.0}]}))


def test_a_missing_profile_names_the_profiles_beside_it(tmp_path, capsys):
    diff = load_bench("profile_diff")
    prof = tmp_path / "prof"
    prof.mkdir()
    for name in ("ve_auto_auto.json", "mome-bigram_row_auto.json", "mome-bigram_row_auto_stk.json"):
        _profile(prof / name)
    (prof / "ve_auto_auto.txt").write_text("the op table: not a profile JSON")
    assert diff.main([str(prof / "ve_row_auto.json"), str(prof / "mome-bigram_row_auto.json")]) == 2
    err = capsys.readouterr().err
    assert err == (f"profile_diff: error: {prof / 've_row_auto.json'}: no such file (profiles there: "
                   "mome-bigram_row_auto.json, mome-bigram_row_auto_stk.json, ve_auto_auto.json)\n")


def test_a_missing_profile_folder_says_so(tmp_path, capsys):
    """No profile written at all (the bench stopped before its profiles): the folder is named as missing."""
    diff = load_bench("profile_diff")
    missing = tmp_path / "prof" / "ve_auto_auto.json"
    assert diff.main([str(missing), str(missing)]) == 2
    assert capsys.readouterr().err == (f"profile_diff: error: {missing}: no such file (no folder "
                                       f"{tmp_path / 'prof'})\n")
