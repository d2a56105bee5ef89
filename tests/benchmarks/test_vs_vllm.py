"""benchmarks/vs_vllm.py: its rows carry the headline's schema, the table and README show them, and ``--client
text`` is refused (before anything starts) until kvshare's bench client sends text (pure, no servers)."""

from __future__ import annotations

import dataclasses
import json
import signal
import sys

import pytest

from tests.benchmarks.loader import load_benchmark

COMMON = {
    "model": "qwen3-8b",
    "bound_kind": "pinned-h2d",
    "vllm_version": "0.26.0",
    "commit": "abc1234",
    "command": "benchmarks/vs_vllm.py --lengths 32768",
    "hardware": "NVIDIA H200",
}
KV_BYTES_PER_TOKEN = 147456  # the 8B shape: 36 layers x 2 x 8 heads x 128 x 2 bytes
RATE = 55e9


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("vs_vllm")


def kvshare_figures(client="token_ids", **kw):
    return {
        "prompt_tokens": 32768,
        "prompt_index": 0,
        "client": client,
        "first_request": True,
        "cold_s": 1.5,
        "cross_s": 0.1,
        "local_s": 0.05,
        "pool_tokens": 32768,
        "tokens_equal": True,
        **kw,
    }


def test_a_row_holds_every_field_of_the_schema_and_the_ratios(bench):
    vllm = {"cold_s": 1.25, "local_s": 0.052, "cpu_tier_s": 0.173, "cached_tokens": 32768}
    row = bench.make_row(COMMON, kvshare_figures(), vllm, RATE, KV_BYTES_PER_TOKEN)
    assert set(bench.ROW_FIELDS) <= set(row)
    for name in (
        "model",
        "prompt_tokens",
        "client",
        "cold_s",
        "vllm_cold_s",
        "cold_over_vllm",
        "cross_s",
        "bound_s",
        "cross_over_bound",
        "first_request",
        "text_overhead",
        "commit",
        "command",
        "hardware",
    ):
        assert name in bench.ROW_FIELDS  # the fields the headline's JSON rows must carry
    assert row["cold_over_vllm"] == pytest.approx(1.5 / 1.25)
    assert row["bound_s"] == pytest.approx(32768 * KV_BYTES_PER_TOKEN / RATE)
    assert row["cross_over_bound"] == pytest.approx(0.1 / row["bound_s"])
    assert row["cross_over_vllm_cpu_tier"] == pytest.approx(0.1 / 0.173)
    assert row["text_overhead"] is None and row["client"] == "token_ids"
    json.dumps(row)  # rows.json holds plain JSON


def test_a_text_row_says_what_text_adds_to_the_same_request_sent_as_token_ids(bench):
    """Fails when text_overhead is the ratio of the two TTFTs instead of the fraction that text adds."""
    row = bench.make_row(
        COMMON, kvshare_figures("text", cross_s=0.105, token_ids_cross_s=0.1), None, RATE, KV_BYTES_PER_TOKEN
    )
    assert row["text_overhead"] == pytest.approx(0.05)
    assert row["vllm_cold_s"] is None and row["cold_over_vllm"] is None  # vLLM not measured: no ratio invented


def test_no_bound_without_loaded_tokens(bench):
    row = bench.make_row(COMMON, kvshare_figures(pool_tokens=0), None, RATE, KV_BYTES_PER_TOKEN)
    assert row["bound_s"] is None and row["cross_over_bound"] is None


def test_a_row_without_the_common_fields_is_refused(bench):
    with pytest.raises(ValueError, match="hardware"):
        bench.make_row({k: v for k, v in COMMON.items() if k != "hardware"}, kvshare_figures(), None, RATE, 1)


