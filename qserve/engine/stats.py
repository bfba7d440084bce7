"""What the engine reports about itself: one typed snapshot, read by the server's metrics and
logs and by the benchmarks (nothing outside the engine reaches into its scheduler)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks held by requests
    kv_live_slots: int = 0  # token slots holding computed tokens
    kv_allocated_slots: int = 0  # token slots of the blocks the running requests hold
    num_free_blocks: int = 0
    num_blocks: int = 0
    prefix_cache_hit_rate: float = 0.0
    num_preemptions: int = 0
