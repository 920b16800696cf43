"""How often the worker's greedy output agrees with llama.cpp's on the same GGUF file.

For a fixed list of raw and chat prompts, llama.cpp (through llama-cpp-python) tokenises the
prompt (chat prompts rendered with the file's chat template by llama-cpp-python's Jinja2
formatter) and greedily generates N tokens. The worker is started afresh per precision and
prompt (`npufleet-worker serve --ignore-eos`, loopback ports chosen by the OS) and asked
three times:

  * with llama.cpp's prompt token ids (Open Inference Protocol REST, `input_ids`) on a fresh
    cache, which compares the forward passes alone: generated ids, first diverging position,
    texts, llama.cpp's logit margin at the divergence, and the top-1 agreement when llama.cpp
    is teacher-forced on the worker's tokens;
  * through its own prompt path (raw text as `text_input`, chat messages through
    `/v1/chat/completions`), which checks the worker's tokeniser and chat template: the
    prompt token count must equal llama.cpp's and the output must equal that of
  * the same ids again, now served with the prompt prefix in the worker's prefix cache (as
    the own-path request was); comparing it with the first run shows whether the output
    depends on the cache state.

Both engines are also compared with an independent f32 implementation (the numpy reference
of the worker's tests, `tests/reference/llama_numpy.py`, over the same tensors dequantised
by the `gguf` package) greedily decoding the same prompt ids: that tells whether a
difference between the two is one engine straying from exact arithmetic or both.

Agreement below 100% is a finding, not an error: the exit status is non-zero only when
something fails to run.

Usage: llama_cpp_agreement.py --worker PATH/TO/npufleet-worker --model MODEL.gguf
       [--precisions int8,fp32] [--tokens 32] [--threads N] [--json RESULT.json]
"""

import argparse
import ctypes
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

import llama_cpp
import numpy as np
from llama_cpp import Llama
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

# (name, kind, prompt): a raw prompt is text; a chat prompt is a list of messages.
PROMPTS = [
    ("capital", "raw", "The capital of France is"),
    ("code", "raw", "def fibonacci(n):\n    "),
    ("counting", "raw", "1, 2, 3, 4, 5, 6,"),
    ("story", "raw", "Once upon a time, in a small village by the sea,"),
    ("qa", "raw", "Q: What is the boiling point of water in Celsius?\nA:"),
    ("french", "raw", "L'été à Montréal, c'est"),
    (
        "paragraph",
        "raw",
        "Photosynthesis is the process by which green plants, algae and some bacteria turn "
        "light into chemical energy. In the chloroplasts, chlorophyll absorbs mostly red and "
        "blue light, and the energy drives the splitting of water into oxygen, protons and "
        "electrons. The electrons pass along a transport chain that pumps protons across a "
        "membrane, and the resulting gradient powers the synthesis of ATP. In the Calvin "
        "cycle, the plant then",
    ),
    ("chat-capital", "chat", [{"role": "user", "content": "What is the capital of France?"}]),
    (
        "chat-system",
        "chat",
        [
            {"role": "system", "content": "You are a concise assistant. Answer in one sentence."},
            {"role": "user", "content": "Why is the sky blue?"},
        ],
    ),
    (
        "chat-code",
        "chat",
        [{"role": "user", "content": "Write a Python function that reverses a string."}],
    ),
    (
        "chat-multiturn",
        "chat",
        [
            {"role": "user", "content": "Hi! My name is Ana."},
            {"role": "assistant", "content": "Hello Ana! How can I help you today?"},
            {"role": "user", "content": "What is my name?"},
        ],
    ),
    ("chat-list", "chat", [{"role": "user", "content": "List three primary colors."}]),
    (
        "chat-translate",
        "chat",
        [{"role": "user", "content": "Translate 'good morning' into Spanish."}],
    ),
]

SERVED_NAME = "agreement"


@llama_cpp.llama_log_callback
def _discard_log(_level, _text, _user_data):
    pass


