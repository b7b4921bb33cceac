"""A BlockServer role's context: the shared role layer with the BlockServer's metrics."""

from __future__ import annotations

import argparse

from hivekeeper.blocks.metrics import BlockMetrics
from hivekeeper.runtime.context import RoleContext
from hivekeeper.runtime.lifecycle import load_context
from hivekeeper.spec.blockserver import BlockServerSpec

BlockContext = RoleContext[BlockServerSpec]


def load_block_context(role: str, args: argparse.Namespace) -> BlockContext:
    return load_context(role, args, BlockServerSpec, BlockMetrics())
