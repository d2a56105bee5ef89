"""The router: a streaming reverse proxy in front of N replicas, with placement policies.

Placement (``policy``, ``pool_aware``, ``cost_model``, ``placement``, ``dispatch``), its inputs (``facts``,
``prompt_ids``, ``kv_event_feed``, ``prefix_index``, ``chunk_chain``, ``calibration``, ``response_timing``,
``backlog``, ``sent_memory``) and the HTTP side (``server`` towards the clients, ``relay`` towards the replicas),
with the prefetch hints to vLLM replicas beside it (``prefetch_hints``, ``hints``, ``hint_sender``).
"""
