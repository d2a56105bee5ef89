"""kvshare: a shared host-memory KV cache for LLM inference replicas.

Kept light on purpose: importing kvshare imports no torch, vLLM or network
client; each subpackage imports what it needs where it is used.
"""

__version__ = "0.1.0"
