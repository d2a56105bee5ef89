"""A resumed hybrid prefill's tail in fixed rows (kvshare.engine.hybrid_tail_graph), run on CPU without graphs.

The pieces over padded rows compute, for the valid rows, what the model's forward computes (K/V and the GDN state;
the padding leaves the state as the valid rows left it); an engine whose prefills run their tails and last tokens
that way streams what recomputing streams, from the local cache and from the pool, with the same checkpoints. On
CUDA (``-m gpu``, tests/engine/test_hybrid_gpu.py) the replayed graphs, through the engine.
"""

from __future__ import annotations

import pytest
import torch

from kvshare.engine.config import EngineConfig
from kvshare.engine.engine import Engine, RequestOptions, SamplingParams
from kvshare.engine.hybrid_tail_graph import MIN_ROWS, TailGraphSet
from kvshare.engine.presets import build_preset
from kvshare.pool.spawn import running_pool

CHUNK = 64
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)
COLD = RequestOptions(use_pool=False, use_local_cache=False)


@pytest.fixture(scope="module")
def tiny():
    model, config, _ = build_preset("qwen3.5-tiny", torch.device("cpu"))
    return model, config


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _kv(config, capacity: int = 160) -> torch.Tensor:
    return torch.zeros(config.num_kv_layers, 2, config.num_kv_heads, capacity, config.head_dim)


@pytest.mark.parametrize("num_tail", [1, 13, 16, 40])
def test_the_padded_pieces_compute_what_the_forward_cut_at_the_last_token_computes(tiny, num_tail):
    model, config = tiny
    ids = torch.tensor(_ids(60 + num_tail, num_tail))
    end = 60 + num_tail
    kv = _kv(config)
    with torch.inference_mode():
        model(ids[:60], kv, 0)
        at_60, eager_kv = model.state.snapshot(), kv.clone()
        before_last = model.state.empty_checkpoint(end - 1)
        checkpoints = {end - 1: before_last} if num_tail > 1 else {}
        expected = model(ids[60:], eager_kv, 60, checkpoints=checkpoints)
        if num_tail == 1:
            before_last = at_60
        eager = model.state.snapshot()
        model.state.restore(at_60)
        tails = TailGraphSet(model, kv, max_rows=64, eager=True)
        assert list(tails.tails) == [16, 32, 64] and tails.holds(num_tail, 60)
        got = tails.run(ids[60:], 60)
    assert model.state.position == end
    # float32 within rounding: a projection over 64 rows may sum in another order than over 40 (a few 1e-6
    # relative); a padding row that wrote into the state, or a state off by a token, moves it by whole percents
    close = dict(rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got, expected, **close)
    as_floats = lambda data: data.view(torch.float32)  # noqa: E731 (the tiny model's state is float32 throughout)
    torch.testing.assert_close(as_floats(model.state.buffer), as_floats(eager.data), **close)
    torch.testing.assert_close(as_floats(tails.before_last), as_floats(before_last.data), **close)
    torch.testing.assert_close(kv[:, :, :, :end], eager_kv[:, :, :, :end], **close)


def test_a_tail_must_start_where_the_state_ends_and_fit_its_rows(tiny):
    model, config = tiny
    kv = _kv(config, capacity=100)
    tails = TailGraphSet(model, kv, eager=True)
    assert list(tails.tails) == [16, 32, 64]  # capped by the KV's capacity
    assert not tails.holds(65, 0) and not tails.holds(20, 70)  # too long; rows past the KV
    assert not TailGraphSet(model, kv).holds(20, 0)  # graphs not captured: the eager forward runs
    with torch.inference_mode():
        model(torch.zeros(10, dtype=torch.int64), kv, 0)
        with pytest.raises(ValueError, match="holds the first 10 tokens"):
            tails.run(torch.zeros(5, dtype=torch.int64), 12)


class _Counted(TailGraphSet):
    runs: list[tuple[int, int]] = []  # (start, tokens) of every tail run

    def run(self, tokens, start, before_layer=None):
        _Counted.runs.append((start, tokens.shape[0]))
        return super().run(tokens, start, before_layer)


def _through_tails(engine: Engine) -> Engine:
    """The engine's prefills through the tail pieces, as a CUDA engine's run through graphs."""
    _Counted.runs = []
    kv = engine._kv.ensure(engine.max_model_len)
    engine._tails = _Counted(engine.model, kv, eager=True)
    engine.hybrid.tails = engine._tail_graphs
    return engine


def _run(engine: Engine, ids: list[int], options: RequestOptions = RequestOptions()):
    events = list(engine.generate(ids, PARAMS, options))
    return [e.token_id for e in events], events[0].provenance


def test_local_reuse_through_the_tail_pieces_equals_recomputing():
    config = EngineConfig(model="qwen3.5-tiny", chunk_tokens=CHUNK, state_checkpoint_chunks=2, max_model_len=2048)
    engine, plain = _through_tails(Engine(config)), Engine(config)
    prompt = _ids(300, 1)
    first, _ = _run(engine, prompt)  # cold, in tail runs that end at its checkpoints: 128, 256, and its end
    assert _Counted.runs == [(0, 128), (128, 128), (256, 44)]
    again, provenance = _run(engine, prompt)  # from the prompt-end state the last run left (before its last token)
    assert provenance.computed_tokens == 1 and _Counted.runs[3:] == [(299, 1)] and again == first
    branch = prompt[:250] + _ids(40, 2)  # resumes at the checkpoint at 128: runs to 256 and to its end
    got, provenance = _run(engine, branch)
    assert provenance.local_tokens == 128 and _Counted.runs[4:] == [(128, 128), (256, 34)]
    turn = branch + got[:-1] + [1, 2, 3]  # the live state after the answer: three tokens
    got_turn, provenance = _run(engine, turn)
    assert provenance.computed_tokens == 3 and _Counted.runs[6:] == [(295, 3)]
    # the checkpoint the branch's tail took at 256 serves a third prompt
    third = branch[:280] + _ids(30, 3)
    got_third, provenance = _run(engine, third)
    assert provenance.local_tokens == 256
    for ids, tokens in ((prompt, first), (branch, got), (turn, got_turn), (third, got_third)):
        assert tokens == _run(plain, ids, COLD)[0]
    engine.close()
    plain.close()


def test_a_pool_resume_through_the_tail_pieces_equals_recomputing():
    fields = dict(model="qwen3.5-tiny", chunk_tokens=CHUNK, state_checkpoint_chunks=2, max_model_len=2048)
    with running_pool("64MiB", ("--extent-size", "4MiB")) as path:
        config = EngineConfig(pool_socket=path, verify_checksums=True, **fields)
        writer, reader = Engine(config), _through_tails(Engine(config))
        no_local = RequestOptions(use_local_cache=False)
        for n in (5 * CHUNK + 30, 3 * CHUNK, 2 * CHUNK + MIN_ROWS + 1):
            prompt = _ids(n, n)
            written, _ = _run(writer, prompt, no_local)
            runs = len(_Counted.runs)
            got, provenance = _run(reader, prompt, no_local)
            assert provenance.pool_tokens > 0 and len(_Counted.runs) == runs + 1, n
            assert got == written == _run(writer, prompt, COLD)[0], n
        writer.close()
        reader.close()
