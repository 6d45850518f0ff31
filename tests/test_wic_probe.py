"""WiC sense-routing probe: reading, strict-natural filtering, hand-computed effects, end-to-end on a tiny model.

tests/fixtures/wic_synthetic.tsv is a hand-written SYNTHETIC file in WiC's layout (word, POS, i-j, s1, s2, T/F);
line by line (1-based) it is meant to be: 1 kept T, 2 kept F, 3 multi-token target (dropped), 4 "Bank" in both
sentences for target "bank" (case-insensitive surface match, same token id: kept), 5 "Bank" vs "bank" (different
token ids: dropped), 6 "banks" (surface mismatch: dropped), 7 target before the midpoint (dropped), 8 target
exactly at the midpoint r = 1/2 (dropped: the rule is strict), 9-12 kept (F, T, F, T).
"""

import json
from pathlib import Path

import pytest
import torch

from scripts import wic_probe
from test_analysis import make_run, make_tokenizer

FIXTURE = Path(__file__).parent / "fixtures" / "wic_synthetic.tsv"


def test_read_tsv_gold_and_jsonl_agree(tmp_path):
    pairs = wic_probe.read_wic(FIXTURE)
    assert len(pairs) == 12 and pairs[0].idx1 == 6 and pairs[0].idx2 == 7 and pairs[0].label is True
    # the original distribution: 5 columns + a gold file
    five = tmp_path / "d.txt"
    five.write_text("".join("\t".join(line.split("\t")[:5]) + "\n" for line in FIXTURE.read_text().splitlines()))
    gold = tmp_path / "g.txt"
    gold.write_text("".join(line.split("\t")[5] + "\n" for line in FIXTURE.read_text().splitlines()))
    jl = tmp_path / "d.jsonl"
    jl.write_text("".join(json.dumps({"word": p.word, "pos": p.pos, "index": f"{p.idx1}-{p.idx2}",
                                      "sentence1": p.sentence1, "sentence2": p.sentence2,
                                      "label": p.label}) + "\n" for p in pairs))
    strip = lambda ps: [(p.word, p.idx1, p.idx2, p.sentence1, p.sentence2, p.label) for p in ps]  # noqa: E731
    assert strip(wic_probe.read_wic(five, gold)) == strip(pairs) == strip(wic_probe.read_wic(jl))


def test_read_errors_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.tsv"
    bad.write_text("bank\tN\t6-7\tonly four\n")
    with pytest.raises(ValueError, match=r"bad.tsv:1: expected 6 tab-separated columns"):
        wic_probe.read_wic(bad)
    bad.write_text("bank\tN\tsix\ta\tb\tT\n")
    with pytest.raises(ValueError, match=r"bad.tsv:1: index 'six'"):
        wic_probe.read_wic(bad)
    bad.write_text("bank\tN\t0-0\ta\tb\tmaybe\n")
    with pytest.raises(ValueError, match=r"bad.tsv:1: label 'maybe'"):
        wic_probe.read_wic(bad)
    with pytest.raises(FileNotFoundError, match="--wic"):
        wic_probe.read_wic(tmp_path / "none.tsv")


def test_strict_natural_filter_keeps_and_drops_the_right_pairs(tmp_path):
    tok = make_tokenizer(tmp_path)
    kept, dropped = wic_probe.filter_pairs(wic_probe.read_wic(FIXTURE), tok)
    lines = [int(k["pair"].source.rsplit(":", 1)[1]) for k in kept]
    assert lines == [1, 2, 4, 9, 10, 11, 12]
    assert dropped == {"multi-token target": 1, "different token ids": 1, "surface mismatch": 1,
                       "target not after the midpoint": 2}
    k = kept[2]  # "Bank" (capitalised) in both sentences, target "bank"
    assert tok.decode([k["ids1"][k["pos1"]]]) == " Bank" and k["ids1"][k["pos1"]] == k["ids2"][k["pos2"]]
    for k in kept:  # positions include BOS; the token at them is the marked word
        assert k["ids1"][0] == tok.bos_token_id
        assert tok.decode([k["ids1"][k["pos1"]]]).strip().lower() == k["pair"].word
        assert wic_probe.relative_position(k["pos1"], len(k["ids1"])) > 0.5
    assert wic_probe.relative_position(2, 4) == 0.5  # line 8: "the bank ." -> [BOS, the, _bank, _.]


