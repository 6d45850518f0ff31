"""scripts.results: the paper's numbers beside ours."""


def test_the_d12_tables_show_the_papers_throughput(tmp_path):
    """The d12 rows record the paper's throughput in M tok/s ([paper] tok_per_sec_m, Table 1's "1.15M tok/s"):
    only the sparse-MoE rows' tok_per_sec was shown, so the d12 table's tok/s column stood beside no paper number."""
    from scripts import results

    (tmp_path / "runs").mkdir()  # no runs: the paper's numbers only
    assert results.main(["--table", "d12", "--table", "d12_scaling", "--runs-root", str(tmp_path / "runs"),
                         "--out", str(tmp_path / "res")]) == 0
    md = (tmp_path / "res" / "d12.md").read_text().splitlines()
    header = [c.strip() for c in md[0].strip("|").split("|")]
    rows = {r["row"]: r for r in (dict(zip(header, (c.strip() for c in line.strip("|").split("|"))))
                                  for line in md[2:] if line.startswith("|"))}
    assert rows["Base"]["paper tok/s"] == "1,150,000" and rows["Bigram (6V)"]["paper tok/s"] == "1,090,000"
    assert rows["MoME (c_grp=4) A2/48"]["paper tok/s"] == "1,020,000"
    assert "paper tok/s" not in (tmp_path / "res" / "d12_scaling.md").read_text()  # the paper gives none there


def test_two_configs_of_one_row_are_refused(tmp_path, capsys):
    """A row config copied to try a variant, its [row] name left as it was: both rows read runs/d12/base/ (the
    runner writes the copy's seeds there too), and the table showed that row's seeds twice, each time beside a
    config's paper numbers."""
    from nanochat.row_config import REPO
    from scripts import results

    configs = tmp_path / "configs" / "d12"
    configs.mkdir(parents=True)
    text = (REPO / "configs" / "d12" / "base.toml").read_text(encoding="utf-8")
    for name in ("base", "base_lr"):
        configs.joinpath(f"{name}.toml").write_text(text, encoding="utf-8")
    (tmp_path / "runs").mkdir()
    assert results.main(["--configs", str(tmp_path / "configs"), "--runs-root", str(tmp_path / "runs"),
                         "--out", str(tmp_path / "res")]) == 2
    assert capsys.readouterr().err == (
        f"error: {configs / 'base.toml'} and {configs / 'base_lr.toml'} are both row d12/base (runs/d12/base/): "
        "give each row config a [row] name of its own\n")
    assert not (tmp_path / "res").exists()
