"""analyze_routing's semantic routes list each (layer, head)'s slots by weight descending, then slot index
ascending: with tied weights (fixed-random routing gives every slot 1/K) the order, and so the figure's
"top-weight slot", is the same on CPU and CUDA and in every run, whatever order the router emitted the slots in."""

import types

import torch

import scripts.analyze_routing as ar


def test_tied_weights_order_slots_by_index(monkeypatch):
    # captured (batch, T, layer, head, K): two hits, two memory layers, one head, K = 3
    slots = torch.zeros(2, 4, 2, 1, 3, dtype=torch.int32)
    weights = torch.zeros(2, 4, 2, 1, 3)
    slots[0, 2] = torch.tensor([[[7, 3, 5]], [[40, 12, 12 + 1]]], dtype=torch.int32)
    weights[0, 2] = torch.tensor([[[1 / 3] * 3], [[0.25, 0.5, 0.25]]])
    slots[1, 3] = torch.tensor([[[9, 8, 2]], [[6, 4, 1]]], dtype=torch.int32)
    weights[1, 3] = torch.tensor([[[0.5, 0.25, 0.25]], [[0.2, 0.3, 0.5]]])
    monkeypatch.setattr(ar, "memory_block", lambda model, need_routing: types.SimpleNamespace(layers=(1, 3)))
    monkeypatch.setattr(ar, "run_captured", lambda model, ids: {"slots": slots, "weights": weights})
    hits = [("bank", "river", "the bank", [5, 6], 2), ("bank", "money", "a bank loan", [5, 6, 7], 3)]
    routes = ar.semantic_routes(None, types.SimpleNamespace(bos_token_id=0), hits)
    assert [r["slots"] for r in routes] == [[[[3, 5, 7]], [[12, 13, 40]]], [[[9, 2, 8]], [[1, 4, 6]]]]
    third = 1 / 3  # float32's, as captured
    assert routes[0]["weights"] == [[[torch.tensor(third).item()] * 3], [[0.5, 0.25, 0.25]]]
    assert routes[1]["weights"][1] == [[0.5, torch.tensor(0.3).item(), torch.tensor(0.2).item()]]
