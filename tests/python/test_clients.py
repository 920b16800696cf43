"""The worker speaks to real third-party clients unchanged: tritonclient over the Open
Inference Protocol (gRPC, unary and streaming) and the openai SDK (completions and chat,
streaming and not), serving SmolLM2-135M-Instruct."""

import queue

import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from conftest import MODEL_NAME

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def triton(worker):
    client = grpcclient.InferenceServerClient(url=worker.grpc)
    yield client
    client.close()


@pytest.fixture(scope="module")
def oai(worker):
    return openai.OpenAI(base_url=f"{worker.http}/v1", api_key="unused", max_retries=0)


def text_input(text: str):
    tensor = grpcclient.InferInput("text_input", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
    return tensor


def test_triton_health_and_metadata(triton):
    assert triton.is_server_live()
    assert triton.is_server_ready()
    assert triton.is_model_ready(MODEL_NAME)
    assert triton.get_server_metadata().name == "npufleet-worker"
    metadata = triton.get_model_metadata(MODEL_NAME)
    assert [t.name for t in metadata.inputs] == ["text_input", "input_ids"]
    assert [t.name for t in metadata.outputs] == ["text_output", "output_ids"]
    with pytest.raises(InferenceServerException, match="not served here"):
        triton.get_model_metadata("no-such-model")


def test_triton_infer_and_stream_agree(triton):
    parameters = {"max_tokens": 8, "temperature": 0}
    result = triton.infer(MODEL_NAME, [text_input(PROMPT)], parameters=parameters)
    text = result.as_numpy("text_output")[0].decode()
    ids = result.as_numpy("output_ids")
    assert "Paris" in text
    assert 1 <= len(ids) <= 8

    responses = queue.Queue()
    triton.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        triton.async_stream_infer(
            MODEL_NAME,
            [text_input(PROMPT)],
            request_id="stream-1",
            parameters=parameters,
            enable_empty_final_response=True,
        )
        chunks = []
        while True:
            result, error = responses.get(timeout=60)
            assert error is None, error
            response = result.get_response()
            assert response.id == "stream-1"
            chunks.append(result.as_numpy("text_output")[0].decode())
            if response.parameters["triton_final_response"].bool_param:
                break
    finally:
        triton.stop_stream()
    assert len(chunks) >= 2
    assert "".join(chunks) == text


def test_triton_rejects_a_wrong_datatype(triton):
    tensor = grpcclient.InferInput("text_input", [1], "FP32")
    tensor.set_data_from_numpy(np.array([1.0], dtype=np.float32))
    with pytest.raises(InferenceServerException, match="datatype BYTES"):
        triton.infer(MODEL_NAME, [tensor])


def test_openai_completions(oai):
    completion = oai.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0)
    text = completion.choices[0].text
    assert "Paris" in text
    assert completion.usage.completion_tokens <= 8

    pieces = []
    usage = None
    for chunk in oai.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
        if chunk.usage:
            usage = chunk.usage
    assert "".join(pieces) == text
    assert usage.completion_tokens == completion.usage.completion_tokens


def test_openai_chat(oai):
    messages = [{"role": "user", "content": "Say hello."}]
    # The first request puts the prompt into the prefix cache; the streamed request below
    # reuses it, so compare it with a request that reused it too.
    oai.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1, temperature=0)
    chat = oai.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    answer = chat.choices[0].message.content
    assert answer
    assert chat.choices[0].finish_reason in ("stop", "length")

    stream = oai.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0, stream=True
    )
    deltas = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert "".join(deltas) == answer


def test_openai_errors(oai):
    with pytest.raises(openai.NotFoundError, match="not served here"):
        oai.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="n = 1"):
        oai.completions.create(model=MODEL_NAME, prompt="x", max_tokens=1, n=2)
