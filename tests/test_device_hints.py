"""Every parser's --device / --device-type error lists the values that parser takes, and no others (session 21):
cli_types.device_name offered "cuda:N" and "mps" to benches that take cuda or cpu alone, and device_type_name (no
index) said "allowed: cuda, cuda:N, cpu, mps" for a value that was no device."""

import importlib

import pytest
import torch

from conftest import load_bench
from nanochat import cli_types

FULL = ("cuda", "cuda:N", "cpu", "mps")
PARSERS = {  # name -> (parse(argv), flags that get it past its required ones, its flag, the forms it takes)
    "scripts.sample": ("scripts.sample:parse_args", ["--run", "r", "--prompt", "hi"], "--device-type", FULL),
    "scripts.wic_probe": ("scripts.wic_probe:parse_args", ["--run", "r", "--wic", "w.tsv"], "--device", FULL),
    "scripts.analyze_memory": ("scripts.analyze_memory:parse_args", ["--run", "r"], "--device", FULL),
    "scripts.analyze_routing": ("scripts.analyze_routing:parse_args", ["--run", "r", "--corpus", "val"], "--device",
                                FULL),
    "scripts.base_eval": ("scripts.base_eval:parse_args", ["--run", "r"], "--device-type", ("cuda", "cpu", "mps")),
    "scripts.base_train": ("nanochat.train_args:parse_args", ["--depth", "2"], "--device-type",
                           ("auto", "cuda", "cpu", "mps")),
    "bench/step": ("bench:step:parse_args", [], "--device", ("cpu", "cuda")),
    "bench/train_step": ("bench:train_step:parse_args", [], "--device", ("cuda", "cpu")),
    "bench/dist_optim": ("bench:dist_optim:main", [], "--device", ("cpu", "cuda")),
    "bench/decode": ("bench:decode:parse", [], "--device", FULL),
    "bench/mome_ops": ("bench:mome_ops:parse_args", [], "--device", FULL),
    "bench/latency": ("bench:latency:parse_args", [], "--device", ("cuda", "cuda:N", "cpu")),
    "bench/moe": ("bench:moe:main", [], "--device", ("cpu", "cuda")),  # refused at parsing: main runs no step
}


def parser_of(name: str):
    where, required, flag, forms = PARSERS[name]
    parts = where.split(":")
    module = load_bench(parts[1]) if parts[0] == "bench" else importlib.import_module(parts[0])
    return getattr(module, parts[-1]), required, flag, forms


def error_of(name: str, value: str, capsys) -> str:
    parse, required, flag, _ = parser_of(name)
    with pytest.raises(SystemExit) as e:
        parse([*required, flag, value])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    return err.strip().splitlines()[-1]


@pytest.fixture
def gpus(monkeypatch):
    """A machine with ``n`` CUDA devices and no MPS, as torch reports it."""
    def have(n: int):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    return have


@pytest.mark.parametrize("name", sorted(set(PARSERS) - {"scripts.base_train"}))  # base_train: argparse choices
def test_a_value_that_is_no_device_lists_the_forms_the_parser_takes(name, gpus, capsys):
    gpus(0)
    _, _, flag, forms = parser_of(name)
    assert error_of(name, "tpu", capsys).endswith(f"argument {flag}: 'tpu' is not a device; allowed: "
                                                 f"{', '.join(forms)}")


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_a_missing_gpu_lists_what_this_machine_has_of_those_forms(name, gpus, capsys):
    gpus(0)
    _, _, flag, forms = parser_of(name)
    here = ", ".join(f for f in forms if f in ("auto", "cpu"))
    assert error_of(name, "cuda", capsys).endswith(
        f"argument {flag}: cuda: no such device here (torch sees 0 CUDA device(s)); allowed here: {here}")


@pytest.mark.parametrize("name", sorted(name for name, (*_, forms) in PARSERS.items() if "cuda:N" in forms))
def test_an_index_past_the_gpus_names_the_indices_there_are(name, gpus, capsys):
    gpus(2)
    _, _, flag, _ = parser_of(name)
    assert error_of(name, "cuda:5", capsys).endswith(
        f"argument {flag}: cuda:5: no such device here (torch sees 2 CUDA device(s)); allowed here: cuda, "
        "cuda:N with N < 2, cpu")
    parse, required, _, _ = parser_of(name)
    assert getattr(parse([*required, flag, "cuda:1"]), flag[2:].replace("-", "_")) == "cuda:1"


@pytest.mark.parametrize("name", sorted(name for name, (*_, forms) in PARSERS.items()
                                        if "cuda:N" not in forms and name != "scripts.base_train"))
@pytest.mark.parametrize("value", ["cuda:1", "mps"])
def test_a_device_the_parser_does_not_take_is_refused_with_its_forms(name, value, gpus, capsys):
    """Even where the machine has it: the bench would have refused it later (argparse choices, compute_init)."""
    gpus(2)
    _, _, flag, forms = parser_of(name)
    if value == "mps" and "mps" in forms:
        return
    why = ("no GPU index (each rank uses cuda:LOCAL_RANK; choose the GPUs with CUDA_VISIBLE_DEVICES)"
           if value == "cuda:1" and name in ("scripts.base_eval", "bench/dist_optim")
           else "not a device this flag takes")
    assert error_of(name, value, capsys).endswith(f"argument {flag}: {value!r}: {why}; allowed: {', '.join(forms)}")



@pytest.mark.parametrize("name", sorted(name for name, (*_, forms) in PARSERS.items() if "cuda:N" in forms))
@pytest.mark.parametrize("value", ["cuda:N", "cuda:", "cuda:x", "cuda:-1"])
def test_an_index_that_is_no_number_says_what_n_stands_for(name, value, gpus, capsys):
    """The help shows the form cuda:N: typed as it stands (or with another non-number) it was argparse's bare
    "invalid parse value" (int("N") raised), or "not a device this flag takes" for a form the flag takes."""
    gpus(2)
    _, _, flag, forms = parser_of(name)
    assert error_of(name, value, capsys).endswith(
        f"argument {flag}: {value!r}: the N of cuda:N is a GPU index (cuda:0, cuda:1, ...); allowed: "
        f"{', '.join(forms)}")


def test_a_missing_gpu_asks_torch_for_the_count_once(monkeypatch):
    """The count is read once and named as read: two reads could name another count than the one refused."""
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: asked.append(1) or 2)
    assert cli_types._missing_device("cuda", 5) == "torch sees 2 CUDA device(s)"
    assert len(asked) == 1
    assert cli_types._missing_device("cuda", 1) is None and len(asked) == 2
