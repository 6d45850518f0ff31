"""Session 34's faithfulness review of the row configs: configs/ is exactly what dev/make_configs.py generates, and
the rows record where the paper and the reference runs disagree about them."""

import importlib.util

from conftest import REPO
from nanochat.row_config import find_configs


def _make_configs():
    spec = importlib.util.spec_from_file_location("make_configs", REPO / "dev" / "make_configs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # builds ROWS; writes nothing (main() does)
    return module


def test_configs_are_exactly_what_the_generator_writes():
    """A hand edit of a configs/*.toml (or a generator change left unregenerated) would make a row's file say one
    recipe and dev/make_configs.py, which the file's header names as its source, another."""
    generated = _make_configs().rendered()
    on_disk = {path.relative_to(REPO / "configs").as_posix(): path.read_text(encoding="utf-8")
               for path in (REPO / "configs").rglob("*.toml")}
    assert sorted(on_disk) == sorted(generated), "configs/ has files the generator does not write (or lacks some)"
    stale = [name for name, text in generated.items() if on_disk[name] != text]
    assert not stale, f"differ from dev/make_configs.py (run python dev/make_configs.py): {stale}"
    assert len(find_configs()) == len(generated) == 85
