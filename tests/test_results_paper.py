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
    # Table 1's throughput is of 4 GPUs ("1.15M tok/s"): per GPU, as ours
    assert rows["Base"]["paper tok/s per GPU"] == "287,500" and rows["Bigram (6V)"]["paper tok/s per GPU"] == "272,500"
    assert rows["MoME (c_grp=4) A2/48"]["paper tok/s per GPU"] == "255,000"
    assert "paper tok/s" not in (tmp_path / "res" / "d12_scaling.md").read_text()  # the paper gives none there


def test_throughput_is_per_gpu_whatever_the_world_size(tmp_path):
    """A run's tok/s is of all its GPUs (summary.json's world_size): beside the paper's 4-GPU figure, a 1-GPU run read
    as a quarter of the paper's speed and an 8-GPU run as twice it, and seeds on different GPU counts were averaged."""
    from test_results_seeds import DONE, table, write_seed

    runs = tmp_path / "runs"
    write_seed(runs, "base", "seed42", {**DONE, "val_bpb": 0.9, "tok_per_sec": 1_000_000.0, "world_size": 4})
    write_seed(runs, "base", "seed43", {**DONE, "val_bpb": 0.9, "tok_per_sec": 250_000.0, "world_size": 1})
    md, cells = table(tmp_path, runs)
    assert cells("Base")["tok/s per GPU"] == "250,000" and cells("Base")["paper tok/s per GPU"] == "287,500", md


def test_every_paper_throughput_is_divided_by_the_papers_gpu_count():
    # Table 1 (d12) was measured on 4 GPUs, the sparse-MoE table on 8 x H100: [row] nproc_per_node says which
    from nanochat.row_config import REPO, find_configs, load_row_config

    paths = find_configs(REPO / "configs")
    assert len(paths) > 80
    for path in paths:
        cfg = load_row_config(path)
        if "tok_per_sec_m" in cfg["paper"]:
            assert cfg["row"]["nproc_per_node"] == 4, path
        if "tok_per_sec" in cfg["paper"]:
            assert cfg["row"]["nproc_per_node"] == 8, path


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
