"""Build .devcheck/tiny-llama: a tiny random Llama (HF transformers' own LlamaConfig /
LlamaForCausalLM, saved with save_pretrained as safetensors) and a byte-level BPE tokenizer of the
same vocabulary (512), trained offline on the repo's docs. Run with the repo venv:

    .venv/bin/python tools/gpu_check/make_tiny.py

Same shape as tests/test_sliding_window.py's TINY models (initializer_range 1.0: sharp logits, so
float32 rounding differences between devices cannot flip a greedy choice)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

REPO = Path(__file__).resolve().parent.parent.parent
WORK = REPO / ".devcheck"  # git-ignored; travels to the device machine as `carry`
OUT = WORK / "tiny-llama"
GGUF = WORK / "tiny-llama-q4_1.gguf"
VOCAB = 512
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    texts = [p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]]
    tokenizer.train_from_iterator(texts, trainer)
    assert tokenizer.get_vocab_size() == VOCAB, tokenizer.get_vocab_size()
    return tokenizer


def main() -> None:
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    tokenizer = build_tokenizer()
    tokenizer.save(str(OUT / "tokenizer.json"))
    (OUT / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 1024,
        "chat_template": CHAT_TEMPLATE,
    }, indent=1))
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        initializer_range=1.0, rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1,
        eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(OUT, safe_serialization=True)
    print("wrote", OUT, sorted(p.name for p in OUT.iterdir()),
          sum(p.stat().st_size for p in OUT.iterdir()), "bytes")
    write_gguf(model, config, tokenizer, GGUF)
    print("wrote", GGUF, GGUF.stat().st_size, "bytes")


def write_gguf(model, config, tokenizer: Tokenizer, path: Path) -> None:
    """The same model as a GGUF with Q4_1 decoder projections and Q8_0 embeddings (as the
    bundled SmolLM2 file) and the BPE tokenizer in its metadata, through the test suite's
    writer (tests/helpers.py)."""
    import gguf

    sys.path.insert(0, str(REPO))
    from tests.helpers import write_gguf as write_llama_gguf

    spec = json.loads(tokenizer.to_str())
    vocab = sorted(spec["model"]["vocab"].items(), key=lambda item: item[1])
    assert [i for _, i in vocab] == list(range(VOCAB))

    def tokenizer_metadata(writer) -> None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list([token for token, _ in vocab])
        writer.add_token_types([3 if token in SPECIALS else 1 for token, _ in vocab])
        writer.add_token_merges([m if isinstance(m, str) else " ".join(m)
                                 for m in spec["model"]["merges"]])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_chat_template(CHAT_TEMPLATE)

    def storage(name: str):
        kinds = gguf.GGMLQuantizationType
        return kinds.Q4_1 if name.startswith("blk.") else kinds.Q8_0

    tensors = {name: tensor.float().numpy() for name, tensor in model.state_dict().items()}
    fields = ("num_hidden_layers", "max_position_embeddings", "hidden_size", "intermediate_size",
              "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "vocab_size")
    shape = SimpleNamespace(rope_theta=10000.0,  # newer transformers keep it in rope_parameters
                            **{field: getattr(config, field) for field in fields})
    write_llama_gguf(path, shape, tensors, qtype=storage, metadata=tokenizer_metadata)


if __name__ == "__main__":
    main()
