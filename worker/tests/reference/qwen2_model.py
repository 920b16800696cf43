"""Writes a small random-weight Qwen2 model with the `gguf` package, laid out as llama.cpp's
converter writes Qwen2 (Q/K rows in the Hugging Face half-split rotary order, f32 Q/K/V
biases, `tokenizer.ggml.pre = "qwen2"`), and optionally the same weights as a Hugging Face
directory of BF16 safetensors.

Usage: qwen2_model.py OUT.gguf --weights f32|q8_0 [--tied] [--template FILE] [--hf-dir DIR]

Every weight is rounded to a BF16 value, so the GGUF file's f32 weights and the directory's
BF16 ones hold the same numbers. The vocabulary is byte-level BPE: ChatML and DeepSeek-R1
special tokens, `<think>`/`</think>` as added (non-special) tokens, the 256 byte symbols and
merges learnt from a fixed text that includes digit pairs (which the qwen2 pre-tokenizer
must keep apart).
"""

import argparse
import json
import os
import struct
from collections import Counter

import numpy as np
import gguf

DIM, HEADS, KV_HEADS, FFN, LAYERS, CONTEXT = 64, 4, 2, 128, 2, 256
HEAD_DIM = DIM // HEADS
ROPE_THETA, RMS_EPS = 1000000.0, 1e-6

CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>",
           "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]
ADDED = ["<think>", "</think>"]
CORPUS = ("the quick brown fox jumps over the lazy dog. hello world! 12 12 12 34 34 "
          "the cat sat on the mat; once upon a time a model counted 1 2 3 4 5 and said hello.")
MERGES = 120


def byte_symbols():
    printable = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255]
    table, n = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return [table[b] for b in range(256)]


def vocabulary():
    syms = byte_symbols()
    tokens = list(CONTROL) + list(ADDED) + syms
    types = [3] * len(CONTROL) + [4] * len(ADDED) + [1] * 256
    words = [[syms[b] for b in (w if i == 0 else " " + w).encode()]
             for i, w in enumerate(CORPUS.split(" "))]
    merges = []
    for _ in range(MERGES):
        pairs = Counter(p for w in words for p in zip(w, w[1:]))
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        merges.append(f"{a} {b}")
        tokens.append(a + b)
        types.append(1)
        for w in words:
            i = 0
            while i + 1 < len(w):
                if w[i] == a and w[i + 1] == b:
                    w[i:i + 2] = [a + b]
                i += 1
    return tokens, types, merges


def bf16(x):
    """Rounds to the nearest BF16 value (ties to even), kept as f32."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


def weights(vocab, tied, seed):
    rng = np.random.default_rng(seed)

    def matrix(rows, cols):
        return bf16(rng.uniform(-1, 1, (rows, cols)) * np.sqrt(3.0 / cols))

    def vector(n, base, spread):
        return bf16(base + spread * rng.uniform(-1, 1, n))

    t = {"token_embd.weight": matrix(vocab, DIM)}
    for i in range(LAYERS):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = vector(DIM, 1.0, 0.1)
        t[p + "attn_q.weight"] = matrix(HEADS * HEAD_DIM, DIM)
        t[p + "attn_k.weight"] = matrix(KV_HEADS * HEAD_DIM, DIM)
        t[p + "attn_v.weight"] = matrix(KV_HEADS * HEAD_DIM, DIM)
        # Biases large enough to move the logits: a loader that drops or misorders them fails.
        t[p + "attn_q.bias"] = vector(HEADS * HEAD_DIM, 0.0, 1.0)
        t[p + "attn_k.bias"] = vector(KV_HEADS * HEAD_DIM, 0.0, 1.0)
        t[p + "attn_v.bias"] = vector(KV_HEADS * HEAD_DIM, 0.0, 0.5)
        t[p + "attn_output.weight"] = matrix(DIM, HEADS * HEAD_DIM)
        t[p + "ffn_norm.weight"] = vector(DIM, 1.0, 0.1)
        t[p + "ffn_gate.weight"] = matrix(FFN, DIM)
        t[p + "ffn_up.weight"] = matrix(FFN, DIM)
        t[p + "ffn_down.weight"] = matrix(DIM, FFN)
    t["output_norm.weight"] = vector(DIM, 1.0, 0.1)
    if not tied:
        t["output.weight"] = matrix(vocab, DIM)
    return t


def write_gguf(path, t, tokens, types, merges, qtype, template):
    w = gguf.GGUFWriter(path, "qwen2")
    w.add_name("npufleet random qwen2 test model")
    w.add_block_count(LAYERS)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(DIM)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(ROPE_THETA)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    if template:
        w.add_chat_template(template)
    for name, x in t.items():
        if qtype == "q8_0" and x.ndim == 2:
            w.add_tensor(name, gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


HF_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def hf_name(name):
    fixed = {"token_embd.weight": "model.embed_tokens.weight",
             "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
    if name in fixed:
        return fixed[name]
    _, layer, rest = name.split(".", 2)
    return f"model.layers.{layer}.{HF_NAMES[rest]}"


def write_safetensors(path, t):
    """The safetensors format by hand (an 8-byte header length, a JSON header, raw data), so
    no torch is needed: BF16 is the upper half of each f32."""
    header, blobs, offset = {}, [], 0
    for name, x in t.items():
        data = (np.ascontiguousarray(x, dtype=np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
        header[hf_name(name)] = {"dtype": "BF16", "shape": list(x.shape),
                                 "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for b in blobs:
            f.write(b)


def write_hf(directory, t, tokens, tied, template):
    os.makedirs(directory, exist_ok=True)
    write_safetensors(os.path.join(directory, "model.safetensors"), t)
    config = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "hidden_size": DIM, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "vocab_size": len(tokens), "max_position_embeddings": CONTEXT,
        "rope_theta": ROPE_THETA, "rms_norm_eps": RMS_EPS, "tie_word_embeddings": tied,
        "bos_token_id": tokens.index("<|endoftext|>"), "eos_token_id": tokens.index("<|im_end|>"),
        "torch_dtype": "bfloat16", "use_sliding_window": False,
    }
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    tokenizer_config = {"bos_token": None, "eos_token": "<|im_end|>", "add_bos_token": False}
    if template:
        tokenizer_config["chat_template"] = template
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config, f, indent=2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--weights", choices=["f32", "q8_0"], default="f32")
    ap.add_argument("--tied", action="store_true")
    ap.add_argument("--template")
    ap.add_argument("--hf-dir")
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()
    template = open(a.template, encoding="utf-8").read() if a.template else None
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    tokens, types, merges = vocabulary()
    t = weights(len(tokens), a.tied, a.seed)
    write_gguf(a.out, t, tokens, types, merges, a.weights, template)
    if a.hf_dir:
        write_hf(a.hf_dir, t, tokens, a.tied, template)
    print(a.out)


if __name__ == "__main__":
    main()
