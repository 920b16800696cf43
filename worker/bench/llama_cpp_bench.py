"""llama.cpp side of `npufleet-worker bench`.

Runs the same GGUF with the same thread count and the same prompt token ids as the worker's
benchmark, through llama-cpp-python's low-level API (one llama_decode per engine step, greedy
next tokens), and prints one JSON object:

  prefill_tok_s, ttft_ms (500-token prompt), decode_tok_s (batch 1),
  aggregate_tok_s {batch: tok/s} for concurrent sequences, skipped {batch: reason} for batch
  sizes llama.cpp cannot run in one context, peak_rss_bytes, llama_cpp_version.

Usage: llama_cpp_bench.py --model M --threads T --prompts prompts.json
where prompts.json holds {"prefill": [[ids...], ...], "short": [[ids...], ...],
"batch_sizes": [...], "decode_tokens": N, "repeats": R}; each decode figure is the
median of R runs.
"""

import argparse
import ctypes
import json
import time

import llama_cpp
import numpy as np

# llama.cpp's LLAMA_MAX_SEQ: a context holds at most this many sequences.
MAX_SEQUENCES = 64


@llama_cpp.llama_log_callback
def _discard_log(_level, _text, _user_data):
    pass


def vm_hwm_bytes():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def median_of(repeats, measure):
    """The median of `repeats` runs of `measure` (rates or times), as the worker's side
    reports."""
    rates = sorted(measure() for _ in range(repeats))
    return rates[len(rates) // 2]


class Context:
    def __init__(self, model, threads, n_ctx, n_seq, n_batch):
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = n_batch
        params.n_seq_max = n_seq
        params.n_threads = threads
        params.n_threads_batch = threads
        params.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(model, params)
        if not self.ctx:
            raise RuntimeError("llama_init_from_model failed")
        self.n_batch = n_batch
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, n_seq)

    def close(self):
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)

    def clear(self):
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)

    def decode(self, items):
        """items: (token, position, sequence, want_logits). Returns the greedy next token of
        every item with want_logits, in order."""
        batch = self.batch
        for i, (token, pos, seq, logits) in enumerate(items):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = 1 if logits else 0
        batch.n_tokens = len(items)
        rc = llama_cpp.llama_decode(self.ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        n_out = sum(1 for item in items if item[3])
        if n_out == 0:
            return []
        pointer = llama_cpp.llama_get_logits(self.ctx)
        rows = np.ctypeslib.as_array(
            ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), shape=(n_out, self.n_vocab)
        )
        return rows.argmax(axis=1).tolist()

    def prefill(self, prompts):
        """Prefills one prompt per sequence id in chunks of n_batch tokens; returns the first
        generated token of each."""
        items = [
            (tok, pos, seq, pos == len(prompt) - 1)
            for seq, prompt in enumerate(prompts)
            for pos, tok in enumerate(prompt)
        ]
        firsts = []
        for start in range(0, len(items), self.n_batch):
            firsts += self.decode(items[start : start + self.n_batch])
        return firsts


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--prompts", required=True)
    args = parser.parse_args()
    with open(args.prompts) as f:
        spec = json.load(f)
    decode_tokens = spec["decode_tokens"]
    repeats = spec.get("repeats", 1)

    llama_cpp.llama_log_set(_discard_log, ctypes.c_void_p(0))
    llama_cpp.llama_backend_init()
    model_params = llama_cpp.llama_model_default_params()
    load_started = time.perf_counter()
    model = llama_cpp.llama_model_load_from_file(args.model.encode(), model_params)
    load_s = time.perf_counter() - load_started
    if not model:
        raise SystemExit(f"cannot load {args.model}")

    # Prefill and time to first token of a long prompt.
    longest = max(len(p) for p in spec["prefill"])
    ctx = Context(model, args.threads, n_ctx=max(1024, longest + 16), n_seq=1, n_batch=512)
    ctx.clear()
    ctx.prefill([spec["short"][0]])
    prefill_prompts = iter(spec["prefill"])

    def time_to_first_token():
        ctx.clear()
        started = time.perf_counter()
        ctx.prefill([next(prefill_prompts)])
        return time.perf_counter() - started

    ttft = median_of(len(spec["prefill"]), time_to_first_token)
    prefill_len = len(spec["prefill"][0])

    # Batch-1 decode.
    def batch_one():
        prompt = spec["short"][0]
        ctx.clear()
        token = ctx.prefill([prompt])[0]
        pos = len(prompt)
        started = time.perf_counter()
        for _ in range(decode_tokens):
            token = ctx.decode([(token, pos, 0, True)])[0]
            pos += 1
        return decode_tokens / (time.perf_counter() - started)

    decode_tok_s = median_of(repeats, batch_one)
    ctx.close()

    # Aggregate decode over concurrent sequences: every step decodes one token of each.
    aggregate = {}
    skipped = {}
    for n in spec["batch_sizes"]:
        if n > MAX_SEQUENCES:
            skipped[str(n)] = f"llama.cpp holds at most {MAX_SEQUENCES} sequences per context"
            continue
        prompts = spec["short"][:n]
        per_seq = max(len(p) for p in prompts) + decode_tokens + 1
        ctx = Context(model, args.threads, n_ctx=n * per_seq, n_seq=n, n_batch=max(512, n))

        def concurrent():
            ctx.clear()
            tokens = ctx.prefill(prompts)
            positions = [len(p) for p in prompts]
            started = time.perf_counter()
            for _ in range(decode_tokens):
                tokens = ctx.decode(
                    [(tokens[s], positions[s], s, True) for s in range(n)]
                )
                positions = [p + 1 for p in positions]
            return n * decode_tokens / (time.perf_counter() - started)

        aggregate[str(n)] = median_of(repeats, concurrent)
        ctx.close()

    llama_cpp.llama_model_free(model)
    print(
        json.dumps(
            {
                "llama_cpp_version": llama_cpp.__version__,
                "load_s": load_s,
                "prefill_tok_s": prefill_len / ttft,
                "ttft_ms": ttft * 1000.0,
                "decode_tok_s": decode_tok_s,
                "aggregate_tok_s": aggregate,
                "skipped": skipped,
                "peak_rss_bytes": vm_hwm_bytes(),
            }
        )
    )


if __name__ == "__main__":
    main()
