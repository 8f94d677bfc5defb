"""KV cache events (placeholder until the publisher lands): the three event kinds."""

from __future__ import annotations

import msgspec


class BlockStored(msgspec.Struct, tag="BlockStored", tag_field="type", omit_defaults=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", omit_defaults=True):
    block_hashes: list[int]


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type"):
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared
