"""Decode steps as CUDA graphs (kvshare.engine.decode_graph).

On CPU: the pieces a graph captures, run eagerly, compute exactly what ``Transformer.forward`` computes for
one token (logits and the K/V written, bit for bit), at several positions, float32 and a float8 cache. On
CUDA (``-m gpu``): replayed graphs against the eager step, and an engine's streams with graphs against
``--enforce-eager``.
"""

from __future__ import annotations

import pytest
import torch

from kvshare.engine.config import EngineConfig
from kvshare.engine.decode_graph import DecodeGraphs
from kvshare.engine.engine import Engine, SamplingParams
from tests.engine.conftest import ascii_prompt

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _prefilled(engine: Engine, num_tokens: int, kv_dtype=None):
    ids = torch.tensor(engine.tokenizer.encode(ascii_prompt(num_tokens, seed=num_tokens)), device=engine.device)
    mc = engine.model_config
    kv = torch.zeros(
        mc.num_layers,
        2,
        mc.num_kv_heads,
        96,
        mc.head_dim,
        device=engine.device,
        dtype=kv_dtype or engine.model.model.embed_tokens.weight.dtype,
    )
    with torch.inference_mode():
        engine.model(ids, kv, 0)
    return ids, kv


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn])
def test_the_pieces_compute_what_the_forward_computes(kv_dtype):
    engine = Engine(EngineConfig(model="tiny"))
    ids, kv = _prefilled(engine, 40, kv_dtype)
    eager_kv = kv.clone()
    pieces = DecodeGraphs(engine.model, kv)
    with torch.inference_mode():
        for position, token in [(40, 7), (41, 200), (42, 3), (0, 65)]:  # position 0: the causal branch of attend
            expected = engine.model(torch.tensor([token]), eager_kv, position)
            got = pieces.run_eager(token, position)
            assert torch.equal(got, expected), position
            assert torch.equal(kv[:, :, :, : position + 1], eager_kv[:, :, :, : position + 1]), position
    assert not torch.equal(kv[:, :, :, 40:43], torch.zeros_like(kv[:, :, :, 40:43]))  # the steps wrote their K/V


def test_a_step_beyond_the_kv_is_refused():
    engine = Engine(EngineConfig(model="tiny"))
    _, kv = _prefilled(engine, 10)
    with pytest.raises(ValueError, match="exceeds the KV capacity"):
        DecodeGraphs(engine.model, kv).run_eager(1, 96)


def test_enforce_eager_reaches_the_engine_config():
    from kvshare.cli import build_parser
    from kvshare.commands import serve as serve_command

    args = build_parser().parse_args(["serve", "--model", "tiny"])
    assert serve_command.engine_config(args).enforce_eager is False
    args = build_parser().parse_args(["serve", "--model", "tiny", "--enforce-eager"])
    assert serve_command.engine_config(args).enforce_eager is True


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_replayed_graphs_equal_the_eager_step(dtype):
    engine = Engine(EngineConfig(model="tiny", device="cuda", dtype=dtype, enforce_eager=True))
    _, kv = _prefilled(engine, 40)
    eager_kv = kv.clone()
    graphs = DecodeGraphs(engine.model, kv)
    with torch.inference_mode():
        graphs.capture()
        assert torch.equal(kv[:, :, :, :40], eager_kv[:, :, :, :40])  # the capture's warm-up left the prompt alone
        for position, token in [(40, 7), (41, 200), (42, 3), (43, 99)]:
            expected = engine.model(torch.tensor([token], device="cuda"), eager_kv, position)
            got = graphs.run(token, position)
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 if dtype == "float32" else 2e-2)
            assert torch.argmax(got) == torch.argmax(expected)
            torch.testing.assert_close(kv[:, :, :, position], eager_kv[:, :, :, position], rtol=0, atol=1e-2)


@pytest.mark.gpu
@CUDA
def test_an_engine_with_graphs_streams_what_an_eager_one_streams():
    graphs = Engine(EngineConfig(model="tiny", device="cuda", max_model_len=512))
    eager = Engine(EngineConfig(model="tiny", device="cuda", max_model_len=512, enforce_eager=True))
    assert graphs._graphs is not None and graphs._graphs.is_captured  # captured at start-up
    assert eager._graphs is None
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for n in (33, 100, 300):
        ids = graphs.tokenizer.encode(ascii_prompt(n, seed=n))
        assert [e.token_id for e in graphs.generate(ids, params)] == [e.token_id for e in eager.generate(ids, params)]
