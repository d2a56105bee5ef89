import pytest

from kvshare.serve import api_types as A


def chat(**extra):
    import json

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]} | extra
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    "body, param",
    [
        (chat(temperature=3), "temperature"),
        (chat(top_p=0), "top_p"),
        (chat(n=2), "n"),
        (chat(stop=["a", "b", "c", "d", "e"]), "stop"),
        pytest.param(chat(stop="x" * (A.MAX_STOP_CHARS + 1)), "stop", id="a-stop-string-too-long"),
        (chat(messages=[]), "messages"),
        (chat(messages=[{"role": "robot", "content": "x"}]), "messages[0].role"),
        (chat(top_logprobs=9, logprobs=True), "top_logprobs"),
    ],
)
def test_range_checks_name_the_parameter(body, param):
    req = A.decode(body, A.ChatRequest)
    with pytest.raises(A.ApiError) as err:
        A.validate(req)
    assert err.value.status == 400 and err.value.param == param


@pytest.mark.parametrize(
    "body, fragment",
    [
        (b"{not json", "malformed JSON"),
        (chat(max_tokens="ten"), "max_tokens"),
        (b'{"model": "m"}', "messages"),
        (chat(kvshare={"use_pool": "no"}), "use_pool"),
        (chat(kvshare={"bogus": True}), "bogus"),
    ],
)
def test_type_errors_are_400_with_a_message(body, fragment):
    with pytest.raises(A.ApiError) as err:
        A.decode(body, A.ChatRequest)
    assert err.value.status == 400 and fragment in err.value.message
    assert set(err.value.body()["error"]) == {"message", "type", "param", "code"}


def test_completion_prompt_forms_and_extension():
    req = A.decode(b'{"model":"m","prompt":[1,2,3],"kvshare":{"use_pool":false}}', A.CompletionRequest)
    A.validate(req)
    assert req.prompt == [1, 2, 3] and req.kvshare.use_pool is False
    batch = A.decode(b'{"model":"m","prompt":["a","b"]}', A.CompletionRequest)
    with pytest.raises(A.ApiError, match="batch"):
        A.validate(batch)
    assert A.message_text(A.ChatMessage(role="user", content=[A.ContentPart(type="text", text="x")])) == "x"


# -- cache_salt (item 1) and parameters honoured or refused, never ignored (item 5) ----------


def completion(**extra):
    import json

    return json.dumps({"model": "m", "prompt": "hi"} | extra).encode()


@pytest.mark.parametrize("salt", [1, 2.5, True, ["a"], {"a": 1}])
def test_cache_salt_must_be_a_string(salt):
    for body, kind in ((chat(cache_salt=salt), A.ChatRequest), (completion(cache_salt=salt), A.CompletionRequest)):
        with pytest.raises(A.ApiError) as err:
            A.decode(body, kind)
        assert err.value.status == 400 and err.value.param == "cache_salt"


def test_cache_salt_is_read_and_must_not_be_empty():
    assert A.decode(chat(cache_salt="tenant-a"), A.ChatRequest).cache_salt == "tenant-a"
    assert A.decode(completion(), A.CompletionRequest).cache_salt is None
    with pytest.raises(A.ApiError) as err:
        A.validate(A.decode(completion(cache_salt=""), A.CompletionRequest))
    assert err.value.param == "cache_salt"


def test_namespace_salt_keeps_salts_and_tenants_apart():
    from kvshare.serve.tenancy import namespace_salt

    assert namespace_salt("acme", None) == "acme" and namespace_salt("", None) == ""  # unsalted: as before
    salts = {namespace_salt(t, s) for t in ("", "acme", "key:ab") for s in (None, "x", "acme", "")}
    assert len(salts) == 12  # every (tenant, salt) pair its own namespace; no salt spells a bare tenant


REFUSED = [
    ("/v1/completions", "best_of", 2),
    ("/v1/completions", "suffix", "tail"),
    ("/v1/completions", "prompt_embeds", "x"),
    ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
    ("/v1/chat/completions", "tool_choice", "required"),
    ("/v1/chat/completions", "functions", [{"name": "f"}]),
    ("/v1/chat/completions", "modalities", ["text", "audio"]),
    ("/v1/chat/completions", "chat_template", "{{ messages }}"),
    ("/v1/chat/completions", "add_generation_prompt", False),
] + [
    (path, name, value)
    for path in ("/v1/completions", "/v1/chat/completions")
    for name, value in [
        ("response_format", {"type": "json_object"}),
        ("guided_json", {"type": "object"}),
        ("guided_regex", "a+"),
        ("guided_choice", ["yes", "no"]),
        ("guided_grammar", "root ::= 'a'"),
        ("structured_outputs", {"regex": "a"}),
        ("bad_words", ["bad"]),
        ("allowed_token_ids", [1, 2]),
        ("min_tokens", 4),
        ("use_beam_search", True),
        ("prompt_logprobs", 1),
        ("include_stop_str_in_output", True),
        ("skip_special_tokens", False),
    ]
]
NEUTRAL = [
    (
        "/v1/completions",
        {
            "best_of": 1,
            "suffix": "",
            "response_format": {"type": "text"},
            "bad_words": [],
            "min_tokens": 0,
            "frequency_penalty": 0,
            "presence_penalty": 0.0,
            "top_k": -1,
        },
    ),
    (
        "/v1/chat/completions",
        {
            "tools": [],
            "tool_choice": "none",
            "response_format": None,
            "guided_json": None,
            "modalities": ["text"],
            "add_generation_prompt": True,
            "repetition_penalty": 1,
        },
    ),
]


