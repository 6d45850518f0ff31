"""scripts.results' Wall (min) cell names the GPU counts of every session of a seed: a seed resumed with
--resume-new-world-size ran part of its wall time on the first count (config.json "world_size_changes", which
base_train keeps as its checkpoints do), while summary.json's world_size is the last session's only."""

from test_results33 import DONE, table, write_seed


def _seed(runs, row, name, wall_s, world, changes=()):
    config = {"world_size": world, "world_size_changes": list(changes)}
    write_seed(runs, "d12_scaling", row, name, {**DONE, "val_bpb": 0.86, "wall_time_s": wall_s, "world_size": world},
               config)


def test_wall_note_names_every_sessions_gpu_count(tmp_path):
    runs = tmp_path / "runs"
    # two sessions: 8 GPUs to step 100, then 4 (the paper's count) to the end
    _seed(runs, "bigram_b03", "seed42", 6000.0, 4, [{"step": 100, "checkpoint": 8, "now": 4}])
    # a seed on 8 GPUs throughout, and one resumed twice (4 -> 8 -> 4) beside it
    _seed(runs, "bigram_b06", "seed42", 3000.0, 8)
    _seed(runs, "bigram_b06", "seed43", 3000.0, 4, [{"step": 50, "checkpoint": 4, "now": 8},
                                                    {"step": 90, "checkpoint": 8, "now": 4}])
    # the paper's count in every session: no note
    _seed(runs, "bigram_b09", "seed42", 1200.0, 4, [{"step": 10, "checkpoint": 4, "now": 4}])
    md, cells = table(tmp_path, runs, "d12_scaling")
    assert cells("Bigram 3V")["Wall (min)"] == "100.00 (8+4 GPUs; paper 4)", md
    assert cells("Bigram 6V")["Wall (min)"] == "50.00 (4+8+4, 8 GPUs; paper 4)", md
    assert cells("Bigram 9V")["Wall (min)"] == "20.00", md
