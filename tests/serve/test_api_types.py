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
