"""A tiny Hugging Face Qwen3-MoE directory with a chat tokenizer, made with transformers and
tokenizers (no download): what a user fine-tunes from, at test size."""

from __future__ import annotations

import json
from pathlib import Path

CHAT_DATA = Path(__file__).resolve().parent / "data" / "chat.jsonl"

# ChatML, as Qwen's chat models use it.
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def conversations() -> list[list[dict[str, str]]]:
    return [json.loads(line)["messages"] for line in CHAT_DATA.read_text().splitlines()]


def save_chat_tokenizer(
    directory: Path,
    template: str | None = CHATML,
    specials: list[str] = SPECIALS,
    texts: list[str] = (),
    bos: str | None = None,
    eos: str = "<|im_end|>",
    vocab_size: int = 300,
):
    """A byte-level BPE of `vocab_size` tokens trained on the test conversations (and
    `texts`), saved with transformers; `specials` are single tokens, the first one the
    padding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    texts = [m["content"] for conv in conversations() for m in conv] + [
        *texts,
        "system user assistant",
    ]
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=specials[0]
    )
    if template is not None:
        fast.chat_template = template
    directory.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(directory)
    return fast


def save_chat_model(
    directory: Path, seed: int = 0, texts: list[str] = (), vocab_size: int = 300
) -> None:
    """The tokenizer above (trained on `texts` too) and a tiny random Qwen3-MoE whose
    vocabulary holds it."""
    import torch
    import transformers

    fast = save_chat_tokenizer(directory, texts=texts, vocab_size=vocab_size)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=-(-len(fast) // 64) * 64,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        norm_topk_prob=True,
        router_aux_loss_coef=0.01,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    torch.manual_seed(seed)
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(directory)
