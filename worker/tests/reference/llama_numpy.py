"""Independent f32 Llama / Qwen2 forward pass in numpy over a GGUF file's tensors.

Qwen2 is Llama with Q/K/V biases and llama.cpp's NEOX rotary embedding, which rotates the
pairs (i, i + head_dim/2) of each head as the file stores them (Llama GGUF rows are
permuted by the converter to adjacent pairs, rotated as such).

The tensors are read and dequantised by the `gguf` package (not by the engine under test).
Greedy-decodes each prompt (given as token ids, so tokenisation is tested separately) and
writes, per prompt and step, the chosen token and the reference's top logits.

Usage: llama_numpy.py MODEL.gguf PROMPTS.json N_GEN CACHE_DIR
PROMPTS.json holds a list of token-id lists. The result is cached in CACHE_DIR under a key
made of the model's, the prompts' and this script's hashes; the path of the result file is
printed on stdout.
"""

import hashlib
import json
import os
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

TOP = 10


def field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


class Llama:
    def __init__(self, path):
        r = GGUFReader(path)
        arch = field(r, "general.architecture")
        assert arch in ("llama", "qwen2"), arch
        self.neox = arch == "qwen2"
        self.n_layers = int(field(r, f"{arch}.block_count"))
        self.dim = int(field(r, f"{arch}.embedding_length"))
        self.n_heads = int(field(r, f"{arch}.attention.head_count"))
        self.n_kv = int(field(r, f"{arch}.attention.head_count_kv", self.n_heads))
        self.head_dim = self.dim // self.n_heads
        self.theta = float(field(r, f"{arch}.rope.freq_base", 10000.0))
        self.eps = float(field(r, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5))
        tensors = {t.name: t for t in r.tensors}

        def get(name):
            t = tensors[name]
            return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)

        def bias(name):
            return get(name) if name in tensors else 0.0

        self.embd = get("token_embd.weight")
        self.out = get("output.weight") if "output.weight" in tensors else self.embd
        self.out_norm = get("output_norm.weight")
        self.layers = []
        for i in range(self.n_layers):
            p = f"blk.{i}."
            self.layers.append({k: get(p + k + ".weight") for k in (
                "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")})
            for k in ("attn_q", "attn_k", "attn_v"):
                self.layers[-1][k + ".bias"] = bias(p + k + ".bias")

    def rms(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def rope(self, x, pos):
        # Pair i (frequency theta^(-2i/d)) is (2i, 2i+1) for Llama and (i, i + d/2) for NEOX.
        t, h, d = x.shape
        freq = self.theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
        ang = (np.asarray(pos, dtype=np.float64)[:, None] * freq[None, :]).astype(np.float32)
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        first, second = (slice(0, d // 2), slice(d // 2, d)) if self.neox else (
            slice(0, d, 2), slice(1, d, 2))
        a, b = x[..., first], x[..., second]
        out = np.empty_like(x)
        out[..., first] = a * cos - b * sin
        out[..., second] = a * sin + b * cos
        return out

    def forward(self, tokens, start, cache):
        """Runs `tokens` at positions start.. and returns the last token's logits."""
        t = len(tokens)
        hd, nh, nkv = self.head_dim, self.n_heads, self.n_kv
        pos = list(range(start, start + t))
        x = self.embd[tokens]
        for i, lw in enumerate(self.layers):
            h = self.rms(x, lw["attn_norm"])
            q = self.rope((h @ lw["attn_q"].T + lw["attn_q.bias"]).reshape(t, nh, hd), pos)
            k = self.rope((h @ lw["attn_k"].T + lw["attn_k.bias"]).reshape(t, nkv, hd), pos)
            v = (h @ lw["attn_v"].T + lw["attn_v.bias"]).reshape(t, nkv, hd)
            ck, cv = cache[i]
            ck = np.concatenate([ck, k]) if ck is not None else k
            cv = np.concatenate([cv, v]) if cv is not None else v
            cache[i] = (ck, cv)
            group = nh // nkv
            kk = np.repeat(ck, group, axis=1)  # (T_all, nh, hd)
            vv = np.repeat(cv, group, axis=1)
            scores = np.einsum("thd,shd->hts", q, kk) / np.sqrt(hd)
            total = start + t
            mask = np.arange(total)[None, :] > np.array(pos)[:, None]
            scores = np.where(mask[None], -np.inf, scores)
            scores = scores - scores.max(axis=-1, keepdims=True)
            p = np.exp(scores)
            p = p / p.sum(axis=-1, keepdims=True)
            att = np.einsum("hts,shd->thd", p, vv).reshape(t, nh * hd)
            x = x + att @ lw["attn_output"].T
            h = self.rms(x, lw["ffn_norm"])
            g = h @ lw["ffn_gate"].T
            u = h @ lw["ffn_up"].T
            x = x + ((g / (1.0 + np.exp(-g))) * u) @ lw["ffn_down"].T
        last = self.rms(x[-1], self.out_norm)
        return (self.out @ last).astype(np.float32)


def file_hash(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def main():
    model_path, prompts_path, n_gen, cache_dir = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    with open(prompts_path) as f:
        prompts = json.load(f)
    key = hashlib.sha256(
        "|".join([file_hash(model_path), file_hash(__file__), json.dumps(prompts), str(n_gen)]).encode()
    ).hexdigest()[:16]
    out_path = os.path.join(cache_dir, f"llama-numpy-{key}.json")
    if os.path.exists(out_path):
        print(out_path)
        return
    os.makedirs(cache_dir, exist_ok=True)
    model = Llama(model_path)
    results = []
    for prompt in prompts:
        cache = [(None, None)] * model.n_layers
        logits = model.forward(prompt, 0, cache)
        pos = len(prompt)
        steps = []
        for _ in range(n_gen):
            top = np.argsort(-logits)[:TOP]
            token = int(top[0])
            steps.append({
                "token": token,
                "top_ids": [int(i) for i in top],
                "top_logits": [float(logits[i]) for i in top],
            })
            logits = model.forward([token], pos, cache)
            pos += 1
        results.append({"prompt": prompt, "steps": steps})
    with open(out_path + ".part", "w") as f:
        json.dump({"results": results}, f)
    os.replace(out_path + ".part", out_path)
    print(out_path)


if __name__ == "__main__":
    main()