def constructed():
    """4 pairs (T, T, F, F) x 2 sites, M = 4, K = 2; site 1 routes identically for every occurrence."""
    e = torch.eye(4, dtype=torch.float64)
    q1 = torch.stack([e[0], e[0], e[0], torch.tensor([.5, .5, 0, 0], dtype=torch.float64)])
    q2 = torch.stack([e[0], e[1], e[1], torch.tensor([0, 0, .5, .5], dtype=torch.float64)])
    u = torch.full((4, 4), 0.25, dtype=torch.float64)
    q1, q2 = torch.stack([q1, u], 1), torch.stack([q2, u], 1)  # (P, S, M)
    a1 = torch.tensor([[0, 1], [0, 1], [0, 1], [0, 1]])
    a2 = torch.tensor([[0, 1], [0, 2], [2, 3], [1, 2]])
    same = torch.tensor([[0, 1]] * 4)
    a1, a2 = torch.stack([a1, same], 1), torch.stack([a2, same], 1)
    g1 = torch.tensor([1.0, 2.0, 0.25, 1.0], dtype=torch.float64)[:, None].expand(4, 2)
    g2 = torch.tensor([1.0, 2.0, 1.0, 0.04], dtype=torch.float64)[:, None].expand(4, 2)
    labels = torch.tensor([True, True, False, False])
    return wic_probe.pair_metrics(q1, q2, a1, a2, g1, g2, 4), labels


def test_effects_equal_hand_computed_values():
    m, labels = constructed()
    # d: T pairs 0 and 1, F pairs 1 and 1 -> dJSD = 1 - 0.5; O~ = o - 1 here: T (1, 0), F (-1, 0) -> dO = 0.5 + 0.5
    assert torch.allclose(m["d"][:, 0], torch.tensor([0.0, 1.0, 1.0, 1.0], dtype=torch.float64))
    assert torch.allclose(m["o"][:, 0], torch.tensor([1.0, 0.0, -1.0, 0.0], dtype=torch.float64))
    assert torch.allclose(m["w"][:, 0], torch.tensor([0.5, 1.0, 0.25, 0.1], dtype=torch.float64))
    res = wic_probe.analyse(m, labels, n_boot=200, taus=[0.2, 0.3])
    assert res["dJSD"].tolist() == pytest.approx([0.5, 0.0])
    assert res["dO"].tolist() == pytest.approx([1.0, 0.0])
    # gate-weighted, weights applied before the class means: F (0.25*1 + 0.1*1)/2, T (0.5*0 + 1*1)/2
    assert res["dJSD_gate"][0].item() == pytest.approx(0.175 - 0.5)
    # O~ gate-weighted: T (0.5*1 + 1*0)/2, F (0.25*-1 + 0.1*0)/2
    assert res["dO_gate"][0].item() == pytest.approx(0.25 + 0.125)
    th = res["thresholds"][0.2]  # pair 3 has min gamma 0.04: dropped
    assert th["dJSD"][0].item() == pytest.approx(1.0 - 0.5) and th["n_T"][0] == 2 and th["n_F"][0] == 1
    assert bool(th["flagged"][0])
    assert torch.isnan(res["thresholds"][0.3]["dJSD"][0])  # no F pair left
    for name in wic_probe.EFFECTS:
        assert (res[f"{name}_lo"] <= res[name] + 1e-12).all() and (res[name] <= res[f"{name}_hi"] + 1e-12).all()
    assert res["dJSD_lo"][1] == res["dJSD_hi"][1] == 0  # site 1: identical routing in every resample
    assert res["mean_pair_gate"][0].item() == pytest.approx((1 + 2 + 0.5 + 0.2) / 4)