class Reference:
    """llama.cpp over the model file: tokenisation, chat template, greedy decoding."""

    def __init__(self, model_path, threads, n_ctx):
        llama_cpp.llama_log_set(_discard_log, ctypes.c_void_p(0))
        self.llm = Llama(
            model_path,
            n_ctx=n_ctx,
            n_threads=threads,
            n_threads_batch=threads,
            logits_all=True,
            verbose=False,
        )
        template = self.llm.metadata.get("tokenizer.chat_template")
        if template is None:
            raise ValueError(f"{model_path} has no chat template (tokenizer.chat_template)")
        self.formatter = Jinja2ChatFormatter(
            template=template,
            eos_token=self.detokenize([self.llm.token_eos()]),
            bos_token=self.detokenize([self.llm.token_bos()]),
        )

    def prompt_text(self, kind, prompt):
        if kind == "raw":
            return prompt
        return self.formatter(messages=prompt).prompt

    def tokenize(self, text):
        # add_bos=True means "add what the vocabulary asks for", as llama.cpp's own tools do.
        return self.llm.tokenize(text.encode(), add_bos=True, special=True)

    def detokenize(self, ids):
        return self.llm.detokenize(ids, special=True).decode("utf-8", errors="replace")

    def logits_after(self, prompt_ids, continuation):
        """Logits predicting each token of `continuation`, all from one batched pass."""
        self.llm.reset()
        self.llm.eval(prompt_ids + continuation[:-1])
        start = len(prompt_ids) - 1
        return np.array(self.llm.scores[start : start + len(continuation)])

    def greedy(self, prompt_ids, n_tokens):
        self.llm.reset()
        self.llm.eval(prompt_ids)
        out = []
        while True:
            token = int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))
            out.append(token)
            if len(out) == n_tokens:
                return out
            self.llm.eval([token])


class Worker:
    """An `npufleet-worker serve` process on loopback ports the OS picks."""

    def __init__(self, binary, model_path, precision, threads, ready_timeout):
        command = [
            binary, "serve",
            "--model", model_path,
            "--served-model-name", SERVED_NAME,
            "--http-addr", "127.0.0.1:0",
            "--grpc-addr", "127.0.0.1:0",
            "--accelerator", "cpu",
            "--precision", precision,
            "--threads", str(threads),
            "--warmup-iterations", "0",
            "--ignore-eos",
            "--log-format", "json",
        ]  # fmt: skip
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.log = []
        lines = queue.Queue()
        threading.Thread(target=self._read_log, args=(lines,), daemon=True).start()
        try:
            self.base_url = self._wait_ready(lines, time.monotonic() + ready_timeout)
        except BaseException:
            self.stop()
            raise

    def _read_log(self, lines):
        for line in self.process.stdout:
            self.log.append(line.rstrip())
            lines.put(line)
        lines.put(None)

    def _failure(self, what):
        tail = "\n".join(self.log[-20:])
        return RuntimeError(f"the worker {what}; its last log lines:\n{tail}")

    def _wait_ready(self, lines, deadline):
        address = None
        while address is None:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise self._failure("did not report its listening address in time") from None
            if line is None:
                raise self._failure(f"exited with status {self.process.wait()} while starting")
            try:
                fields = json.loads(line)
            except json.JSONDecodeError:
                continue
            address = fields.get("http")
        base_url = f"http://{address}"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise self._failure(f"exited with status {self.process.returncode}")
            try:
                with urllib.request.urlopen(f"{base_url}/v2/health/ready", timeout=5) as reply:
                    if reply.status == 200:
                        return base_url
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        raise self._failure("did not become ready in time")

    def stop(self):
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def post(self, path, body):
        request = urllib.request.Request(
            self.base_url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=300) as reply:
                return json.load(reply)
        except urllib.error.HTTPError as err:
            raise RuntimeError(
                f"POST {path} failed with {err.code}: {err.read().decode()}"
            ) from None

    def infer(self, prompt_input, n_tokens):
        """Open Inference Protocol REST: returns (output ids, text, prompt token count)."""
        reply = self.post(
            f"/v2/models/{SERVED_NAME}/infer",
            {
                "parameters": {"max_tokens": n_tokens, "temperature": 0},
                "inputs": [prompt_input],
                "outputs": [{"name": "output_ids"}, {"name": "text_output"}],
            },
        )
        outputs = {o["name"]: o["data"] for o in reply["outputs"]}
        return (
            outputs["output_ids"],
            outputs["text_output"][0],
            reply["parameters"]["prompt_tokens"],
        )

    def generate_ids(self, prompt_ids, n_tokens):
        return self.infer(
            {
                "name": "input_ids",
                "datatype": "INT64",
                "shape": [len(prompt_ids)],
                "data": prompt_ids,
            },
            n_tokens,
        )

    def generate_text(self, text, n_tokens):
        return self.infer(
            {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [text]}, n_tokens
        )

    def chat(self, messages, n_tokens):
        """OpenAI chat completion: returns (text, prompt token count)."""
        reply = self.post(
            "/v1/chat/completions",
            {"model": SERVED_NAME, "messages": messages, "max_tokens": n_tokens, "temperature": 0},
        )
        return reply["choices"][0]["message"]["content"], reply["usage"]["prompt_tokens"]


