import io
import random
import re

import numpy as np
import pytest
import torch

from data_fixtures import write_numbered_docs
from nanochat.dataloader import BestFitPacker, PackedDataLoader, build_eval_rows, iter_eval_batches
from nanochat.dataset import DataError

SEQ = 64


@pytest.fixture(scope="module")
def synthetic_dir(tmp_path_factory):
    """96 uniquely numbered documents of varied length in 2 train shards with 8-doc row groups (12 units)."""
    return write_numbered_docs(tmp_path_factory.mktemp("synthetic"), 96, row_group_size=8, val_docs=16)


def loader(data_dir, tok, **kw):
    args = dict(split="train", batch_size=4, seq_len=SEQ, tokenizer=tok, buffer_docs=16, tokenize_chunk=8)
    args.update(kw)
    return PackedDataLoader(data_dir, **args)


def take(dl, n):
    return [next(dl) for _ in range(n)]


def test_rows_are_bos_aligned_documents_without_padding(synthetic_dir, tiny_tokenizer):  # noqa: F811
    tok = tiny_tokenizer
    full_docs = {tuple([tok.bos_token_id] + tok.encode(t)) for t in _all_docs(synthetic_dir)}
    dl = loader(synthetic_dir, tok)
    for x, y in take(dl, 10):
        assert x.shape == y.shape == (4, SEQ) and x.dtype == y.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
        rows = torch.cat([x, y[:, -1:]], dim=1)
        for row in rows.tolist():
            assert row[0] == tok.bos_token_id
            starts = [i for i, t in enumerate(row) if t == tok.bos_token_id] + [len(row)]
            segments = [tuple(row[a:b]) for a, b in zip(starts, starts[1:])]
            # every segment but the last is a whole document; the last is a document or a cropped prefix of one
            assert all(s in full_docs for s in segments[:-1])
            assert any(d[:len(segments[-1])] == segments[-1] for d in full_docs)
    dl.close()


def _all_docs(data_dir):
    from nanochat.dataset import iter_documents

    return list(iter_documents(data_dir, "train"))


def naive_best_fit(lengths, row_len, buffer_docs):
    """Reference: scan the buffer for the largest doc that fits (oldest on ties), else crop the shortest."""
    stream, buf, rows = list(enumerate(lengths)), [], []
    while True:
        row, pos = [], 0
        while pos < row_len:
            while len(buf) < buffer_docs and stream:
                buf.append(stream.pop(0))
            if not buf:
                return rows
            fits = [d for d in buf if d[1] <= row_len - pos]
            if fits:
                pick = max(fits, key=lambda d: (d[1], -d[0]))
                row.append((pick[0], pick[1]))
                pos += pick[1]
            else:
                pick = min(buf, key=lambda d: (d[1], d[0]))
                row.append((pick[0], row_len - pos))
                pos = row_len
            buf.remove(pick)
        rows.append(row)


def test_best_fit_matches_naive_reference():
    rng = random.Random(1)
    lengths = [rng.choice([1, 3, 5, 5, 8, 13, 20, 40, 70]) for _ in range(300)]
    packer = BestFitPacker(row_len=32, buffer_docs=10)
    # doc i is the token value i repeated, so a row tells which documents (and how much of them) it holds
    source = iter([np.full(n, i, dtype=np.int32)] for i, n in enumerate(lengths))
    got, row = [], np.empty(32, dtype=np.int64)
    while packer.fill_row(row, lambda: packer.add(next(source, [])) or packer.next_seq < len(lengths)):
        values, counts = np.unique(row, return_counts=True)
        order = sorted(range(len(values)), key=lambda k: np.flatnonzero(row == values[k])[0])
        got.append([(int(values[k]), int(counts[k])) for k in order])
    assert got == naive_best_fit(lengths, 32, 10)[:len(got)] and len(got) > 50


def test_two_rank_striping_covers_each_document_once(synthetic_dir, tiny_tokenizer):  # noqa: F811
    ranks = [loader(synthetic_dir, tiny_tokenizer, rank=r, world_size=2, seed=3) for r in range(2)]
    for epoch in (0, 1):
        seen = [dl.epoch_documents(epoch) for dl in ranks]
        assert len(seen[0]) + len(seen[1]) == 96 and not set(seen[0]) & set(seen[1])
        all_docs = {(u, r) for u, (_, _, n) in enumerate(ranks[0].index.units) for r in range(n)}
        assert set(seen[0]) | set(seen[1]) == all_docs
    # end to end: the documents packed into the first batches (all from epoch 0) differ between the ranks
    ids = []
    for dl in ranks:
        text = "".join(tiny_tokenizer.decode(row.tolist()) for x, _ in take(dl, 2) for row in x)
        ids.append(set(re.findall(r"doc(\d{3})", text)))
        dl.close()
    assert len(ids[0]) >= 4 and len(ids[1]) >= 4 and not ids[0] & ids[1]


