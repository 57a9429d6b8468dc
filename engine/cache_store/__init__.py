"""Agents' KV caches in the block pool: filing, matching, pinning, eviction."""
