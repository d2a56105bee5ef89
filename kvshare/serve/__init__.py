"""One replica: an OpenAI-compatible HTTP server in front of one engine."""
