"""Make the tiny real models the real-engine tests serve, offline, into one folder.

    /opt/llmgw-engines/vllm-0.32.0/bin/python make_models.py OUT [--llama-cpp DIR]

Runs under the vLLM environment's Python (it has torch, transformers and tokenizers); nothing is
fetched from a hub. OUT receives:
  chat/        a random-weight Llama (hidden 128, 2 layers, 2 heads of head_dim 64: vLLM's CPU
               attention refuses head_dim 16) with a 512-token byte-level BPE tokenizer trained
               here and a chat template, as safetensors
  chat.gguf    the same model for llama-server, converted by llama.cpp's convert_hf_to_gguf.py
               (with --llama-cpp), told that the tokenizer is `gpt-2`
The embedding tests serve chat/ with vLLM's pooling runner (`--runner pooling`).
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

VOCAB = 512
HIDDEN = 128
LAYERS = 2
HEADS = 2
HEAD_DIM = 64
CONTEXT = 2048
SPECIAL = ["<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_WORDS = ("the a an of to in on for with by from at as is are was were be been has have had do "
          "does did not no yes hello hi there world model server engine request token stream reply "
          "answer question node replica gateway key route health port queue usage count time fast "
          "slow small large tiny random weight layer head vector cache prompt chat system user "
          "assistant one two three four five six seven eight nine ten zero").split()


def corpus() -> list[str]:
    """Deterministic English-like text: enough for a 512-token byte-level BPE to learn merges."""
    lines = []
    n = len(_WORDS)
    for i in range(4000):
        words = [_WORDS[(i * 7 + j * 13 + (i // (j + 1))) % n] for j in range(6 + i % 9)]
        lines.append(" ".join(words).capitalize() + (". " if i % 3 else "? ") + str(i % 100))
    return lines


def make_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=CONTEXT)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def make_chat_model(out: Path) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(out)
    assert len(tokenizer) <= VOCAB, len(tokenizer)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, head_dim=HEAD_DIM,
        max_position_embeddings=CONTEXT, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False, torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id)
    model.save_pretrained(out, safe_serialization=True)


def make_gguf(hf_dir: Path, gguf: Path, llama_cpp: Path) -> None:
    """convert_hf_to_gguf.py, in this process, with its BPE pre-tokenizer check told `gpt-2`:
    a tokenizer trained here is not among the checksums it knows."""
    sys.path.insert(0, str(llama_cpp))
    sys.path.insert(1, str(llama_cpp / "gguf-py"))
    from conversion.base import TextModel

    TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    sys.argv = ["convert_hf_to_gguf.py", str(hf_dir), "--outfile", str(gguf), "--outtype", "f32"]
    try:
        runpy.run_path(str(llama_cpp / "convert_hf_to_gguf.py"), run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--llama-cpp", type=Path, help="llama.cpp folder with convert_hf_to_gguf.py")
    options = parser.parse_args()
    out: Path = options.out
    out.mkdir(parents=True, exist_ok=True)
    chat = out / "chat"
    if not (chat / "model.safetensors").exists():
        make_chat_model(chat)
    made = {"chat": str(chat)}
    if options.llama_cpp is not None:
        gguf = out / "chat.gguf"
        if not gguf.exists():
            tmp = out / "chat.gguf.tmp"
            make_gguf(chat, tmp, options.llama_cpp)
            tmp.rename(gguf)
        made["gguf"] = str(gguf)
    print(json.dumps(made))


if __name__ == "__main__":
    main()
