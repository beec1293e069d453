"""Rollout engines behind one contract: `protocol.py` (RolloutEngine, EngineStats), `registry.py` (engines by
name: build_engine, register_engine), `types.py` (requests and generations), `weight_sync.py` (actor shards to
engine weights); `native/` (the embedded engine) and `sglang/` (the in-process SGLang adapter). Engines are built
from their own options and import nothing of the trainer, the actor or the run's configuration."""
