"""vLLM's conventions on a replica, so tools written for `vllm serve` work unchanged.

The shapes are those of vLLM 0.32 (vllm/entrypoints/serve/engine/protocol.py: ModelCard, ModelPermission;
serve/tokenize/protocol.py; instrumentator/basic.py: /version; sagemaker/api_router.py: GET and POST /ping).
"""

import argparse
import os

import openai
import pytest

import kvshare
from kvshare.commands import serve as serve_command
from kvshare.launch import Cluster, ClusterConfig
from tests.serve.live import call, replica, tiny_engine

MODEL_CARD_FIELDS = {"id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission"}
PERMISSION_FIELDS = {
    "id",
    "object",
    "created",
    "allow_create_engine",
    "allow_sampling",
    "allow_logprobs",
    "allow_search_indices",
    "allow_view",
    "allow_fine_tuning",
    "organization",
    "group",
    "is_blocking",
}


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from kvshare.engine.make_model import write_model_dir

    path = str(tmp_path_factory.mktemp("models") / "tiny-dir")
    write_model_dir("tiny", path)
    return path


def parse_serve(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_command.add_arguments(parser)
    return parser.parse_args(argv)


def complete(url: str, **body) -> tuple[int, dict]:
    return call(url, "/v1/completions", {"prompt": "once upon a time", "max_tokens": 2, "temperature": 0, **body})


def test_the_model_id_is_the_model_argument_as_given(model_dir):
    given = model_dir + "/"  # exactly as typed, trailing slash and all (vLLM's rule)
    with replica(tiny_engine(given)) as url:
        status, models = call(url, "/v1/models")
        assert status == 200 and [m["id"] for m in models["data"]] == [given]
        assert models["data"][0]["root"] == given
        status, out = complete(url, model=given)
        assert status == 200 and out["model"] == given
        status, out = complete(url, model=os.path.basename(model_dir))  # the old default is not an alias
        assert status == 404 and out["error"]["code"] == "model_not_found" and given in out["error"]["message"]
    # `kvshare up` starts replicas with --model as given and no --served-model-name; vLLM replicas get it named
    cluster = Cluster(ClusterConfig(model=given))
    argv, _ = cluster._replica_command(0, [])
    args = parse_serve(argv[argv.index("serve") + 1 :])
    assert args.model == given and args.served_model_name is None
    assert serve_command.serve_config(args).served_model_names == () and cluster._served_name() == given


def test_several_served_model_names_the_first_is_reported(engine):
    args = parse_serve(["--served-model-name", "main", "alias"])
    assert serve_command.serve_config(args).served_model_names == ("main", "alias")
    with replica(engine, served_model_names=("main", "alias")) as url:
        status, models = call(url, "/v1/models")
        assert [m["id"] for m in models["data"]] == ["main", "alias"]
        for name in ("main", "alias"):
            status, out = complete(url, model=name)
            assert status == 200 and out["model"] == "main"
        status, out = complete(url, model="tiny")
        assert status == 404 and out["error"]["param"] == "model"
        assert "Valid aliases: main, alias" in out["error"]["message"]
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        chat = client.chat.completions.create(
            model="alias", messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0
        )
        assert chat.model == "main"


def test_model_may_be_left_out(engine):
    with replica(engine) as url:
        status, out = complete(url)
        assert status == 200 and out["model"] == "tiny" and out["usage"]["completion_tokens"] == 2
        status, out = call(
            url,
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": False},
        )
        assert status == 200 and out["model"] == "tiny"


def test_models_list_has_vllms_fields(engine):
    with replica(engine) as url:
        status, models = call(url, "/v1/models")
    assert status == 200 and models["object"] == "list"
    card = models["data"][0]
    assert set(card) == MODEL_CARD_FIELDS and set(card["permission"][0]) == PERMISSION_FIELDS
    assert card["object"] == "model" and card["owned_by"] == "kvshare" and card["parent"] is None
    assert card["root"] == "tiny" and card["max_model_len"] == engine.max_model_len
    assert card["permission"][0]["object"] == "model_permission" and isinstance(card["created"], int)


def test_tokenize_and_detokenize_agree_with_the_requests(engine):
    prompt = "The shared pool keeps what one replica computed."
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": prompt}]
    with replica(engine) as url:
        status, tok = call(url, "/tokenize", {"model": "tiny", "prompt": prompt})
        assert status == 200 and set(tok) == {"count", "max_model_len", "tokens", "token_strs"}
        assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == engine.max_model_len
        assert tok["token_strs"] is None
        _, out = complete(url, prompt=prompt)
        assert out["usage"]["prompt_tokens"] == tok["count"]  # the ids a completion runs
        status, chat_tok = call(url, "/tokenize", {"messages": messages, "return_token_strs": True})
        _, chat = call(url, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
        assert status == 200 and chat["usage"]["prompt_tokens"] == chat_tok["count"]
        assert "".join(chat_tok["token_strs"]) == call(url, "/detokenize", {"tokens": chat_tok["tokens"]})[1]["prompt"]
        status, detok = call(url, "/detokenize", {"model": "tiny", "tokens": tok["tokens"]})
        assert status == 200 and detok == {"prompt": prompt}
        for path, body, want, param in [
            ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
            ("/tokenize", {"prompt": "x", "messages": messages}, 400, "prompt"),
            ("/tokenize", {"prompt": "x", "add_special_tokens": True}, 400, "add_special_tokens"),
            ("/tokenize", {"messages": messages, "chat_template": "{{ x }}"}, 400, "chat_template"),
            ("/detokenize", {"tokens": [engine.model_config.vocab_size]}, 400, "tokens"),
            ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "model"),
        ]:
            status, out = call(url, path, body)
            assert status == want and out["error"]["param"] == param, (path, body, out)
        status, out = call(url, "/tokenize", raw=b"{not json")
        assert status == 400 and out["error"]["code"] == "invalid_json"


def test_version_and_ping(engine):
    with replica(engine) as url:
        assert call(url, "/version") == (200, {"version": kvshare.__version__})
        assert call(url, "/ping") == (200, b"")
        assert call(url, "/ping", method="POST") == (200, b"")


def test_max_model_len_and_dtype_flags():
    args = parse_serve(["--max-model-len", "64", "--dtype", "bfloat16"])
    config = serve_command.engine_config(args)
    assert config.max_model_len == 64 and config.dtype == "bfloat16"
    assert [serve_command.engine_config(parse_serve(["--dtype", d])).dtype for d in ("auto", "half", "float")] == [
        None,
        "float16",
        "float32",
    ]
    assert [parse_serve(["--max-model-len", v]).max_model_len for v in ("32k", "32K", "auto")] == [32000, 32768, None]
    with pytest.raises(SystemExit):
        parse_serve(["--dtype", "int8"])
    with pytest.raises(SystemExit):
        parse_serve(["--max-model-len", "lots"])
    engine = serve_command.build_engine(args)
    assert engine.model_config.dtype == "bfloat16" and engine.max_model_len == 64
    with replica(engine) as url:
        assert call(url, "/v1/models")[1]["data"][0]["max_model_len"] == 64
        status, out = complete(url, prompt="x" * 50, max_tokens=20)
        assert status == 400 and out["error"]["param"] == "max_tokens"
        assert out["error"]["code"] == "context_length_exceeded"
        assert out["error"]["message"].startswith(
            "This model's maximum context length is 64 tokens. However, you "
            "requested 70 tokens (50 in the prompt, 20 in the completion)."
        )
        status, out = complete(url, prompt="x" * 64, max_tokens=1)
        assert status == 400 and out["error"]["param"] == "prompt" and "64 input tokens" in out["error"]["message"]
        status, out = complete(url, prompt="x" * 50, max_tokens=14, ignore_eos=True)
        assert status == 200 and out["usage"]["completion_tokens"] == 14


def test_staging_buffers_flag_reaches_the_pool_transfer():
    assert serve_command.engine_config(parse_serve([])).staging_buffers == 2
    assert serve_command.engine_config(parse_serve(["--staging-buffers", "4"])).staging_buffers == 4
    with pytest.raises(ValueError, match="staging_buffers must be at least 2"):
        serve_command.engine_config(parse_serve(["--staging-buffers", "1"]))
    from kvshare.engine.engine import Engine
    from kvshare.pool.spawn import running_pool

    with running_pool("64MiB", quiet=True) as sock:
        engine = Engine(serve_command.engine_config(parse_serve(["--pool", sock, "--staging-buffers", "3"])))
        try:
            assert engine._pool.transfer_config.staging_buffers == 3
        finally:
            engine.close()


def test_tokenize_refuses_what_chat_refuses_and_a_template_that_fails_is_a_400(engine):
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    chat_body = {"messages": image, "max_tokens": 1}
    with replica(engine) as url:
        for path, body in (("/tokenize", {"messages": image}), ("/v1/chat/completions", chat_body)):
            status, out = call(url, path, body)
            assert status == 400 and out["error"]["param"] == "messages[0].content[0].type", out
        template = engine.tokenizer.chat_template
        try:
            for broken in (None, "{{ raise_exception('this template takes no system message') }}"):
                engine.tokenizer.chat_template = broken  # a model without a template; one that refuses the messages
                for path, body in (
                    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}),
                    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                ):
                    status, out = call(url, path, body)
                    assert status == 400 and out["error"]["param"] == "messages", (broken, path, out)
        finally:
            engine.tokenizer.chat_template = template