def test_resume_is_exact_across_epochs(synthetic_dir, tiny_tokenizer):  # noqa: F811
    reference = loader(synthetic_dir, tiny_tokenizer, seed=5)
    expected = take(reference, 40)  # ~40*4*64 tokens: several passes over the ~3k-token corpus
    reference.close()
    for split_at in (3, 17):
        dl = loader(synthetic_dir, tiny_tokenizer, seed=5)
        take(dl, split_at)
        buf = io.BytesIO()
        torch.save(dl.state_dict(), buf)  # must survive a checkpoint round trip with weights_only loading
        dl.close()
        resumed = loader(synthetic_dir, tiny_tokenizer, seed=5)
        resumed.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
        for (ex, ey), (gx, gy) in zip(expected[split_at:], take(resumed, 40 - split_at)):
            assert torch.equal(ex, gx) and torch.equal(ey, gy)
        assert resumed.cursor[0] >= 1 or split_at == 3
        resumed.close()


def test_passes_count_epochs_and_the_share_of_the_current_one(synthetic_dir, tiny_tokenizer):  # noqa: F811
    dl = loader(synthetic_dir, tiny_tokenizer, seed=5)
    assert dl.passes() == 0.0
    seen = []
    for _ in range(40):  # several passes over the ~3k-token corpus
        next(dl)
        epoch, position, _ = dl.cursor
        seen.append(dl.passes())
        assert seen[-1] == epoch + position / len(dl._rank_units(epoch))
    assert seen == sorted(seen) and seen[-1] > 2  # never backwards; whole passes counted
    dl.close()


def test_seed_changes_order_reproducibly(synthetic_dir, tiny_tokenizer):  # noqa: F811
    def first_batches(seed):
        dl = loader(synthetic_dir, tiny_tokenizer, seed=seed)
        out = torch.cat([x for x, _ in take(dl, 3)])
        dl.close()
        return out

    a, b, c = first_batches(0), first_batches(0), first_batches(1)
    assert torch.equal(a, b) and not torch.equal(a, c)
    dl0, dl1 = (loader(synthetic_dir, tiny_tokenizer, seed=s) for s in (0, 1))
    assert dl0.epoch_documents(0) != dl1.epoch_documents(0)
    assert sorted(dl0.epoch_documents(0)) == sorted(dl1.epoch_documents(0))