def test_the_table_and_readme_show_both_engines_side_by_side(bench):
    rows = [
        bench.make_row(
            COMMON,
            kvshare_figures(),
            {"cold_s": 1.25, "local_s": 0.052, "cpu_tier_s": 0.173, "cached_tokens": 32768},
            RATE,
            KV_BYTES_PER_TOKEN,
        ),
        bench.make_row(
            COMMON,
            kvshare_figures("text", first_request=False, cross_s=0.11, token_ids_cross_s=0.1),
            None,
            RATE,
            KV_BYTES_PER_TOKEN,
        ),
    ]
    text = bench.table(rows)
    lines = text.splitlines()
    assert len(lines) == 2 + len(rows) and all(line.count("|") == lines[0].count("|") for line in lines)
    assert "| qwen3-8b | 32768 | token_ids | first | 1.500 | 1.250 | 1.20 | 0.050 | 0.052 | 0.100 |" in lines[2]
    assert lines[3].endswith("| - | +10.0% |") and "| steady |" in lines[3]
    meta = {
        "date": "2026-12-06",
        "commit": "abc1234",
        "label": "plumbing run on 2 CPU cores",
        "hardware": "2 CPU cores",
        "loadavg": "2.0 / 3.0",
        "vllm_version": "0.32.0",
        "vllm_python": "/venv/bin/python",
        "model": "tiny",
        "model_dir": "/tmp/m",
        "bound_note": "KV bytes / a host memcpy's rate",
        "command": "benchmarks/vs_vllm.py --device cpu",
        "engine_commands": ["python -m kvshare up --model /tmp/m"],
        "notes": ["vLLM's native CPU offloading runs only on GPUs"],
    }
    readme = bench.readme(rows, meta)
    assert "**plumbing run on 2 CPU cores.**" in readme and text in readme
    assert "benchmarks/vs_vllm.py --device cpu\npython -m kvshare up --model /tmp/m\n" in readme
    assert "vLLM 0.32.0 (/venv/bin/python)." in readme
    assert "vLLM not run." in bench.readme(rows, {**meta, "vllm_version": None})  # a kvshare-only run
    assert bench.result_dir_name("2026-12-06", "abc1234") == "2026-12-06-abc1234-vs-vllm"


def test_a_length_beyond_the_presets_context_is_refused_before_anything_starts(bench, tmp_path, monkeypatch, capsys):
    """A prompt with no room for its generated tokens is refused by the servers only after both have started (fails
    when main() does not check: run_kvshare is reached)."""
    monkeypatch.setattr(bench, "run_kvshare", lambda *a: pytest.fail("a server was started"))
    context = bench_preset_context("qwen3-32b")
    argv = ["--preset", "qwen3-32b", "--lengths", "32768", str(context), "--out", str(tmp_path / "out")]
    assert bench.main(argv) == 2
    assert f"a prompt of {context} leaves no room for 16 generated tokens" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def bench_preset_context(preset: str) -> int:
    from kvshare.engine.presets import PRESETS

    return PRESETS[preset].config.max_position_embeddings


def test_timelines_are_asked_of_the_replica_and_kept_per_request(bench, monkeypatch):
    """--timelines: each kvshare request asks its replica for its steps to the first token (fails when request()
    does not pass it on to the bench client), and the figures keep each one by request."""
    from types import SimpleNamespace

    from kvshare.bench import client

    sent = []

    async def fake_send(session, request):
        sent.append(request)
        return SimpleNamespace(error=None, provenance={"timeline": {"parse": 0.001}})

    monkeypatch.setattr(client, "send", fake_send)
    cold = bench.request("http://r", "m", [1, 2], 4, True, "token_ids", True)
    bench.request("http://r", "m", [{"role": "user", "content": "hi"}], 4, True, "text", True)
    bench.request("http://r", "m", [1, 2], 4, True)
    assert [r.timeline for r in sent] == [True, True, False]
    assert bench.timelines(cold, cold, [cold]) == {
        "cold": {"parse": 0.001},
        "cross": {"parse": 0.001},
        "local": [{"parse": 0.001}],
    }


def test_the_slowest_repeated_local_hit_is_in_the_row_and_the_table(bench):
    """The GPU prefix hit is judged "every time", not once: a row carries the slowest of the repeated local hits and
    the table shows it beside the first (fails when make_row drops local_max_s)."""
    row = bench.make_row(COMMON, kvshare_figures(local_max_s=0.071), None, RATE, KV_BYTES_PER_TOKEN)
    assert row["local_s"] == 0.05 and row["local_max_s"] == 0.071
    assert "| 0.050 (max 0.071) |" in bench.table([row])
    once = bench.make_row(COMMON, kvshare_figures(), None, RATE, KV_BYTES_PER_TOKEN)
    assert once["local_max_s"] is None and "| 0.050 |" in bench.table([once])


def test_the_text_client_is_refused_until_the_bench_client_sends_text(bench, monkeypatch, capsys):
    from kvshare.bench import client

    @dataclasses.dataclass(frozen=True)
    class IdsOnly:  # the fields a client without a user's mode has
        url: str

    monkeypatch.setattr(client, "BenchRequest", IdsOnly)
    assert "--client token_ids" in bench.text_client_refusal()
    assert bench.main(["--client", "text", "--preset", "tiny", "--out", "/nonexistent/never-written"]) == 2
    assert "send chat text as a user's client does" in capsys.readouterr().err

    @dataclasses.dataclass(frozen=True)
    class WithUserMode:
        url: str
        is_user_client: bool = False

    monkeypatch.setattr(client, "BenchRequest", WithUserMode)
    assert bench.text_client_refusal() is None


