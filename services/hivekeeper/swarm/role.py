"""A Swarm role's context: the shared role layer with the Swarm's metrics, and reports that
outlive an averaging round (a trainer's step blocks for one)."""

from __future__ import annotations

import argparse

from hivekeeper.metrics import SwarmMetrics
from hivekeeper.runtime.context import RoleContext
from hivekeeper.runtime.lifecycle import load_context
from hivekeeper.runtime.reports import REPORT_EXPIRATION
from hivekeeper.spec.swarm import SwarmSpec

SwarmContext = RoleContext[SwarmSpec]


def load_swarm_context(role: str, args: argparse.Namespace) -> SwarmContext:
    ctx = load_context(role, args, SwarmSpec, SwarmMetrics())
    averaging = ctx.spec.averaging
    ctx.report_ttl = REPORT_EXPIRATION + averaging.matchmaking_seconds + averaging.timeout_seconds
    return ctx