def _request(path, **extra):
    return (
        A.decode(completion(**extra), A.CompletionRequest)
        if path == "/v1/completions"
        else A.decode(chat(**extra), A.ChatRequest)
    )


@pytest.mark.parametrize("path, name, value", REFUSED)
def test_parameters_not_implemented_are_refused_naming_them(path, name, value):
    with pytest.raises(A.ApiError) as err:
        A.validate(_request(path, **{name: value}))
    assert err.value.status == 400 and err.value.param == name and name in err.value.message
    assert err.value.code == "unsupported_parameter"


@pytest.mark.parametrize("path, extra", NEUTRAL)
def test_parameters_at_their_neutral_value_are_accepted(path, extra):
    A.validate(_request(path, **extra))


def test_image_parts_are_refused_naming_the_part():
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    req = A.decode(
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": "what is it?"}, image]}]), A.ChatRequest
    )
    with pytest.raises(A.ApiError) as err:
        A.validate(req)
    assert err.value.status == 400 and err.value.param == "messages[0].content[1].type"
    A.validate(A.decode(chat(messages=[{"role": "user", "content": [{"type": "text", "text": "x"}]}]), A.ChatRequest))


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.1}, "min_p"),
        ({"logit_bias": {"12": 101}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"-3": 1}}, "logit_bias"),
    ],
)
def test_sampling_ranges_name_the_parameter(extra, param):
    with pytest.raises(A.ApiError) as err:
        A.validate(_request("/v1/completions", **extra))
    assert err.value.status == 400 and err.value.param == param


def test_type_errors_name_the_parameter():
    for body, param in (
        (chat(top_k="3"), "top_k"),
        (chat(stop_token_ids=["a"]), "stop_token_ids[0]"),
        (chat(logit_bias={"1": "a"}), "logit_bias"),
        (chat(messages=[{"role": 3}]), "messages[0].role"),
    ):
        with pytest.raises(A.ApiError) as err:
            A.decode(body, A.ChatRequest)
        assert err.value.param == param, body


# -- token-id prompts read straight into one int64 array ----------------------------------


@pytest.mark.parametrize("text", ["[5, 17,\n 3]", "[5,17,3]", " [ 5 , 17 , 3 ] ", "[\t5,\r\n17,3\n]"])
def test_token_id_prompts_read_as_one_array_whatever_the_whitespace(text):
    import numpy as np

    req = A.decode_completion(b'{"model": "m", "prompt": ' + text.encode() + b', "max_tokens": 4}')
    A.validate(req)
    ids = A.prompt_of(req)
    assert isinstance(ids, np.ndarray) and ids.dtype == np.int64 and ids.tolist() == [5, 17, 3]
    assert req.max_tokens == 4


def test_a_long_token_id_prompt_reads_exactly():
    import json

    import numpy as np

    ids = np.random.default_rng(3).integers(0, 2**31, 50_000).tolist() + [0, 10**18]
    req = A.decode_completion(json.dumps({"prompt": ids}).encode())
    assert A.prompt_of(req).tolist() == ids


@pytest.mark.parametrize(
    "prompt, kept",
    [
        ([1, -2, 3], [1, -2, 3]),  # a sign: the generic decode, then the server's range check (400)
        ("text", "text"),
        (["a"], "a"),
        ([[1, 2]], [1, 2]),  # a one-element batch of token ids
    ],
)
def test_other_prompts_take_the_generic_decode(prompt, kept):
    import json

    req = A.decode_completion(json.dumps({"prompt": prompt}).encode())
    assert type(req) is A.CompletionRequest and A.prompt_of(req) == kept


@pytest.mark.parametrize("prompt", ["[1.5, 2]", "[true]", "[1e3]", '[1, "2"]'])
def test_token_ids_that_are_not_integers_are_refused(prompt):
    with pytest.raises(A.ApiError) as err:
        A.validate(A.decode_completion(b'{"prompt": ' + prompt.encode() + b"}"))
    assert err.value.status == 400 and err.value.param == "prompt"
