"""The layer pattern of the tests' tiny Qwen3.5-family hybrids, the engine's oracle model and the vLLM suite's:
8 layers, 2 x (3 Gated DeltaNet + 1 gated attention), attention of 4 query / 2 KV heads, GDN of 2 key / 4 value
heads with a causal conv of 4. Each model adds the widths it needs (the vLLM one the head dims vLLM CPU's kernels
know); keys as transformers' Qwen3.5 and Qwen3-Next configs name them.
"""

TINY_HYBRID_LAYERS = dict(
    num_hidden_layers=8,
    full_attention_interval=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_conv_kernel_dim=4,
)
