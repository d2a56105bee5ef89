"""benchmarks/routing_gpu_all.sh and routing_gpu_plan.py without a GPU: every step of the plan is a command line that
`kvshare bench routing` accepts, the first three give the main comparison, and the plan's sizes fit the machine."""

from __future__ import annotations

import os
import re
import shlex
import subprocess

from kvshare.bench.routing_trace import DEFAULT_CONDITIONS, make_trace
from kvshare.cli import build_parser
from kvshare.commands.bench_routing import routing_plan
from tests.benchmarks.loader import ROOT, load_benchmark

SCRIPT = os.path.join(ROOT, "benchmarks", "routing_gpu_all.sh")
PREFIX = ["python3", "-m", "kvshare", "bench", "routing"]


def _steps(tmp_path) -> dict[str, list[str]]:
    """Each numbered step of the printed plan -> its command's arguments after `kvshare bench routing`."""
    env = dict(os.environ, DRY="1", OUT=str(tmp_path))
    plan = subprocess.run(["bash", SCRIPT], env=env, capture_output=True, text=True, timeout=30).stdout
    steps = [m.group(1) for m in re.finditer(r"^(\d+) +\d+-\d+ ", plan, re.M)]  # "N  minutes  what"
    assert steps == [str(n) for n in range(1, len(steps) + 1)] and len(steps) >= 3
    out = {}
    for n in steps:
        done = subprocess.run(["bash", SCRIPT, n], env=env, capture_output=True, text=True, timeout=30)
        argv = shlex.split(done.stdout.strip())
        assert done.returncode == 0 and argv[:5] == PREFIX, done.stdout + done.stderr
        out[n] = argv[5:]
    return out


def test_every_step_parses_and_the_first_three_give_the_main_comparison(tmp_path):
    """Fails when a step passes a flag `bench routing` lacks (--run-index before it existed: argparse exits), when
    two steps replay the same run at the same rate, or when steps 1-3 miss a policy or a run."""
    steps = _steps(tmp_path)
    parsed = {n: build_parser().parse_args(["bench", "routing", *argv]) for n, argv in steps.items()}
    outs = {args.out for args in parsed.values()}
    assert len(outs) == 1  # one accumulating folder
    replays = [(rate, c, args.run_index) for args in parsed.values() for rate in args.rates for c in args.conditions]
    assert len(replays) == len(set(replays))
    first = [parsed[n] for n in ("1", "2", "3")]
    assert {a.run_index for a in first} == {0, 1, 2} and all(a.runs == 1 for a in first)
    assert len({a.rates for a in first}) == 1 and all(set(DEFAULT_CONDITIONS) <= set(a.conditions) for a in first)
    workloads = {tuple(argv[: argv.index("--rates")]) for argv in steps.values()}
    assert len(workloads) == 1  # every step replays the same trace on the same cluster (else the folder refuses it)


def test_the_plan_fits_one_h100_and_its_steps_fit_a_command(tmp_path):
    """The estimate of each step: the replicas' memory within 80 GB, the pool within 60% of 128 GiB, the longest
    request within --max-model-len, and the step (with ~150 s to prepare a fresh machine) within 570 s."""
    estimate = load_benchmark("routing_gpu_plan")
    for n, argv in _steps(tmp_path).items():
        argv = [a if a != "/tmp/m8b" else "qwen3-8b" for a in argv]
        text = estimate.plan(argv)
        assert "DOES NOT FIT" not in text and "max-model-len below" not in text, text
        config, target = routing_plan(build_parser().parse_args(["bench", "routing", *argv]))
        assert target.pool_bytes <= 0.6 * 128 * 2**30
        seconds = float(text.rsplit("this command: ~", 1)[1].split(" s", 1)[0])
        assert seconds + 150 <= 570, (n, text)
        trace = make_trace(config)
        assert estimate.longest_sequence(trace) < 16384


