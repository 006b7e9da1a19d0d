"""A GGUF file in the default model's layout (token_embd Q8_0, the matrices Q4_1, norms
F32, the head tied), written from a Hugging Face checkpoint of SmolLM2's architecture:
for timing the default path where the real file cannot travel (a lent machine), from
`benchmarks/gpu_check.py --smollm2-shaped`'s random weights.

    python benchmarks/smollm2_gguf.py HF_DIR OUT.gguf TOKENIZER_DIR

Written from the real HF weights (/work/bench/smollm2-hf here), the file greedy-decodes
the default file's tokens. q and k rows go in llama.cpp's order, as its converter writes
them; the tokenizer's vocabulary goes in the metadata.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import gguf
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from gguf_convert import _write_tokenizer, to_llama_cpp_rows  # noqa: E402

QT = gguf.GGMLQuantizationType


def main() -> None:
    source, target, tokenizer = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    config = json.loads((source / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(target, "llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(8192)
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(config.get("rope_theta", 100000.0))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(config["hidden_size"] // heads)
    writer.add_file_type(3)  # mostly Q4_1
    _write_tokenizer(writer, tokenizer)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    for path in sorted(source.glob("*.safetensors")):
        for name, tensor in load_file(path).items():
            gguf_name = names.get_name(name, try_suffixes=(".weight",))
            if gguf_name is None or gguf_name == "output.weight":  # tied to token_embd
                continue
            data = tensor.float().numpy()
            if ".q_proj." in name or ".k_proj." in name:
                data = to_llama_cpp_rows(data, heads if ".q_proj." in name else kv_heads)
            if data.ndim == 1:
                writer.add_tensor(gguf_name, data)
                continue
            qtype = QT.Q8_0 if gguf_name == "token_embd.weight" else QT.Q4_1
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print("wrote", target)


if __name__ == "__main__":
    main()