def test_wic_probe_end_to_end(tmp_path):
    run, model, tok = make_run(tmp_path, "mome")
    out = tmp_path / "wic"
    assert wic_probe.main(["--run", str(run), "--wic", str(FIXTURE), "--bootstrap", "50", "--out-dir", str(out),
                           "--no-progress"]) == 0
    res = json.loads((out / "wic.json").read_text())
    assert res["pairs_read"] == 12 and res["pairs_kept"] == 7 and res["kept_T"] == 3
    assert len(res["sites"]["dJSD"]) == 2 * 2 and res["summary"]["dJSD"]["sites"] == 4
    assert all(th_flag for th_flag in res["thresholds"]["0.1"]["flagged"])  # < 10 pairs per class everywhere
    # the JSD at one site equals a direct forward over the two sentences of the first kept pair
    ids1 = [tok.bos_token_id] + tok.encode("She deposited her salary at the bank .")
    ids2 = [tok.bos_token_id] + tok.encode("He took out a loan from the bank .")
    bank = tok.encode(" bank")
    assert len(bank) == 1
    probs = []  # the router's probabilities over the M = 6 slots at layer 1 (site 0), head 0: float32
    for ids in (ids1, ids2):
        pos = ids.index(bank[0])
        model.memory.capture = {}
        with torch.no_grad():
            model(torch.tensor([ids]))
        probs.append(model.memory.capture[1]["probs"][0, pos, 0].double())
        model.memory.capture = None
    from nanochat.routing_metrics import jsd_base2

    q1, q2, *rest = wic_probe.capture_targets(model, wic_probe.filter_pairs(wic_probe.read_wic(FIXTURE), tok)[0][:1],
                                              4, "scores", progress=False)
    # the probe runs both sentences as one padded (2, T) batch, the direct forwards are (1, T) each: the same
    # float32 math with different GEMM shapes, whose blocking (and so rounding) depends on the BLAS and the CPU,
    # so the probabilities agree to float32 rounding, not bit for bit. This float32 forward is up to 4e-6
    # (relative) off the same model run in float64 (measured), so two float32 paths may differ by twice that:
    # rtol 1e-4 has margin and is still far below what a wrong position, site or padding would give (> 1e-2).
    captured = (q1[0, 0], q2[0, 0])
    for got, want in zip(captured, probs):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    # and the float64 JSD (of the normalised scores) moves by at most its first-order change, being smooth in them:
    # for normalised p, q and m = (p + q) / 2, a change dp of sum 0 moves it by sum_i dp_i log2(p_i / m_i) / 2;
    # doubled for the second-order terms, plus 1e-12 for the float64 arithmetic
    unit = [(c / c.sum(), p / p.sum()) for c, p in zip(captured, probs)]
    m = (unit[0][1] + unit[1][1]) / 2
    tol = 2 * sum(((c - p).abs() * torch.log2(p / m).abs() / 2).sum().item() for c, p in unit) + 1e-12
    d = wic_probe.pair_metrics(q1, q2, *rest, 6)["d"][0, 0].item()
    assert d == pytest.approx(jsd_base2(*probs).item(), abs=tol)
    lines = (out / "wic_sites.csv").read_text().splitlines()
    assert len(lines) == 1 + 4 and lines[0].startswith("layer,head,dJSD")
    for name in ("wic_routing.png", "wic_gate.png", "wic_gate_mean.png"):
        assert (out / name).stat().st_size > 0


def test_wic_probe_refuses_non_mome(tmp_path, capsys):
    run, _, _ = make_run(tmp_path, "ve")
    assert wic_probe.main(["--run", str(run), "--wic", str(FIXTURE)]) == 2
    assert "needs a MoME model" in capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [(["--bootstrap", "-1"], "--bootstrap must be 0 (no intervals) or >= 41"),
                                          (["--taus", "nan,0.2"], "--taus"), (["--taus", "-0.1"], "--taus"),
                                          (["--taus", "x"], "--taus")])
def test_wic_probe_refuses_bad_numbers(tmp_path, capsys, argv, needle):
    with pytest.raises(SystemExit) as e:
        wic_probe.parse_args(["--run", str(tmp_path), "--wic", str(FIXTURE), *argv])
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_read_errors_for_binary_files_and_two_label_sources(tmp_path):
    binary = tmp_path / "model.pt"
    binary.write_bytes(b"PK\x03\x04\x80\xff")
    with pytest.raises(ValueError, match=r"--wic .*model.pt: not UTF-8"):
        wic_probe.read_wic(binary)
    gold = tmp_path / "g.txt"
    gold.write_text("T\n" * 12)
    with pytest.raises(ValueError, match=r"wic_synthetic.tsv:1: has a label column .* --gold"):
        wic_probe.read_wic(FIXTURE, gold)  # 6 columns and --gold: which label counts would be a guess