def test_the_estimate_bounds_a_replay_between_full_reuse_and_none():
    """Fails when the engine model charges reuse like a cold prefill (the bounds then coincide)."""
    from kvshare.bench.routing_trace import RoutingConfig

    estimate = load_benchmark("routing_gpu_plan")
    trace = make_trace(RoutingConfig(num_sessions=8, num_prompts=2, num_turns=3))
    rates = estimate.Rates()
    cold = estimate.replay_seconds(trace, 4.0, rates, 2, reuse=False)
    warm = estimate.replay_seconds(trace, 4.0, rates, 2, reuse=True)
    assert warm[0] < cold[0] and warm[1] < cold[1]
    decode = sum(sum(s.answer_tokens) for s in trace.sessions) * rates.decode_step_s
    assert warm[0] >= decode / 2  # two replicas can at best split the decode steps


def _vllm_steps(tmp_path) -> dict[str, list[str]]:
    env = dict(os.environ, DRY="1", OUT=str(tmp_path), ENGINE="vllm")
    plan = subprocess.run(["bash", SCRIPT], env=env, capture_output=True, text=True, timeout=30).stdout
    assert "ENGINE=vllm" in plan and "100-300" in plan
    out = {}
    for n in range(1, 12):
        done = subprocess.run(["bash", SCRIPT, str(n)], env=env, capture_output=True, text=True, timeout=30)
        argv = shlex.split(done.stdout.strip())
        assert done.returncode == 0 and argv[:5] == PREFIX, done.stdout + done.stderr
        out[str(n)] = argv[5:]
    assert subprocess.run(["bash", SCRIPT, "18"], env=env, capture_output=True, timeout=30).returncode == 2
    return out


def test_engine_vllm_replays_every_condition_once_per_run_each_step_fitting_a_command(tmp_path):
    """ENGINE=vllm: 64 sessions with 100-300-token answers on vLLM replicas; steps 1-3 give every condition of
    run 0 at 2 sessions/s, 1-9 three runs, 10-11 rate 4/s; each step's estimate (vLLM's start included) leaves the
    ~100 s a fresh machine's preparation takes (the bundle, the 8B model; measured on one H100) within 585 s, the
    two replicas fit one 80 GB card and vLLM's KV holds the longest request. Fails when a step replays a (rate,
    condition, run) another step does, or one does not fit."""
    from kvshare.bench.routing_trace import CONTROLS

    estimate = load_benchmark("routing_gpu_plan")
    steps = {n: [a if a != "/tmp/m8b" else "qwen3-8b" for a in argv] for n, argv in _vllm_steps(tmp_path).items()}
    parsed = {n: build_parser().parse_args(["bench", "routing", *argv]) for n, argv in steps.items()}
    assert all(a.engine == "vllm" and a.sessions == 64 and a.answer_tokens == (100, 300) for a in parsed.values())
    assert len({a.out for a in parsed.values()}) == 1
    replays = [(rate, c, a.run_index) for a in parsed.values() for rate in a.rates for c in a.conditions]
    assert len(replays) == len(set(replays))
    every = set(DEFAULT_CONDITIONS + CONTROLS)
    for run in (0, 1, 2):
        assert {c for rate, c, r in replays if r == run and rate == 2} == every
    for n, argv in steps.items():
        text = estimate.plan(argv)
        assert "DOES NOT FIT" not in text and "less than one request" not in text, text
        seconds = float(text.rsplit("this command: ~", 1)[1].split(" s", 1)[0])
        assert seconds + 100 <= 585, (n, text)
        _, target = routing_plan(build_parser().parse_args(["bench", "routing", *argv]))
        assert target.pool_bytes <= 0.6 * 128 * 2**30


def test_batched_decode_lets_the_next_prefill_start_before_the_last_answer_ends():
    """The vLLM model: a replica's prefills queue, decodes run beside each other. Fails when the batched replay
    still waits for each answer (it would then take as long as the built-in engine's)."""
    from dataclasses import replace

    from kvshare.bench.routing_trace import RoutingConfig

    estimate = load_benchmark("routing_gpu_plan")
    trace = make_trace(RoutingConfig(num_sessions=16, num_prompts=2, num_turns=3, answer_tokens=(100, 300)))
    serial = estimate.Rates(decode_step_s=0.025)
    batched = replace(serial, is_batched=True)
    one, many = (estimate.replay_seconds(trace, 4.0, r, 2, reuse=True) for r in (serial, batched))
    assert many[0] < one[0] and many[1] < one[1]
    longest = max(sum(s.answer_tokens) for s in trace.sessions) * batched.decode_step_s
    assert many[0] >= longest  # a session's answers still follow each other
