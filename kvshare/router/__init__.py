"""The router: a streaming reverse proxy in front of N replicas, with placement policies."""
