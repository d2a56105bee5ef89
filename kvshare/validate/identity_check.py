"""The helpers level's model-identity check: the namespace names the weights' bytes, never a directory.

Two checkpoints, both in directories called ``model``, with the same config.json and the same
safetensors header but one changed weight must get two namespaces; a copy of one of them under
another name must get its namespace. A control row shows the pair is the hard case: their
config and headers, all that a header-only identity would hash, are equal. The fingerprints go
through kvshare.identity, the function both engines call, cache included (its entries for these
temporary files are removed afterwards).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile

from kvshare.identity import (
    cached_digest,
    file_digest,
    forget_cached_digest,
    model_fingerprint,
    read_safetensors_header,
)
from kvshare.keys import Namespace, namespace_digest
from kvshare.validate.report import CAUGHT, FAIL, PASS, Row

NUM_WEIGHT_BYTES = 1 << 20
CONFIG = b'{"model_type": "llama", "num_hidden_layers": 2}'


def _write_checkpoint(directory: str, weights: bytes) -> str:
    os.makedirs(directory)
    header = json.dumps({"w": {"dtype": "F32", "shape": [len(weights) // 4], "data_offsets": [0, len(weights)]}})
    with open(os.path.join(directory, "config.json"), "wb") as f:
        f.write(CONFIG)
    with open(os.path.join(directory, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header.encode() + weights)
    return directory


def _namespace(fingerprint: str) -> bytes:
    return namespace_digest(Namespace("", fingerprint, "bfloat16", 2, 2, 64))


def identity_rows() -> list[Row]:
    """Rows of the model-identity check (pass, fail, or caught for the control)."""
    with tempfile.TemporaryDirectory(prefix="kvshare-validate-identity-") as work:
        weights = bytearray(os.urandom(NUM_WEIGHT_BYTES))
        a = _write_checkpoint(os.path.join(work, "one", "model"), bytes(weights))
        weights[NUM_WEIGHT_BYTES // 2] ^= 1  # one bit of one weight
        b = _write_checkpoint(os.path.join(work, "two", "model"), bytes(weights))
        copy = shutil.copytree(a, os.path.join(work, "renamed-copy"))
        files = [os.path.join(d, "model.safetensors") for d in (a, b, copy)]
        try:
            fa, fb, fcopy = (model_fingerprint(d) for d in (a, b, copy))
            is_cached = cached_digest(files[0]) == file_digest(files[0])
        finally:
            for path in files:
                forget_cached_digest(path)
        same_headers = read_safetensors_header(files[0]) == read_safetensors_header(files[1])
    return [
        Row(
            "identity: one changed weight, equal config and headers -> another namespace",
            PASS if _namespace(fa) != _namespace(fb) else FAIL,
            "" if fa != fb else f"both {fa}",
        ),
        Row(
            "identity: a copy under another name -> the same namespace",
            PASS if _namespace(fa) == _namespace(fcopy) else FAIL,
            "" if fa == fcopy else f"{fa} != {fcopy}",
        ),
        Row(
            "identity: a file's digest is cached by its stat (a restart reads no weights)",
            PASS if is_cached else FAIL,
            "" if is_cached else "no cache entry after the first hash",
        ),
        Row(
            "identity control: a header-only identity would share the pair",
            CAUGHT if same_headers else FAIL,
            "config.json and safetensors headers equal, only the bytes differ",
        ),
    ]