def _stream(url: str, path: str, body: dict) -> list[dict]:
    """The JSON chunks of one streamed answer, [DONE] left out."""
    import json
    import urllib.request

    req = urllib.request.Request(
        url + path, data=json.dumps({**body, "stream": True}).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        lines = resp.read().decode().splitlines()
    return [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(engine, path):
    """Fails when stream_options.continuous_usage_stats is accepted and ignored: vLLM then gives every chunk the
    usage so far (prompt tokens, the tokens generated up to it), and the usage chunk at the end as before."""
    prompt = {"prompt": "once upon a time"} if "chat" not in path else {"messages": [{"role": "user", "content": "hi"}]}
    body = {**prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    with replica(engine) as url:
        chunks = _stream(url, path, {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
        plain = _stream(url, path, {**body, "stream_options": {"continuous_usage_stats": True}})
    *answer, usage = chunks
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6, usage
    num_prompt = usage["usage"]["prompt_tokens"]
    so_far = [chunk["usage"]["completion_tokens"] for chunk in answer]  # a KeyError: a chunk without usage
    assert so_far == sorted(so_far) and so_far[-1] == 6, so_far
    assert all(chunk["usage"]["prompt_tokens"] == num_prompt for chunk in answer)
    assert all(chunk["usage"]["total_tokens"] == num_prompt + n for chunk, n in zip(answer, so_far, strict=True))
    assert all("usage" not in chunk for chunk in plain), plain  # as vLLM: only with include_usage
