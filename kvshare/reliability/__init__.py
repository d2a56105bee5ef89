"""Reliability: the bounded load tool (kvshare load) that checks responses against a pool-off reference."""
