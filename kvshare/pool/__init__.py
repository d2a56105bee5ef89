"""The shared KV pool: arena, allocator, index, daemon, client."""
