"""Writes a random-weight Qwen2 GGUF file with DeepSeek-R1-Distill-Qwen-7B's shape (28 layers,
hidden 3584, FFN 18944, 28 heads, 4 KV heads, vocabulary 152064) in llama.cpp's Q4_K_M mix,
for measuring load time, memory and decode speed at the size people deploy.

Usage: qwen2_7b_shape.py OUT.gguf

The blocks are random bytes with small, fixed f16 scales, written as stored (no f32 weights
are ever made), so the file takes seconds to write and about 4.7 GB. The tensor types follow
llama.cpp's Q4_K_M rule: Q4_K everywhere except the output head and, in the first and last
eighth of the layers and every third layer between, attn_v and ffn_down, which are Q6_K. The
tokenizer is the tests' small byte-level BPE vocabulary (`tests/reference/qwen2_model.py`)
padded with unreachable tokens to the real vocabulary size.
"""

import os
import sys

import numpy as np
import gguf

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "reference"))
import qwen2_model  # noqa: E402

LAYERS, DIM, FFN, HEADS, KV_HEADS, VOCAB, CONTEXT = 28, 3584, 18944, 28, 4, 152064, 4096
HEAD_DIM = DIM // HEADS
Q4_K, Q6_K = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K
# Byte sizes of one 256-value super-block, and where its f16 scales sit.
BLOCK_BYTES = {Q4_K: 144, Q6_K: 210}
SCALE = np.float16(2e-4).view(np.uint16)


def more_bits(layer):
    """llama.cpp's `use_more_bits`: the layers Q4_K_M keeps attn_v and ffn_down in Q6_K."""
    return layer < LAYERS // 8 or layer >= 7 * LAYERS // 8 or (layer - LAYERS // 8) % 3 == 2


def blocks(rng, qtype, rows, cols):
    raw = rng.integers(0, 256, (rows, cols // 256, BLOCK_BYTES[qtype]), dtype=np.uint8)
    scale = np.frombuffer(SCALE.tobytes(), dtype=np.uint8)
    if qtype == Q4_K:
        raw[:, :, 0:2] = scale  # d
        raw[:, :, 2:4] = scale  # dmin
    else:
        raw[:, :, 208:210] = scale  # d
    return raw.reshape(rows, -1)


def main():
    out = sys.argv[1]
    rng = np.random.default_rng(7)
    tokens, types, merges = qwen2_model.vocabulary()
    tokens += [f"<|pad_{i}|>" for i in range(VOCAB - len(tokens))]
    types += [1] * (VOCAB - len(types))

    w = gguf.GGUFWriter(out, "qwen2")
    w.add_name("npufleet random qwen2 7b-shape")
    w.add_block_count(LAYERS)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(DIM)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)

    def norm(n):
        return (1.0 + 0.1 * rng.uniform(-1, 1, n)).astype(np.float32)

    def bias(n):
        return (0.1 * rng.uniform(-1, 1, n)).astype(np.float32)

    def quantised(name, qtype, rows, cols):
        w.add_tensor(name, blocks(rng, qtype, rows, cols), raw_dtype=qtype)

    quantised("token_embd.weight", Q4_K, VOCAB, DIM)
    for i in range(LAYERS):
        p = f"blk.{i}."
        wide = Q6_K if more_bits(i) else Q4_K
        w.add_tensor(p + "attn_norm.weight", norm(DIM))
        quantised(p + "attn_q.weight", Q4_K, HEADS * HEAD_DIM, DIM)
        quantised(p + "attn_k.weight", Q4_K, KV_HEADS * HEAD_DIM, DIM)
        quantised(p + "attn_v.weight", wide, KV_HEADS * HEAD_DIM, DIM)
        w.add_tensor(p + "attn_q.bias", bias(HEADS * HEAD_DIM))
        w.add_tensor(p + "attn_k.bias", bias(KV_HEADS * HEAD_DIM))
        w.add_tensor(p + "attn_v.bias", bias(KV_HEADS * HEAD_DIM))
        quantised(p + "attn_output.weight", Q4_K, DIM, HEADS * HEAD_DIM)
        w.add_tensor(p + "ffn_norm.weight", norm(DIM))
        quantised(p + "ffn_gate.weight", Q4_K, FFN, DIM)
        quantised(p + "ffn_up.weight", Q4_K, FFN, DIM)
        quantised(p + "ffn_down.weight", wide, DIM, FFN)
    w.add_tensor("output_norm.weight", norm(DIM))
    quantised("output.weight", Q6_K, VOCAB, DIM)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(out)


if __name__ == "__main__":
    main()
