"""Integrations of kvshare into other inference engines (vLLM: ``kvshare.integrations.vllm``).

Each integration imports its engine only inside its own module, so importing this
package stays light.
"""