@pytest.mark.skipif(not Path("/proc/self/mem").is_file(), reason="needs Linux's /proc/self/mem")
def test_a_wic_file_that_cannot_be_read_is_named_not_the_out_dir(tmp_path, capsys):
    """A --wic whose read fails (here EIO: /proc/self/mem at offset 0, a regular file that no read serves; a bad
    disk or a stale NFS handle alike) was 'could not write <out-dir>: Input/output error', blaming the outputs."""
    run, _, _ = make_run(tmp_path, "mome")
    out = tmp_path / "wic"
    assert wic_probe.main(["--run", str(run), "--wic", "/proc/self/mem", "--out-dir", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err == "error: --wic /proc/self/mem: cannot be read (Input/output error)\n", err
    assert not out.exists()


@pytest.mark.parametrize("fault", ["out-dir is a file", "full disk", "ctrl-c"])
def test_wic_probe_that_cannot_write_or_is_interrupted(tmp_path, monkeypatch, capsys, fault):
    """One error line naming --out-dir and the file; a failed write or Ctrl-C during the forwards leaves the
    earlier output set as it was (no wic.json describing another probe's files) and no staging folder."""
    import errno

    run, _, _ = make_run(tmp_path, "mome")
    out = tmp_path / "wic"
    argv = ["--run", str(run), "--wic", str(FIXTURE), "--bootstrap", "41", "--out-dir", str(out), "--no-progress"]
    if fault == "out-dir is a file":
        out.write_text("x")
    else:
        assert wic_probe.main(argv) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()} if out.is_dir() else None
    capsys.readouterr()

    def full_disk(res, layers, H, out_dir):
        (out_dir / "wic_routing.png").write_bytes(b"\x89PNG")
        raise OSError(errno.ENOSPC, "No space left on device", str(out_dir / "wic_gate.png"))

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(wic_probe, "write_maps", full_disk)
    monkeypatch.setattr(wic_probe, "capture_targets", interrupt if fault == "ctrl-c" else wic_probe.capture_targets)
    rc = wic_probe.main(argv)
    err = capsys.readouterr().err
    assert rc == (130 if fault == "ctrl-c" else 2) and len(err.splitlines()) == 1 and "Traceback" not in err, err
    if fault == "out-dir is a file":
        assert "is not a directory" in err and out.read_text() == "x"
    elif fault == "full disk":
        assert err.startswith(f"error: cannot write the outputs under --out-dir {out}: ") and \
            "No space left on device" in err and "wic_gate.png" in err, err
        assert sorted(before) == sorted(wic_probe.OUTPUTS)
    if fault != "out-dir is a file":
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_zeros_print_without_a_sign_and_no_effect_is_negative_zero(monkeypatch, capsys, tmp_path):
    """A site whose overlap is the same for T and F pairs printed `-0.0000 CI +0.0000..-0.0000`: dO was computed as
    -(E[O|F] - E[O|T]) = -0.0 (written so to wic.json), and a bootstrap end of -1e-17 (float rounding of a zero
    difference) printed its sign too. Printing says +0.0000 for what rounds to zero; a real sign stays."""
    P, S = 8, 2
    labels = torch.tensor([True, False] * 4)
    g = torch.Generator().manual_seed(0)
    ones = torch.ones(P, S, dtype=torch.float64)
    m = {"d": torch.rand(P, S, generator=g, dtype=torch.float64), "o": ones * 0.25, "w": ones / 2, "gmin": ones,
         "pair_gate": ones}
    res = wic_probe.analyse(m, labels, 41, [0.0])
    for name in ("dO", "dO_gate", "dO_lo", "dO_hi"):
        assert not torch.signbit(res[name]).any(), (name, res[name])  # +0.0, as json.dumps writes it: 0.0
    assert json.dumps(wic_probe.summary(res, [1], 2)["dO"]["top10"][0]) == \
        '{"layer": 1, "head": 0, "effect": 0.0, "ci95": [0.0, 0.0]}'

    def summ(effect, lo, hi):
        return {"dO": {"positive_sites": 0, "sites": 2, "top10": [{"layer": 1, "head": 0, "effect": effect,
                                                                   "ci95": [lo, hi]}]}}

    for given, printed in ((summ(-0.0, 0.0, -0.0), "+0.0000 CI +0.0000..+0.0000"),
                           (summ(-1e-17, -4e-5, 1e-17), "+0.0000 CI +0.0000..+0.0000"),
                           (summ(-0.00006, -0.25, 0.5), "-0.0001 CI -0.2500..+0.5000")):
        monkeypatch.setattr(wic_probe, "probe", lambda args, out_dir: given)
        assert wic_probe.main(["--run", str(tmp_path), "--wic", str(FIXTURE)]) == 0
        assert capsys.readouterr().out.splitlines()[0] == f"dO: positive at 0/2 sites; largest L1h0 {printed}"


def test_sites_csv_writes_no_negative_zero():
    # a difference of -1e-9 rounds to "-0.000000": a reader sorting or diffing the CSV sees a sign that is not there
    assert wic_probe.csv_number(-1e-9) == "0.000000" and wic_probe.csv_number(-0.0) == "0.000000"
    assert wic_probe.csv_number(-1e-6) == "-0.000001" and wic_probe.csv_number(0.25) == "0.250000"
