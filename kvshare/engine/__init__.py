"""The built-in inference engine: a plain-torch decoder with local and pooled prefix reuse.

Entry point: kvshare.engine.engine.Engine (imports torch; this package file does not).
"""