def test_a_text_prompt_renders_to_its_length_through_the_models_chat_template(bench, tmp_path):
    from kvshare.engine.make_model import write_model_dir
    from kvshare.engine.tokenizer import Tokenizer

    write_model_dir("tiny", str(tmp_path))
    messages = bench.chat_prompt(str(tmp_path), 0, 300, "vs-vllm/300/0")
    assert messages[-1]["role"] == "user"
    assert len(Tokenizer.from_dir(str(tmp_path)).apply_chat_template(messages)) == 300


def test_the_text_client_is_warmed_once_per_server_with_a_prompt_that_shares_no_chunk(bench, tmp_path, monkeypatch):
    """The user's client's first call in a process pays its set-up inside the clock: one short chat request goes
    to each server before its first measured text prompt, never for token ids, never twice (fails when warm_client
    sends nothing), and its prompt shares not one chunk with a measured one."""
    from kvshare.engine.make_model import write_model_dir
    from kvshare.engine.tokenizer import Tokenizer

    write_model_dir("tiny", str(tmp_path))
    sent = []
    client_module = sys.modules[bench.warm_client.__module__]  # benchmarks/vs_vllm_client.py
    monkeypatch.setattr(client_module, "request", lambda url, model, prompt, *a: sent.append((url, prompt, *a)))
    monkeypatch.setattr(client_module, "_WARM_CLIENTS", set())
    for url, client in [("http://a", "token_ids"), ("http://a", "text"), ("http://a", "text"), ("http://b", "text")]:
        bench.warm_client(url, "m", client, str(tmp_path), 0, True)
    assert [(url, args[-1]) for url, _prompt, *args in sent] == [("http://a", "text"), ("http://b", "text")]
    tokenizer = Tokenizer.from_dir(str(tmp_path))
    warm = tokenizer.apply_chat_template(sent[0][1])
    measured = tokenizer.apply_chat_template(bench.chat_prompt(str(tmp_path), 0, 300, "vs-vllm/300/0"))
    shared = next(i for i, (x, y) in enumerate(zip(warm, measured)) if x != y)
    assert shared < 32  # the template's head only: less than a chunk


def test_text_figures_meet_their_token_id_twins(bench):
    figures = [
        kvshare_figures(),
        kvshare_figures("text", cross_s=0.12),
        kvshare_figures("text", prompt_tokens=131072, cross_s=0.4),
    ]
    twinned = bench.with_token_ids_twins(figures)
    assert twinned[0] == figures[0] and twinned[1]["token_ids_cross_s"] == 0.1
    assert twinned[2]["token_ids_cross_s"] is None  # no token-id prompt of that length: no overhead invented
    row = bench.make_row(COMMON, twinned[1], None, RATE, KV_BYTES_PER_TOKEN)
    assert row["text_overhead"] == pytest.approx(0.2)


def test_a_phase_measured_by_another_command_completes_the_table_and_another_plan_is_refused(bench, tmp_path):
    path = str(tmp_path / "measurements.json")
    plan = {"preset": "qwen3-8b", "lengths": [32768], "seed": 0}
    first = bench.Measurements(path, plan)
    first.add_command("python benchmarks/vs_vllm.py --engines kvshare")
    first.put("kvshare", {"figures": [kvshare_figures()]})
    second = bench.Measurements(path, dict(plan))
    second.add_command("python benchmarks/vs_vllm.py --engines vllm")
    assert second.get("kvshare") == {"figures": [kvshare_figures()]} and second.get("vllm") is None
    assert second.commands() == [
        "python benchmarks/vs_vllm.py --engines kvshare",
        "python benchmarks/vs_vllm.py --engines vllm",
    ]
    with pytest.raises(SystemExit, match="another plan"):
        bench.Measurements(path, {**plan, "lengths": [131072]})


