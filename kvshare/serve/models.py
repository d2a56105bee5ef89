"""The names a replica serves its model under, as ``vllm serve`` does.

vLLM's rule: the served names are ``--served-model-name NAME [NAME ...]``, else the
``--model`` argument exactly as given (a path stays a path). The first name is the one
reported in responses and in metrics; a request may name any of them, or leave
``model`` out. ``/v1/models`` lists one card per name, in vLLM's ModelCard shape.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from kvshare.serve.api_types import ApiError

OWNED_BY = "kvshare"  # vLLM puts "vllm" here


@dataclass(frozen=True)
class ServedModels:
    names: tuple[str, ...]  # the first is reported in responses
    root: str  # the --model argument as given (vLLM's ModelCard.root)
    max_model_len: int
    created: int  # unix seconds the server started

    def __post_init__(self) -> None:
        if not self.names or any(not name for name in self.names):
            raise ValueError("give at least one non-empty served model name")

    @property
    def name(self) -> str:
        return self.names[0]

    def resolve(self, requested: str | None) -> str:
        """The name to report for a request that named ``requested``; 404 when it is not served."""
        if requested and requested not in self.names:
            raise ApiError(
                404,
                f"The model `{requested}` does not exist. Valid aliases: {', '.join(self.names)}.",
                param="model",
                code="model_not_found",
            )
        return self.name

    def listing(self) -> dict:
        """The body of GET /v1/models."""
        return {"object": "list", "data": [self._card(name) for name in self.names]}

    def card(self, name: str) -> dict:
        """The body of GET /v1/models/{name} (OpenAI's retrieve); 404 for a name not served."""
        if name not in self.names:
            raise ApiError(
                404,
                f"The model `{name}` does not exist. Valid aliases: {', '.join(self.names)}.",
                param="model",
                code="model_not_found",
            )
        return self._card(name)

    def _card(self, name: str) -> dict:
        permission = {
            "id": f"modelperm-{uuid.uuid5(uuid.NAMESPACE_URL, name).hex}",
            "object": "model_permission",
            "created": self.created,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": OWNED_BY,
            "root": self.root,
            "parent": None,
            "max_model_len": self.max_model_len,
            "permission": [permission],
        }
