"""Starts the real npufleet worker serving SmolLM2 for the client tests.

The worker binary comes from NPUFLEET_WORKER_BIN, else target/release or target/debug of this
repository; the model from NPUFLEET_TEST_MODEL, else tests/setup/model.sh.
"""

import contextlib
import json
import os
import pathlib
import queue
import subprocess
import threading
import time

import pytest
import requests

REPO = pathlib.Path(__file__).resolve().parents[2]
MODEL_NAME = "smollm2"


def worker_binary() -> pathlib.Path:
    configured = os.environ.get("NPUFLEET_WORKER_BIN")
    if configured:
        return pathlib.Path(configured)
    for profile in ("release", "debug"):
        candidate = REPO / "target" / profile / "npufleet-worker"
        if candidate.is_file():
            return candidate
    pytest.fail("no npufleet-worker binary: build it or set NPUFLEET_WORKER_BIN")


def model_path() -> str:
    configured = os.environ.get("NPUFLEET_TEST_MODEL")
    if configured:
        return configured
    result = subprocess.run(
        ["bash", str(REPO / "tests" / "setup" / "model.sh")],
        check=True,
        capture_output=True,
        text=True,
    )
    return result.stdout.strip().splitlines()[-1]


class Worker:
    def __init__(self, process, http_addr, grpc_addr):
        self.process = process
        self.http = f"http://{http_addr}"
        self.grpc = grpc_addr


@contextlib.contextmanager
def running_worker(*extra_args, env=None):
    """A worker serving SmolLM2 on loopback ports, ready; its log lines up to "serving" are
    in `log`."""
    process = subprocess.Popen(
        [
            str(worker_binary()),
            "serve",
            f"--model={model_path()}",
            f"--served-model-name={MODEL_NAME}",
            "--grpc-addr=127.0.0.1:0",
            "--http-addr=127.0.0.1:0",
            "--warmup-iterations=2",
            "--accelerator=cpu",
            "--log-format=json",
            *extra_args,
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=None if env is None else {**os.environ, **env},
    )
    lines = queue.Queue()

    def read_log():
        for line in process.stdout:
            try:
                lines.put(json.loads(line))
            except json.JSONDecodeError:
                continue

    threading.Thread(target=read_log, daemon=True).start()
    try:
        log = []
        while not log or log[-1].get("message") != "serving":
            log.append(lines.get(timeout=120))
        started = Worker(process, log[-1]["http"], log[-1]["grpc"])
        started.log = log
        deadline = time.monotonic() + 120
        while True:
            try:
                if requests.get(f"{started.http}/v2/health/ready", timeout=5).ok:
                    break
            except requests.ConnectionError:
                pass
            assert time.monotonic() < deadline, "the worker never became ready"
            assert process.poll() is None, "the worker exited during start-up"
            time.sleep(0.05)
        yield started
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="session")
def worker():
    with running_worker() as started:
        yield started
