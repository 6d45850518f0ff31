"""Domain names of the analyses' outputs (session 34 review): every domain given is one entry of the outputs, and
one task named twice is refused rather than weighed twice in the task-balanced CORE average."""

from types import SimpleNamespace

import pytest

from nanochat.analysis import build_domains
from nanochat.eval_bundle import SUBSET_DIR
from test_analysis import make_run, make_tokenizer


def files_named_alike(tmp_path):
    """Corpora whose files share a stem, as datasets kept one per folder often do (enwik9/val.txt,
    shakespeare/val.txt), and one whose stem is the CORE average's name."""
    paths = [tmp_path / "enwik9" / "val.txt", tmp_path / "shakespeare" / "val.txt", tmp_path / "CORE.txt"]
    for p, text in zip(paths, ("She deposited her salary at the bank. ", "They had a picnic on the river bank. ",
                               "He took out a loan from the bank. ")):
        p.parent.mkdir(exist_ok=True)
        p.write_text(text * 8)
    return paths


def test_file_domains_sharing_a_name_are_named_by_their_paths(tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    a, b, core = files_named_alike(tmp_path)
    other = tmp_path / "notes.txt"
    other.write_text("the bank " * 4)
    domains = build_domains([f"file:{a}", f"file:{b}", f"file:{core}", f"file:{other}"], tok, 64)
    assert [d.name for d in domains] == [str(a), str(b), str(core), "notes"]  # a unique stem stays the name
    assert domains[0].rows[0].tolist() != domains[1].rows[0].tolist()


@pytest.mark.parametrize("twice", [["core:copa", "core:all"], ["core:copa", "core:copa"], ["file:{a}", "file:{a}"]])
def test_a_domain_given_twice_is_refused_naming_both_specs(tmp_path, twice):
    tok = make_tokenizer(tmp_path / "tok")
    a, _, _ = files_named_alike(tmp_path)
    specs = [s.format(a=a) for s in twice]
    with pytest.raises(ValueError, match=r"--corpus: domain .* is given twice \(" + ".* and ".join(map(
            lambda s: s.replace("(", r"\(").replace(")", r"\)"), specs))):
        build_domains(specs, tok, 64, core=lambda: (SimpleNamespace(max_per_task=2), SUBSET_DIR))


def test_memory_use_has_one_entry_per_file_of_one_stem(tmp_path):
    """The outputs are dicts keyed by the domain name: before, the second val.txt's numbers stood under "val" and
    the first's were lost."""
    from scripts.analyze_memory import memory_use

    _, model, tok = make_run(tmp_path, "ve")
    a, b, _ = files_named_alike(tmp_path)
    results = memory_use(model, build_domains([f"file:{a}", f"file:{b}"], tok, 64), 2, tok.bos_token_id, False)
    assert list(results) == [str(a), str(b)] and results[str(a)]["gamma"] != results[str(b)]["gamma"]


def test_the_jsd_reference_is_named_apart_from_a_corpus_file_of_its_stem(tmp_path):
    """"Mean/max JSD vs val" must not name the --corpus file val.txt when the reference is another val.txt."""
    from scripts.analyze_routing import name_reference

    tok = make_tokenizer(tmp_path / "tok")
    a, b, _ = files_named_alike(tmp_path)
    corpus = build_domains([f"file:{a}"], tok, 64)
    ref = name_reference(build_domains([f"file:{b}"], tok, 64, flag="--reference")[0], corpus)
    assert (corpus[0].name, ref.name) == ("val", str(b))
    same = name_reference(build_domains([f"file:{a}"], tok, 64, flag="--reference")[0], corpus)
    assert same.name == "val"  # the corpus domain itself: its row is the reference's (JSD 0)


def test_a_file_whose_path_is_another_domains_name_is_named_by_its_spec(tmp_path, monkeypatch):
    """`file:copa` beside `core:copa`, or a file named CORE beside the CORE average: the path as given is still the
    other domain's name, so the file is named by its whole spec (before: refused as "given twice", or CORE's
    task-balanced average overwritten by the file's numbers)."""
    tok = make_tokenizer(tmp_path / "tok")
    monkeypatch.chdir(tmp_path)
    for name in ("copa", "CORE"):
        (tmp_path / name).write_text("He took out a loan from the bank. " * 8)
    domains = build_domains(["file:copa", "core:copa", "file:CORE"], tok, 64,
                            core=lambda: (SimpleNamespace(max_per_task=2), SUBSET_DIR))
    assert [d.name for d in domains] == ["file:copa", "copa", "file:CORE"]