def first_divergence(a, b):
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(reference, case, worker, n_tokens):
    """One prompt on one worker: llama.cpp's prompt ids on a fresh cache, the worker's own
    prompt path, the ids again (now with the prompt prefix cached), and llama.cpp's view."""
    ids, text, _ = worker.generate_ids(case["prompt_ids"], n_tokens)
    if case["kind"] == "raw":
        own_ids, own_text, own_count = worker.generate_text(case["prompt_text"], n_tokens)
    else:
        own_text, own_count = worker.chat(case["messages"], n_tokens)
    # The own-path request was served with the prompt prefix cached, so it is compared with
    # an ids request in the same cache state: a difference then means different prompt tokens.
    cached_ids, cached_text, _ = worker.generate_ids(case["prompt_ids"], n_tokens)
    own_same = own_ids == cached_ids if case["kind"] == "raw" else own_text == cached_text
    diverges_at = first_divergence(case["reference_ids"], ids)
    logits = reference.logits_after(case["prompt_ids"], ids)
    top1 = logits.argmax(axis=1)
    result = {
        "identical": diverges_at is None,
        "first_divergence": diverges_at,
        "matching_prefix": n_tokens if diverges_at is None else diverges_at,
        "teacher_forced_top1": float(np.mean(top1 == np.array(ids))),
        "same_as_f32_reference": ids == case["f32_reference_ids"],
        "worker_ids": ids,
        "worker_text": text,
        "same_with_cached_prefix": cached_ids == ids,
        "cached_prefix_ids": cached_ids,
        "own_path_prompt_tokens": own_count,
        "own_path_same_output": own_same and own_count == len(case["prompt_ids"]),
        "own_path_text": own_text,
    }
    if diverges_at is not None:
        # Both sides saw the same prefix up to here, so this is llama.cpp's own margin for it.
        row = logits[diverges_at]
        result["margin_at_divergence"] = float(row[top1[diverges_at]] - row[ids[diverges_at]])
    return result


def print_case(case, precision, result):
    status = "identical" if result["identical"] else f"diverges at {result['first_divergence']}"
    print(
        f"[{precision}] {case['name']} ({case['kind']}, {len(case['prompt_ids'])} prompt "
        f"tokens): {status}, teacher-forced top-1 {result['teacher_forced_top1']:.0%}"
    )
    if not result["identical"]:
        print(
            f"    llama.cpp margin at the divergence: {result['margin_at_divergence']:.3f} logits"
        )
        print(f"    llama.cpp: {case['reference_text']!r}")
        print(f"    worker:    {result['worker_text']!r}")
    if not result["same_with_cached_prefix"]:
        at = first_divergence(result["worker_ids"], result["cached_prefix_ids"])
        print(f"    the worker's output changes at {at} when the prompt prefix is cached")
    if not result["own_path_same_output"]:
        print(
            f"    own prompt path differs: {result['own_path_prompt_tokens']} prompt tokens, "
            f"output {result['own_path_text']!r}"
        )


F32_REFERENCE = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "tests", "reference", "llama_numpy.py"
)


