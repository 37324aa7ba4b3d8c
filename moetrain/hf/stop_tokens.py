"""The tokens a chat template ends an assistant turn with: where generation stops.

Found by rendering a probe conversation, as `moetrain.prepare.chat_turns` finds an answer's
stop target, never from a list of known names:
- the text the template writes after the answer's content (`<|im_end|>`, `<|eot_id|>`,
  GPT-OSS's `<|return|>`, DeepSeek's EOS): its special tokens;
- a template that writes nothing there (GLM-4.5) ends an answer where the next turn begins:
  the first token of the next turn (`<|user|>`), which is what the data trained as the
  answer's stop target.
"""

from __future__ import annotations

from typing import Any

_CONTENT = "hello"  # the probe answer's content; rendered as is by every template tried
_PROBE = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _CONTENT}]


def _render(tok: Any, messages: list[dict], kwargs: dict[str, Any]) -> str:
    return tok.apply_chat_template(messages, tokenize=False, **kwargs)


def _special_ids(tok: Any) -> set[int]:
    """Every special token's id: the named ones (EOS, ...) and added tokens marked special
    (`<|im_end|>` is only the latter in most tokenizers)."""
    added = {i for i, token in tok.added_tokens_decoder.items() if token.special}
    return added | set(tok.all_special_ids)


def template_stop_ids(tok: Any, kwargs: dict[str, Any] | None = None) -> list[int]:
    """The ids that end an assistant turn under `tok`'s chat template (with its options
    `kwargs`), in the order the template writes them; [] when the template cannot render
    the probe (one that needs a system turn, say) or ends a turn with no special token."""
    kwargs = dict(kwargs or {})
    try:
        cut = _render(tok, _PROBE, kwargs)
    except Exception:  # noqa: BLE001 (any template error means the same: no probe)
        return []
    end = cut.rfind(_CONTENT)
    if end < 0:
        return []
    end += len(_CONTENT)
    specials = _special_ids(tok)
    closing = cut[end:]
    if closing.strip():  # the end-of-turn text: its special tokens
        ids = tok(closing, add_special_tokens=False)["input_ids"]
        return list(dict.fromkeys(i for i in ids if i in specials))
    # No end-of-turn text: the next turn's first token ends the answer.
    try:
        longer = _render(tok, [*_PROBE, {"role": "user", "content": "again"}], kwargs)
    except Exception:  # noqa: BLE001
        return []
    if not longer.startswith(cut[:end]):
        return []
    rest = longer[end:].lstrip()
    ids = tok(rest, add_special_tokens=False)["input_ids"][:1]
    return [i for i in ids if i in specials]


def stop_ids(tok: Any, eos_ids: list[int | None], kwargs: dict[str, Any] | None) -> list[int]:
    """The EOS ids given (the tokenizer's, the data's) then the template's stop tokens, each
    once: what generation_config.json's `eos_token_id` lists."""
    template = template_stop_ids(tok, kwargs) if getattr(tok, "chat_template", None) else []
    return list(dict.fromkeys(i for i in [*eos_ids, *template] if i is not None))
