"""Make the tiny real models the real-engine tests serve, offline, into one folder.

    /opt/llmgw-engines/vllm-0.32.0/bin/python make_models.py OUT [--llama-cpp DIR]

Runs under the vLLM environment's Python (it has torch, transformers and tokenizers); nothing is
fetched from a hub. OUT receives:
  chat/        a random-weight Llama (hidden 128, 2 layers, 2 heads of head_dim 64: vLLM's CPU
               attention refuses head_dim 16) with a 512-token byte-level BPE tokenizer trained
               here and a chat template, as safetensors
  chat.gguf    the same model for llama-server, converted by llama.cpp's convert_hf_to_gguf.py
               (with --llama-cpp), told that the tokenizer is `gpt-2`
  lora-a/, lora-b/, lora-big/
               LoRA adapters of chat/ in PEFT's format (adapter_config.json and
               adapter_model.safetensors, written here: the environment has no peft), random and
               strong enough that greedy answers differ from the base model's; lora-big has a rank
               above vLLM's default --max-lora-rank (16)
  lora-a.gguf, ...
               the same adapters for llama-server (`--lora`), converted by llama.cpp's
               convert_lora_to_gguf.py (with --llama-cpp, where that folder has it)
The embedding tests serve chat/ with vLLM's pooling runner (`--runner pooling`). The JSON printed
last maps each name (`chat`, `gguf`, `lora-a`, `lora-a-gguf`, ...) to its path.
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

# LoRA adapters of chat/: name -> (rank, seed). lora-big's rank is above vLLM's default
# --max-lora-rank (16), for the engines' rank-limit refusals.
ADAPTERS = {"lora-a": (8, 1), "lora-b": (8, 2), "lora-big": (32, 3)}
LORA_TARGETS = ("q_proj", "v_proj")
# B·A has entries of about LORA_STRENGTH/sqrt(HIDDEN), alpha = r (scaling 1): an update several
# times the base weights' (std 0.02), so greedy answers visibly change.
LORA_STRENGTH = 1.0

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
    _llama_cpp_on_path(llama_cpp)
    from conversion.base import TextModel

    TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    sys.argv = ["convert_hf_to_gguf.py", str(hf_dir), "--outfile", str(gguf), "--outtype", "f32"]
    try:
        runpy.run_path(str(llama_cpp / "convert_hf_to_gguf.py"), run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise


def make_adapter(out: Path, base: Path, rank: int, seed: int) -> None:
    """A random LoRA adapter of chat/ on LORA_TARGETS of every layer, in PEFT's file format."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(LAYERS):
        for module in LORA_TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            # q_proj and v_proj both map HIDDEN inputs to HEADS * HEAD_DIM outputs (no GQA here)
            a = torch.randn(rank, HIDDEN, generator=generator) / HIDDEN ** 0.5
            b = torch.randn(HEADS * HEAD_DIM, rank, generator=generator) * LORA_STRENGTH / rank ** 0.5
            tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "base_model_name_or_path": str(base), "peft_type": "LORA", "task_type": "CAUSAL_LM",
        "r": rank, "lora_alpha": rank, "lora_dropout": 0.0, "target_modules": list(LORA_TARGETS),
        "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "modules_to_save": None,
        "use_rslora": False, "use_dora": False,
    }
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _llama_cpp_on_path(llama_cpp: Path) -> None:
    for index, folder in enumerate((llama_cpp, llama_cpp / "gguf-py")):
        if str(folder) not in sys.path:
            sys.path.insert(index, str(folder))


def make_lora_gguf(adapter: Path, base: Path, gguf: Path, llama_cpp: Path) -> None:
    """convert_lora_to_gguf.py, in this process, with the base model's folder for its config."""
    _llama_cpp_on_path(llama_cpp)
    sys.argv = ["convert_lora_to_gguf.py", str(adapter), "--base", str(base), "--outfile", str(gguf),
                "--outtype", "f32"]
    try:
        runpy.run_path(str(llama_cpp / "convert_lora_to_gguf.py"), run_name="__main__")
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
    for name, (rank, seed) in ADAPTERS.items():
        adapter = out / name
        if not (adapter / "adapter_config.json").exists():
            make_adapter(out / f"{name}.tmp", chat, rank, seed)
            (out / f"{name}.tmp").rename(adapter)
        made[name] = str(adapter)
    if options.llama_cpp is not None and (options.llama_cpp / "convert_lora_to_gguf.py").exists():
        for name in ADAPTERS:
            gguf = out / f"{name}.gguf"
            if not gguf.exists():
                tmp = out / f"{name}.gguf.tmp"
                make_lora_gguf(out / name, chat, tmp, options.llama_cpp)
                tmp.rename(gguf)
            made[f"{name}-gguf"] = str(gguf)
    print(json.dumps(made))


if __name__ == "__main__":
    main()
