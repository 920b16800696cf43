"""llama.cpp side of `npufleet-worker bench`.

Runs the same GGUF with the same thread count and the same prompt token ids as the worker's
benchmark, through llama-cpp-python's low-level API (one llama_decode per engine step, greedy
next tokens). The worker runs this script once and drives it one figure at a time, so the
two engines' runs of every figure alternate (A/B/A/B) on the same machine state.

Protocol: one JSON request a line on stdin, one JSON reply a line on stdout. Every reply is
{"ok": value} or {"error": message}. Requests (the "op" field):

  load {model, threads, first_prompt}: loads the model and makes a one-sequence context;
      replies load_s (file opened to context ready), first_token_s (file opened to the
      first token of first_prompt), version, system_info and the buffer lines llama.cpp
      logged (which buffer type holds the weights, KV cache and compute scratch).
  warmup {prompt}: one untimed prefill.
  ttft {prompt}: seconds from submitting the prompt to its first token.
  decode {prompt, tokens}: batch-1 decode rate over `tokens` steps after the prompt.
  open {sequences, context}: a context holding that many sequences; replies null, or
      {"rejected": llama.cpp's reason} when llama.cpp cannot make one.
  aggregate {prompts, tokens}: aggregate decode rate of one sequence a prompt, `tokens`
      steps of every sequence, in the context `open` made.
  rss: this process's peak RSS (VmHWM) in bytes.
"""

import ctypes
import json
import sys
import time

import llama_cpp
import numpy as np

# Lines llama.cpp logs while loading that say where tensors live.
BUFFER_LOG_MARKERS = ("buffer size", "buffer type")
# llama.cpp logs one line per repacked tensor: "repack: repack tensor NAME with LAYOUT".
REPACK_MARKER = "repack tensor "

log_lines = []


@llama_cpp.llama_log_callback
def _collect_log(_level, text, _user_data):
    log_lines.append(text.decode("utf-8", errors="replace"))


def vm_hwm_bytes():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def buffer_report(lines):
    """The buffer lines, and one line per repacked layout in place of one per tensor."""
    report = [line.strip(". \n") for line in lines if any(m in line for m in BUFFER_LOG_MARKERS)]
    layouts = {}
    for line in lines:
        if REPACK_MARKER in line:
            layout = line.rsplit(" with ", 1)[-1].strip()
            layouts[layout] = layouts.get(layout, 0) + 1
    for layout, count in sorted(layouts.items()):
        report.append(f"{count} tensors repacked to {layout} at load")
    return report


def logged_since(start):
    """Whole log lines written since `start`, the log being one list of fragments."""
    return "".join(log_lines[start:]).splitlines()


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
        logged = len(log_lines)
        self.ctx = llama_cpp.llama_init_from_model(model, params)
        if not self.ctx:
            reasons = [line for line in logged_since(logged) if "fail" in line or "must" in line]
            raise ContextRejected("; ".join(r.strip() for r in reasons) or "llama_init_from_model failed")
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


class ContextRejected(Exception):
    pass


class Bench:
    def __init__(self):
        self.model = None
        self.threads = None
        self.single = None
        self.batched = None

    def load(self, model, threads, first_prompt, context):
        llama_cpp.llama_log_set(_collect_log, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        self.threads = threads
        started = time.perf_counter()
        self.model = llama_cpp.llama_model_load_from_file(
            model.encode(), llama_cpp.llama_model_default_params()
        )
        if not self.model:
            raise RuntimeError(f"cannot load {model}: {' '.join(logged_since(0))[-2000:]}")
        self.single = Context(self.model, threads, n_ctx=context, n_seq=1, n_batch=512)
        load_s = time.perf_counter() - started
        self.single.prefill([first_prompt])
        first_token_s = time.perf_counter() - started
        return {
            "version": llama_cpp.__version__,
            "system_info": llama_cpp.llama_print_system_info().decode().strip(),
            "buffers": buffer_report(logged_since(0)),
            "load_s": load_s,
            "first_token_s": first_token_s,
        }

    def warmup(self, prompt):
        self.single.clear()
        self.single.prefill([prompt])

    def ttft(self, prompt):
        self.single.clear()
        started = time.perf_counter()
        self.single.prefill([prompt])
        return time.perf_counter() - started

    def decode(self, prompt, tokens):
        self.single.clear()
        token = self.single.prefill([prompt])[0]
        pos = len(prompt)
        started = time.perf_counter()
        for _ in range(tokens):
            token = self.single.decode([(token, pos, 0, True)])[0]
            pos += 1
        return tokens / (time.perf_counter() - started)

    def open(self, sequences, context):
        if self.batched is not None:
            self.batched.close()
            self.batched = None
        try:
            self.batched = Context(
                self.model, self.threads, n_ctx=context, n_seq=sequences, n_batch=max(512, sequences)
            )
        except ContextRejected as rejected:
            return {"rejected": f"tried n_seq_max={sequences}: {rejected}"}
        return None

    def aggregate(self, prompts, tokens):
        ctx = self.batched
        n = len(prompts)
        ctx.clear()
        firsts = ctx.prefill(prompts)
        positions = [len(p) for p in prompts]
        started = time.perf_counter()
        for _ in range(tokens):
            firsts = ctx.decode([(firsts[s], positions[s], s, True) for s in range(n)])
            positions = [p + 1 for p in positions]
        return n * tokens / (time.perf_counter() - started)

    def rss(self):
        return vm_hwm_bytes()


def main():
    bench = Bench()
    for line in sys.stdin:
        request = json.loads(line)
        op = request.pop("op")
        try:
            reply = {"ok": getattr(bench, op)(**request)}
        except Exception as err:  # every failure goes back to the worker, which stops
            reply = {"error": f"{op}: {type(err).__name__}: {err}"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
