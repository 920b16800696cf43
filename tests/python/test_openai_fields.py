"""The OpenAI API's and vLLM's request fields through the openai SDK, as a demanding client
sends them: each sampling field changes the answer the way vLLM's does, what the worker does
not do is refused by name, and every 400 names its field in `param`."""

import numpy as np
import openai
import pytest
import requests
import tritonclient.grpc as grpcclient

from conftest import MODEL_NAME

HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def oai(worker):
    return openai.OpenAI(base_url=f"{worker.http}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def plain(oai):
    """The greedy answer to HELLO with no extra field."""
    return oai.chat.completions.create(
        model=MODEL_NAME, messages=HELLO, temperature=0, max_tokens=80
    )


def hello(oai, **fields):
    extra = {k: fields.pop(k) for k in list(fields) if k not in ("max_tokens", "temperature", "stop")}
    return oai.chat.completions.create(
        model=MODEL_NAME,
        messages=HELLO,
        temperature=fields.pop("temperature", 0),
        max_tokens=fields.pop("max_tokens", 80),
        extra_body=extra,
        **fields,
    )


def test_min_tokens_holds_off_the_end(oai, plain):
    assert plain.usage.completion_tokens < 60, "the plain answer ends early on its own"
    assert plain.choices[0].finish_reason == "stop"
    longer = hello(oai, min_tokens=60)
    assert longer.usage.completion_tokens >= 60
    assert longer.choices[0].message.content.startswith(plain.choices[0].message.content.rstrip())

    completion = oai.completions.create(
        model=MODEL_NAME,
        prompt="The capital of France is",
        temperature=0,
        max_tokens=30,
        extra_body={"min_tokens": 30, "stop": ["."]},
    )
    assert completion.usage.completion_tokens == 30
    assert completion.choices[0].finish_reason == "length"


def test_ignore_eos_generates_exactly_max_tokens(oai):
    answer = hello(oai, ignore_eos=True, max_tokens=40)
    assert answer.usage.completion_tokens == 40
    assert answer.choices[0].finish_reason == "length"
    assert "<|im_end|>" not in answer.choices[0].message.content


@pytest.mark.parametrize(
    "field",
    [
        {"repetition_penalty": 2.0},
        {"presence_penalty": 2.0},
        {"frequency_penalty": 2.0},
    ],
)
def test_penalties_change_the_answer(oai, plain, field):
    assert hello(oai, **field).choices[0].message.content != plain.choices[0].message.content


def test_cuts_that_leave_one_candidate_are_greedy(oai, plain):
    for field in ({"min_p": 1.0}, {"top_k": 1}):
        sampled = hello(oai, temperature=1.5, seed=3, **field)
        assert sampled.choices[0].message.content == plain.choices[0].message.content, field


def test_more_than_four_stop_strings(oai, plain):
    text = plain.choices[0].message.content
    stop = text.split()[2]
    cut = oai.chat.completions.create(
        model=MODEL_NAME,
        messages=HELLO,
        temperature=0,
        max_tokens=80,
        stop=["zq1", "zq2", "zq3", "zq4", "zq5", stop],
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[: text.index(stop)]


def test_oip_parameters_set_the_same_fields(worker):
    client = grpcclient.InferenceServerClient(url=worker.grpc)
    try:
        tensor = grpcclient.InferInput("text_input", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([b"The capital of France is"], dtype=np.object_))
        result = client.infer(
            MODEL_NAME,
            [tensor],
            parameters={"max_tokens": 12, "min_tokens": 12, "ignore_eos": True, "temperature": 0},
        )
        assert len(result.as_numpy("output_ids")) == 12
    finally:
        client.close()

    body = {
        "parameters": {"max_tokens": 4, "repetition_penalty": -1},
        "inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["hi"]}],
    }
    response = requests.post(f"{worker.http}/v2/models/{MODEL_NAME}/infer", json=body, timeout=60)
    assert response.status_code == 400
    assert "repetition_penalty" in response.json()["error"]


REFUSED = [
    # What the worker cannot honour, refused by name.
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"n": 2}, "n"),
    ({"logit_bias": {"1": 5}}, "logit_bias"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    # Type errors.
    ({"max_tokens": -1}, "max_tokens"),
    ({"temperature": "NaN"}, "temperature"),
    ({"seed": 1e30}, "seed"),
    ({"min_tokens": "many"}, "min_tokens"),
    # Range errors the engine finds.
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 100000}, "max_tokens"),
    ({"max_completion_tokens": 100000}, "max_completion_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": 1e39}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"min_p": 2}, "min_p"),
    ({"min_tokens": 90}, "min_tokens"),
]


@pytest.mark.parametrize("fields,param", REFUSED, ids=[p for _, p in REFUSED])
def test_chat_errors_name_their_field(oai, fields, param):
    with pytest.raises(openai.BadRequestError) as refused:
        oai.chat.completions.create(
            model=MODEL_NAME, messages=HELLO, extra_body={"max_tokens": 80, **fields}
        )
    error = refused.value
    assert error.status_code == 400
    assert error.param == param, error.message
    assert error.type == "invalid_request_error"
    assert error.code == "invalid_request"
    assert param.split("[")[0] in error.message


def test_completion_errors_name_their_field(oai):
    for extra, param in [
        ({"prompt": [[10**9]]}, "prompt"),
        ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "hi", "echo": True}, "echo"),
    ]:
        with pytest.raises(openai.BadRequestError) as refused:
            oai.completions.create(model=MODEL_NAME, prompt="unused", extra_body=extra)
        assert refused.value.param == param, refused.value.message
