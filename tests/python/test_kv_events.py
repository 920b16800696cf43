"""The worker's prefix-cache events read the way vLLM's consumers read them: pyzmq sockets
and msgspec decoders of vLLM's published layout (msgspec `array_like` structs with a `tag`,
as vLLM's publisher encodes them and llm-d's indexer decodes them).

The consumer binds and the worker connects to it, as with llm-d's endpoint picker."""

import time
from typing import Optional, Union

import msgspec
import pytest
import requests
import zmq

from conftest import MODEL_NAME, running_worker

BLOCK_SIZE = 16
POD_IP = "198.18.0.7"


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: Optional[str]


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: Optional[int] = None


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


@pytest.fixture(scope="module")
def publishing():
    context = zmq.Context()
    subscriber = context.socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"kv@")
    port = subscriber.bind_to_random_port("tcp://127.0.0.1")
    try:
        with running_worker(
            f"--kv-events-endpoint=tcp://127.0.0.1:{port}",
            "--kv-events-replay-endpoint=tcp://127.0.0.1:0",
            f"--block-size={BLOCK_SIZE}",
            env={"POD_IP": POD_IP},
        ) as worker:
            replay = next(
                line["endpoint"]
                for line in worker.log
                if line.get("message") == "replaying KV events"
            )
            yield worker, context, subscriber, replay
    finally:
        subscriber.close(linger=0)
        context.term()


def complete(worker, prompt):
    response = requests.post(
        f"{worker.http}/v1/completions",
        json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1},
        timeout=60,
    )
    assert response.status_code == 200, response.text


def replay_from(context, endpoint, start):
    """Every batch from `start` on, as (seq, batch), read from the replay socket."""
    dealer = context.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        batches = []
        while True:
            assert dealer.poll(30_000), "no answer from the replay socket"
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == END_OF_REPLAY:
                assert payload == b""
                return batches
            batches.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
    finally:
        dealer.close(linger=0)


def stored_tokens(batches):
    """Each stored block's hash mapped to its token ids."""
    blocks = {}
    for _, batch in batches:
        for event in batch.events:
            if isinstance(event, BlockStored):
                assert event.block_size == BLOCK_SIZE
                assert len(event.token_ids) == len(event.block_hashes) * BLOCK_SIZE
                for i, block in enumerate(event.block_hashes):
                    blocks[block] = event.token_ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
    return blocks


def test_a_prompts_blocks_arrive_as_one_chain_with_their_tokens_under_llm_ds_topic(publishing):
    worker, _, subscriber, _ = publishing
    # The worker connects to this socket in the background, and a batch published before
    # the connection and subscription are through reaches nobody: prompts are sent, each
    # storing new blocks, until one's blocks are seen.
    deadline = time.monotonic() + 60
    seen = []
    stored = None
    attempt = 0
    while stored is None:
        assert time.monotonic() < deadline, "no stored blocks were published"
        prompt = [1000 + attempt * 64 + i for i in range(3 * BLOCK_SIZE + 5)]
        attempt += 1
        complete(worker, prompt)
        wait_until = time.monotonic() + 5
        while stored is None and subscriber.poll(max(0, int((wait_until - time.monotonic()) * 1000))):
            topic, seq, payload = subscriber.recv_multipart()
            assert topic == f"kv@{POD_IP}@{MODEL_NAME}".encode()
            assert len(seq) == 8
            batch = DECODER.decode(payload)
            seen.append(int.from_bytes(seq, "big"))
            stored = next(
                (
                    event
                    for event in batch.events
                    if isinstance(event, BlockStored) and event.token_ids[:BLOCK_SIZE] == prompt[:BLOCK_SIZE]
                ),
                None,
            )
    assert seen == sorted(set(seen)), f"sequence numbers not increasing: {seen}"
    assert stored.token_ids == prompt[: 3 * BLOCK_SIZE], "the three full blocks, in order"
    assert len(stored.block_hashes) == 3
    assert stored.parent_block_hash is None
    assert stored.medium == "GPU"


def test_replay_from_the_start_leads_with_the_empty_cache_and_chains_every_block(publishing):
    worker, context, _, replay = publishing
    prompt = [2000 + i for i in range(2 * BLOCK_SIZE + 1)]
    complete(worker, prompt)
    # The engine publishes after its step; the replay shows it once the publisher has sent it.
    deadline = time.monotonic() + 30
    while True:
        batches = replay_from(context, replay, 0)
        tokens = stored_tokens(batches)
        if prompt[:BLOCK_SIZE] in tokens.values():
            break
        assert time.monotonic() < deadline, "the prompt's blocks never reached the replay"
    assert batches[0][0] == 0
    assert isinstance(batches[0][1].events[0], AllBlocksCleared), "a fresh worker holds nothing"
    assert [seq for seq, _ in batches] == list(range(len(batches)))
    # Every stored block's parent was stored before it.
    known = set()
    for _, batch in batches:
        for event in batch.events:
            if isinstance(event, BlockStored):
                assert event.parent_block_hash is None or event.parent_block_hash in known
                known.update(event.block_hashes)
    later = replay_from(context, replay, batches[-1][0])
    assert [seq for seq, _ in later][:1] == [batches[-1][0]]


def test_a_replay_request_of_the_wrong_shape_gets_no_answer_and_the_next_one_does(
    publishing,
):
    _, context, _, replay = publishing
    dealer = context.socket(zmq.DEALER)
    dealer.connect(replay)
    try:
        # The socket answers requests in order: were the short one answered, its answer
        # would come first.
        dealer.send_multipart([b"", b"\x00\x01"])
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        assert dealer.poll(30_000), "no answer from the replay socket"
        _, seq, _ = dealer.recv_multipart()
        assert int.from_bytes(seq, "big") == 0, "the first answer is batch 0 of the valid request"
    finally:
        dealer.close(linger=0)