def test_bad_state_and_world_size_errors(synthetic_dir, tiny_tokenizer):  # noqa: F811
    state = loader(synthetic_dir, tiny_tokenizer, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed=1 but this loader has 2"):
        loader(synthetic_dir, tiny_tokenizer, seed=2).load_state_dict(state)
    with pytest.raises(DataError, match="12 row groups, fewer than world size 16"):
        loader(synthetic_dir, tiny_tokenizer, rank=0, world_size=16)


def test_embedded_loader_runs(embedded_data_dir, tiny_tokenizer):  # noqa: F811
    dl = PackedDataLoader(embedded_data_dir, "train", 2, 128, tiny_tokenizer, seed=0)
    x, y = next(dl)
    assert x.shape == (2, 128) and (x[:, 0] == tiny_tokenizer.bos_token_id).all()
    assert int(x.max()) < tiny_tokenizer.vocab_size
    dl.close()


def test_eval_rows_independent_of_world_and_batch_size(embedded_data_dir, tiny_tokenizer):  # noqa: F811
    rows = build_eval_rows(embedded_data_dir, "val", tiny_tokenizer, 128, 5000)
    assert rows.shape == (40, 129) and (rows[:, 0] == tiny_tokenizer.bos_token_id).all()
    assert torch.equal(rows, build_eval_rows(embedded_data_dir, "val", tiny_tokenizer, 128, 5000))
    reference = sorted(map(tuple, rows[:, :-1].tolist()))
    for world, batch in ((1, 40), (2, 3), (3, 7)):
        seen = []
        for rank in range(world):
            for x, y in iter_eval_batches(rows, batch, rank, world):
                assert x.shape[0] <= batch and torch.equal(x[:, 1:], y[:, :-1])
                seen += map(tuple, x.tolist())
        assert sorted(seen) == reference
    for split in ("val", "train"):  # the message names the split that is too small
        with pytest.raises(DataError, match=f"the {split} split .*--eval-tokens.* a larger {split} split"):
            build_eval_rows(embedded_data_dir, split, tiny_tokenizer, 128, 10**9)


EVAL_ROWS_CASES = [("val", None), ("train", 3)]
STOP_ROUNDS = "0,2"


@pytest.fixture(scope="module")
def eval_rows_launch(embedded_data_dir, tiny_tokenizer_dir, tmp_path_factory):  # noqa: F811
    """One 2-rank torchrun (tests/_eval_rows_worker.py) for the eval-rows tests below: the rows of each
    EVAL_ROWS_CASES case (rows_<split>.pt) and the signal scenarios of STOP_ROUNDS (stops.json), one after the other
    in one process group (each torchrun start-up costs ~5 s of the 2 CI cores)."""
    from conftest import REPO, run_torchrun

    tmp = tmp_path_factory.mktemp("eval_rows")
    cases = [f"{tmp / f'rows_{split}.pt'}" + (f",{split},{seed}" if seed else "") for split, seed in EVAL_ROWS_CASES]
    r = run_torchrun(REPO / "tests" / "_eval_rows_worker.py", 2, [str(embedded_data_dir), str(tiny_tokenizer_dir),
                                                                   *cases, "--stops", STOP_ROUNDS,
                                                                   str(tmp / "stops.json")])
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp


@pytest.mark.parametrize("split,seed", EVAL_ROWS_CASES)
def test_eval_rows_tokenized_across_ranks_equal_one_process(split, seed, embedded_data_dir, tiny_tokenizer_dir,
                                                            eval_rows_launch):
    """2 gloo ranks split the tokenization (each ~half the documents) and pack exactly the 1-process rows: the val
    rows, and the train bpb rows (the documents a loader of the seed reads first)."""
    from nanochat.tokenizer import Tokenizer

    res = torch.load(eval_rows_launch / f"rows_{split}.pt")
    one = build_eval_rows(embedded_data_dir, split, Tokenizer.load(tiny_tokenizer_dir), 128, 20000,
                          first_read_seed=seed)
    assert torch.equal(res["rows"], one)
    a, b = res["docs_tokenized"]
    if seed is None:  # chunks of 128 documents alternate between the ranks
        assert abs(a - b) <= 128 and a + b >= 2 * 128
    else:  # chunks of at most 128 (a row group's documents) alternate
        assert a > 0 and b > 0
        assert not torch.equal(one, build_eval_rows(embedded_data_dir, split, Tokenizer.load(tiny_tokenizer_dir), 128,
                                                    20000))


# ---- --resume-new-world-size: PackedDataLoader.repartition --------------------------------------------------
# Unit-level accounting from cursors (what a checkpoint records): a rank at cursor (e, upos, dpos) has started
# the units of its lists before epoch e, the first upos of its epoch-e list, and the unit at upos if dpos > 0.
# A started unit counts as read (the repartition policy drops the unread rest of a half-read unit).

def _started_units(dl, from_epoch, cursor):
    e, upos, dpos = cursor
    out = []
    for ep in range(from_epoch, e + 1):
        units = dl._rank_units(ep)
        out += [int(u) for u in (units if ep < e else units[:upos + (1 if dpos else 0)])]
    return out


def _run_phases(data_dir, tok, phases, through_epoch):
    """Phases [(world size, cursor of each rank at save time)], each resumed from the previous one's states with
    repartition(); the last phase reads to the end of ``through_epoch``. Returns a Counter of unit reads."""
    from collections import Counter

    reads, states = Counter(), None
    for world, cursors in phases:
        dls = [loader(data_dir, tok, rank=r, world_size=world, seed=7) for r in range(world)]
        if states is not None:
            for dl in dls:
                dl.repartition(states)
            # every new rank derives the same unit list from the same old states
            assert all(np.array_equal(dl.remaining[1], dls[0].remaining[1]) for dl in dls)
        start = dls[0].cursor[0]
        cursors = cursors or [(through_epoch + 1, 0, 0)] * world
        states = []
        for dl, c in zip(dls, cursors):
            assert c[0] > start or c[1] <= len(dl._rank_units(c[0])), "test cursor past the rank's unit list"
            reads.update(_started_units(dl, start, c))
            dl.cursor = c
            states.append(dl.state_dict())
    return reads


REPARTITION_CASES = {
    # one rank behind: rank 1 is half way through epoch 0 (inside a unit) while rank 0 is in epoch 1
    "behind_2_to_1": [(2, [(1, 2, 0), (0, 3, 5)]), (1, None)],
    "behind_2_to_3": [(2, [(1, 1, 4), (0, 2, 0)]), (3, None)],
    # a rank that finished epoch 0 but whose cursor has not rolled over to epoch 1 yet
    "finished_not_rolled": [(2, [(1, 1, 3), (0, 6, 0)]), (1, None)],
    "behind_two_epochs": [(2, [(2, 1, 0), (0, 4, 0)]), (1, None)],
    # 12 units over 5 ranks: 3, 3, 2, 2, 2 units each
    "uneven_5_to_2": [(5, [(1, 0, 3), (0, 3, 0), (0, 2, 0), (1, 1, 0), (0, 1, 1)]), (2, None)],
    "uneven_2_to_5": [(2, [(0, 4, 1), (0, 1, 0)]), (5, None)],
    # two world-size changes within one epoch
    "2_to_1_to_2": [(2, [(0, 2, 0), (0, 1, 4)]), (1, [(0, 3, 2)]), (2, None)],
    "2_to_3_to_2": [(2, [(0, 1, 0), (0, 2, 1)]), (3, [(0, 1, 1), (0, 0, 0), (0, 1, 0)]), (2, None)],
    "2_to_1_to_2_unit_boundary": [(2, [(0, 3, 0), (0, 3, 0)]), (1, [(0, 4, 0)]), (2, None)],
    # after a re-partition, a rank behind in the re-partitioned epoch while another is in the next one
    "2_to_3_behind_to_2": [(2, [(0, 1, 0), (0, 2, 1)]), (3, [(1, 0, 2), (0, 2, 0), (0, 1, 1)]), (2, None)],
}


@pytest.mark.parametrize("case", REPARTITION_CASES)
def test_repartition_reads_every_unit_once_per_epoch(case, synthetic_dir, tiny_tokenizer):  # noqa: F811
    phases = REPARTITION_CASES[case]
    through = max(c[0] for _, cursors in phases if cursors for c in cursors)
    for extra in (0, 1):  # through the re-partitioned epoch, and one normal epoch after it
        reads = _run_phases(synthetic_dir, tiny_tokenizer, phases, through + extra)
        assert sorted(reads) == list(range(12))
        assert dict(reads) == {u: through + extra + 1 for u in range(12)}, "some unit read twice or never"


def test_repartition_after_real_reading_2_to_1_to_2(synthetic_dir, tiny_tokenizer):  # noqa: F811
    """Cursors from actually consuming batches (background reader), resumed 2 -> 1 -> 2 within epoch 0."""
    from collections import Counter

    reads = Counter()
    kw = dict(seed=7, tokenize_chunk=3)  # 3-document chunks: cursors can stop inside a row group
    old = [loader(synthetic_dir, tiny_tokenizer, rank=r, world_size=2, **kw) for r in range(2)]
    for dl in old:
        take(dl, 1)
        dl.close()
        reads.update(_started_units(dl, 0, dl.cursor))
    states = [dl.state_dict() for dl in old]
    one = loader(synthetic_dir, tiny_tokenizer, **kw)
    one.repartition(states)
    take(one, 2)
    one.close()
    assert one.cursor[0] == 0, "test needs the world-1 run to stop inside epoch 0"
    reads.update(_started_units(one, 0, one.cursor))
    two = [loader(synthetic_dir, tiny_tokenizer, rank=r, world_size=2, **kw) for r in range(2)]
    for dl in two:
        dl.repartition([one.state_dict()])
        reads.update(_started_units(dl, 0, (1, 0, 0)))
    assert dict(reads) == {u: 1 for u in range(12)}
    x, _ = next(two[1])  # the re-partitioned loaders stream normally
    assert (x[:, 0] == tiny_tokenizer.bos_token_id).all()
    for dl in two:
        dl.close()


def test_open_parquet_files_are_bounded(tmp_path):
    """The loader kept every shard it had read open: with more shards than the open-file limit (fineweb-edu has
    1822 train shards; `ulimit -n` is often 1024), reading failed mid-epoch with 'Too many open files'."""
    from nanochat.dataloader import MAX_OPEN_SHARDS, _RowGroupIndex
    from nanochat.dataset import write_text_shard

    files = []
    for i in range(MAX_OPEN_SHARDS + 5):
        files.append(tmp_path / f"s{i}.parquet")
        write_text_shard(files[-1], [f"file {i} doc {j}" for j in range(3)], row_group_size=2)
    index = _RowGroupIndex(files)
    order = np.random.default_rng(0).permutation(len(index.units))
    texts = {t for unit in order for t in index.read(int(unit))}
    assert texts == {f"file {i} doc {j}" for i in range(len(files)) for j in range(3)}
    assert len(index._open) == MAX_OPEN_SHARDS
    assert all(index.read(u) == index.read(u) for u in range(4))  # reopening a closed file reads the same rows


def test_a_signal_while_a_split_is_tokenized_stops_every_rank_after_that_round(eval_rows_launch):
    """base_eval builds a split's rows under interrupts_raise: SIGTERM on rank 1 while it tokenizes round 2 (of
    many: chunks of 4 documents here) ends the tokenization on both ranks right after that round's exchange, with
    the same Interrupted, not after the whole split. Without a signal every rank runs every round. One torchrun
    (eval_rows_launch's, shared with the eval-rows tests above)."""
    import json

    res = json.loads((eval_rows_launch / "stops.json").read_text())
    (rounds0, done0), (rounds1, done1) = res["0"]
    assert done0 == done1 == "finished" and rounds0 == rounds1 > 4, res
    assert res["2"] == [[2, "SIGTERM"], [2, "SIGTERM"]]


def _loader_rows(dl, steps):
    return torch.cat([torch.cat([x, y[:, -1:]], dim=1) for x, y in take(dl, steps)])


def _doc_ids(tok, rows):
    """(row group, row) of the documents (synthetic_dir's "docNNN": 8 per row group) whose start is in ``rows``."""
    ids = set()
    for row in rows.tolist():
        starts = [i for i, t in enumerate(row) if t == tok.bos_token_id] + [len(row)]
        texts = [tok.decode(row[a + 1:b]) for a, b in zip(starts, starts[1:])]
        ids |= {int(m) for text in texts for m in re.findall(r"^doc(\d{3})", text)}
    return {(i // 8, i % 8) for i in ids}


def _documents_read(dl):
    """(row group, row) of every document ``dl`` has taken into its packing buffer (all of epoch 0 here)."""
    epoch, upos, dpos = dl.cursor
    assert epoch == 0
    read = sum(dl.index.units[int(u)][2] for u in dl._rank_units(0)[:upos]) + dpos
    return set(dl.epoch_documents(0)[:read])


def test_train_bpb_rows_are_the_first_rows_the_run_trains_on(synthetic_dir, tiny_tokenizer):  # noqa: F811
    """The final train bpb is on data the run has trained on (the reference: "already-seen data"): on one process
    its rows are token for token the loader's first rows; on two, their documents are read in the first steps
    (packed alongside others, so a crop may cut another part of one of them)."""
    tok, n_rows = tiny_tokenizer, 6
    for seed in (0, 7):
        rows = build_eval_rows(synthetic_dir, "train", tok, SEQ, n_rows * SEQ, buffer_docs=16, chunk_docs=8,
                               first_read_seed=seed)
        dl = loader(synthetic_dir, tok, seed=seed)
        assert torch.equal(rows, _loader_rows(dl, 2)[:n_rows])  # 2 steps of 4 rows
        dl.close()
        ranks = [loader(synthetic_dir, tok, rank=r, world_size=2, seed=seed) for r in range(2)]
        for dl in ranks:
            take(dl, 2)
            dl.close()
        read = _documents_read(ranks[0]) | _documents_read(ranks[1])
        assert len(read) < 96 and len(_doc_ids(tok, rows)) >= 6 and _doc_ids(tok, rows) <= read, seed
        # the rows of the first documents in manifest order (what the train bpb read before): not all read yet
        manifest_rows = build_eval_rows(synthetic_dir, "train", tok, SEQ, n_rows * SEQ, buffer_docs=16, chunk_docs=8)
        assert not _doc_ids(tok, manifest_rows) <= read, seed
    assert not torch.equal(rows, build_eval_rows(synthetic_dir, "train", tok, SEQ, n_rows * SEQ, buffer_docs=16,
                                                 chunk_docs=8, first_read_seed=0))


def test_first_read_rows_stop_at_the_end_of_the_first_epoch(synthetic_dir, tiny_tokenizer):  # noqa: F811
    with pytest.raises(DataError, match="the train split of .* yields only"):
        build_eval_rows(synthetic_dir, "train", tiny_tokenizer, SEQ, 10**6, first_read_seed=3)