def f32_reference_ids(model, prompts, n_tokens, cache_dir):
    """Greedy ids of the independent f32 numpy implementation for each prompt."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
        prompts_path = f.name
    try:
        out = subprocess.run(
            [sys.executable, F32_REFERENCE, model, prompts_path, str(n_tokens), cache_dir],
            check=True,
            capture_output=True,
            text=True,
        )
    except subprocess.CalledProcessError as err:
        raise RuntimeError(f"the f32 reference failed: {err.stderr}") from err
    finally:
        os.unlink(prompts_path)
    with open(out.stdout.strip()) as f:
        results = json.load(f)["results"]
    return [[step["token"] for step in r["steps"]] for r in results]


def summary_rows(results):
    rows = []
    for precision, per_prompt in results.items():
        count = len(per_prompt)
        rows.append(
            {
                "precision": precision,
                "identical": sum(r["identical"] for r in per_prompt),
                "prompts": count,
                "mean_matching_prefix": sum(r["matching_prefix"] for r in per_prompt) / count,
                "teacher_forced_top1": sum(r["teacher_forced_top1"] for r in per_prompt) / count,
                "own_path_same": sum(r["own_path_same_output"] for r in per_prompt),
                "same_as_f32_reference": sum(r["same_as_f32_reference"] for r in per_prompt),
                "cache_stable": sum(r["same_with_cached_prefix"] for r in per_prompt),
            }
        )
    return rows


def print_summary(rows, n_tokens, self_agreement, reference_vs_f32):
    print()
    print(
        f"| precision | identical {n_tokens}-token outputs | mean matching prefix "
        f"| teacher-forced top-1 | own prompt path = llama.cpp prompt "
        f"| same output with prefix cached | identical to the f32 reference |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['precision']} | {row['identical']}/{row['prompts']} "
            f"| {row['mean_matching_prefix']:.1f}/{n_tokens} | {row['teacher_forced_top1']:.1%} "
            f"| {row['own_path_same']}/{row['prompts']} | {row['cache_stable']}/{row['prompts']} "
            f"| {row['same_as_f32_reference']}/{row['prompts']} |"
        )
    same, count, prefix = reference_vs_f32
    print(
        f"\nllama.cpp teacher-forced on its own greedy output (batched re-evaluation): "
        f"{self_agreement:.1%} top-1 agreement"
    )
    print(
        f"llama.cpp against the f32 reference: {same}/{count} identical {n_tokens}-token "
        f"outputs, mean matching prefix {prefix:.1f}/{n_tokens}"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", required=True, help="the npufleet-worker binary")
    parser.add_argument("--model", required=True, help="the GGUF file")
    parser.add_argument(
        "--precisions", default="int8,fp32", help="comma-separated worker precisions"
    )
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count(), help="compute threads for both"
    )
    parser.add_argument(
        "--ready-timeout", type=float, default=120.0, help="seconds to wait for the worker"
    )
    parser.add_argument("--json", help="also write every result to this file")
    args = parser.parse_args()
    if args.tokens < 1:
        parser.error("--tokens must be at least 1")
    for path in (args.worker, args.model):
        if not os.path.isfile(path):
            parser.error(f"no such file: {path}")

    reference = Reference(args.model, args.threads, n_ctx=1024)
    cases = []
    self_agreement = []
    for name, kind, prompt in PROMPTS:
        text = reference.prompt_text(kind, prompt)
        prompt_ids = reference.tokenize(text)
        reference_ids = reference.greedy(prompt_ids, args.tokens)
        top1 = reference.logits_after(prompt_ids, reference_ids).argmax(axis=1)
        self_agreement.append(float(np.mean(top1 == np.array(reference_ids))))
        cases.append(
            {
                "name": name,
                "kind": kind,
                "messages": prompt if kind == "chat" else None,
                "prompt_text": text,
                "prompt_ids": prompt_ids,
                "reference_ids": reference_ids,
                "reference_text": reference.detokenize(reference_ids),
            }
        )

    with tempfile.TemporaryDirectory() as cache_dir:
        f32_ids = f32_reference_ids(
            args.model, [case["prompt_ids"] for case in cases], args.tokens, cache_dir
        )
    for case, ids in zip(cases, f32_ids):
        case["f32_reference_ids"] = ids
    reference_prefixes = [
        args.tokens if at is None else at
        for at in (first_divergence(c["f32_reference_ids"], c["reference_ids"]) for c in cases)
    ]
    reference_vs_f32 = (
        sum(p == args.tokens for p in reference_prefixes),
        len(cases),
        sum(reference_prefixes) / len(cases),
    )

    results = {}
    for precision in args.precisions.split(","):
        results[precision] = []
        for case in cases:
            # A new worker per prompt, so the first request meets an empty prefix cache (the
            # chat prompts share their system-prompt prefix).
            worker = Worker(args.worker, args.model, precision, args.threads, args.ready_timeout)
            try:
                result = compare(reference, case, worker, args.tokens)
            finally:
                worker.stop()
            print_case(case, precision, result)
            results[precision].append(result)

    rows = summary_rows(results)
    mean_self = sum(self_agreement) / len(self_agreement)
    print_summary(rows, args.tokens, mean_self, reference_vs_f32)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                {
                    "tokens": args.tokens,
                    "threads": args.threads,
                    "cases": cases,
                    "results": results,
                    "summary": rows,
                    "llama_cpp_self_agreement": mean_self,
                    "llama_cpp_vs_f32_reference": {
                        "identical": reference_vs_f32[0],
                        "mean_matching_prefix": reference_vs_f32[2],
                    },
                },
                out,
                indent=1,
            )


if __name__ == "__main__":
    try:
        main()
    except (RuntimeError, OSError, KeyError, ValueError) as err:
        sys.exit(f"error: {err}")
