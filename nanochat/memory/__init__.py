"""Registry of memory blocks: ``--memory NAME`` -> block class. Adding a design = one module + one line."""

from .base import MemoryBlock, default_memory_layers

MEMORY_BLOCKS: dict[str, type[MemoryBlock]] = {
    "base": MemoryBlock,
}


def build_memory(config) -> MemoryBlock:
    if config.memory not in MEMORY_BLOCKS:
        raise ValueError(f"--memory {config.memory!r} is unknown; allowed: {', '.join(MEMORY_BLOCKS)}")
    return MEMORY_BLOCKS[config.memory](config)


__all__ = ["MEMORY_BLOCKS", "MemoryBlock", "build_memory", "default_memory_layers"]