def test_two_commands_one_engine_each_make_one_table_of_the_same_prompts(bench, tmp_path, monkeypatch):
    """main() end to end with the engines replaced by recorders: the kvshare command and the vLLM command send the
    same prompts, and the second one writes the table of both."""
    from kvshare.engine.presets import get_preset, preset_hf_config

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(preset_hf_config(get_preset("tiny"))))
    sent: dict[str, list] = {"kvshare": [], "vllm": []}

    def fake_kvshare(length, prompts, args, model_dir):
        sent["kvshare"] += [ids for ids_list in prompts.values() for ids in ids_list]
        return [
            kvshare_figures(prompt_tokens=length, prompt_index=k, first_request=k == 0, pool_tokens=256)
            for k in range(len(prompts["token_ids"]))
        ], ["python -m kvshare up --model M"]

    def fake_vllm(prompts, args, model_dir):
        sent["vllm"] += [ids for ids_list in prompts.values() for ids in ids_list]
        return {
            (n, c, k): {"cold_s": 3.0, "local_s": 0.5, "cpu_tier_s": None, "cached_tokens": 256}
            for (n, c), ids_list in prompts.items()
            for k in range(len(ids_list))
        }, "python -m vllm... --model M"

    monkeypatch.setattr(bench, "run_kvshare", fake_kvshare)
    monkeypatch.setattr(bench, "run_vllm", fake_vllm)
    monkeypatch.setattr(bench, "memcpy_rate", lambda: 5e9)
    monkeypatch.setattr(bench, "vllm_version", lambda python: "0.32.0")
    out = tmp_path / "out"
    common = [
        "--preset",
        "tiny",
        "--device",
        "cpu",
        "--lengths",
        "512",
        "--model-dir",
        str(model_dir),
        "--out",
        str(out),
        "--label",
        "a plumbing run; its timings say nothing",
    ]
    assert bench.main([*common, "--engines", "kvshare"]) == 0
    first = json.loads((out / "rows.json").read_text())
    assert first[0]["vllm_cold_s"] is None  # the table so far: kvshare alone
    before = signal.getsignal(signal.SIGTERM)
    assert bench.main([*common, "--engines", "vllm"]) == 0
    assert signal.getsignal(signal.SIGTERM) is before  # main() leaves the process's signal handlers alone
    rows = json.loads((out / "rows.json").read_text())
    assert sent["kvshare"] == sent["vllm"] and len(sent["vllm"]) == 2 and len(sent["vllm"][0]) == 512
    assert [r["cold_over_vllm"] for r in rows] == [pytest.approx(0.5), pytest.approx(0.5)]
    assert rows[0]["bound_s"] == pytest.approx(256 * get_preset("tiny").config.kv_bytes_per_token / 5e9)
    readme = (out / "README.md").read_text()
    assert "--engines kvshare" in readme and "--engines vllm" in readme and "python -m vllm... --model M" in readme
    assert "vLLM 0.32.0" in readme and "no GPU" in readme
    commands = [line for line in readme.splitlines() if line.startswith("python benchmarks/vs_vllm.py")]
    assert len(commands) == 2 and all("say nothing'" in line for line in commands)  # one line each, label and all
    assert bench.main([*common, "--engines"]) == 0  # the table again from the phases kept: no command added
    assert (out / "README.md").read_text() == readme and json.loads((out / "rows.json").read_text()) == rows


def test_without_weights_kvshare_serves_the_preset_by_name_and_vllm_draws_dummy_weights(bench, tmp_path, monkeypatch):
    """--no-weights (the 32B shape: its weights do not fit the GPU machine's disk): the kvshare cluster is given
    the preset's name, whose seeded weights a replica draws on its device, and vLLM --load-format dummy (fails
    when either is handed the weightless directory as if it held weights)."""
    import sys
    import types

    from kvshare.integrations.vllm import launch

    seen = {}

    class Started(Exception):
        pass

    class FakeCluster:
        def __init__(self, spec):
            seen["kvshare_model"] = spec.model
            raise Started

    def fake_command(config):
        seen["vllm"] = (config.model, config.extra_args)
        raise Started

    monkeypatch.setitem(sys.modules, "up_cluster", types.SimpleNamespace(Cluster=FakeCluster))
    monkeypatch.setattr(launch, "vllm_server_command", fake_command)
    args = bench.parse_args(["--preset", "qwen3-32b", "--no-weights", "--lengths", "32768", "--out", str(tmp_path)])
    args.gpu_bytes, args.model_dtype, args.log_dir = 141 * 10**9, "bfloat16", str(tmp_path)
    with pytest.raises(Started):
        bench.run_kvshare(32768, {"token_ids": [[1] * 32768]}, args, "/tmp/vs-vllm-qwen3-32b")
    with pytest.raises(Started):
        bench.run_vllm({(32768, "token_ids"): [[1] * 32768]}, args, "/tmp/vs-vllm-qwen3-32b")
    assert seen["kvshare_model"] == "qwen3-32b"
    model, extra = seen["vllm"]
    assert model == "/tmp/vs-vllm-qwen3-32b" and extra[-2:] == ("--load-format", "dummy")
