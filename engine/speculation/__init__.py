"""Speculative decoding: who drafts, from what, and the drafts' counts."""
