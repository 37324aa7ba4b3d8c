"""A chat template's faults, refused by file, line and fix instead of a jinja2 traceback.

- an empty `--chat-template` file: refused naming the file (not "the tokenizer has no chat
  template", which sends the user to the wrong place);
- Jinja syntax (an unclosed `{% generation %}` included): the template is compiled before
  any work, on a probe conversation, and a TemplateSyntaxError is refused with its line;
- what the template raises while rendering one conversation (`raise_exception(...)`, an
  undefined field, or any Python error, e.g. a TypeError concatenating a mapping where it
  expects text): refused by the input's file:line, with the template's own message;
- `--chat-template-kwargs` it cannot take: a name transformers sets itself (`messages`,
  `add_generation_prompt`, the special tokens, ...), or one the template never reads
  (Jinja's undeclared variables of the parsed template): refused naming the key.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from moetrain.errors import DataError

# Compiles any template (renders it once): only a syntax error is the template's fault
# whatever the data; what a template raises for this conversation is judged per line.
_PROBE = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def template_origin(tokenizer: str, template_file: str | None) -> str:
    """Where the chat template comes from, as a refusal names it."""
    if template_file is not None:
        return f"--chat-template {template_file}"
    directory = tokenizer if os.path.isdir(tokenizer) else os.path.dirname(tokenizer)
    jinja = os.path.join(directory, "chat_template.jinja")
    own = jinja if os.path.isfile(jinja) else os.path.join(directory, "tokenizer_config.json")
    return f"the chat template of --tokenizer {tokenizer} ({own})"


def read_template(template_file: str) -> str:
    """The text of `--chat-template FILE`; DataError when it cannot be read or is empty."""
    try:
        with open(template_file, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as err:
        why = err.strerror if isinstance(err, OSError) else f"not UTF-8 text: {err.reason}"
        raise DataError(
            f"--chat-template {template_file!r}: cannot read it ({why}); give the path of a "
            "Jinja chat template file"
        ) from None
    if not text.strip():
        raise DataError(
            f"--chat-template {template_file!r} is empty ({len(text)} bytes): there is no "
            "template in it to render conversations with; give the file of a Jinja chat "
            "template (e.g. a model's chat_template.jinja), or leave --chat-template out to "
            "use the tokenizer's own"
        )
    return text


def _generation_fix(message: str) -> str:
    if "generation" in message:
        return (
            "close each {% generation %} with {% endgeneration %} inside the same block it "
            "opens in (the same {% if %} or {% for %})"
        )
    return "fix the Jinja syntax on that line"


def check_syntax(tok: Any, origin: str) -> None:
    """Refuse a chat template that does not compile, naming the line, the problem and the fix."""
    import jinja2

    try:
        tok.apply_chat_template(_PROBE, tokenize=False)
    except jinja2.TemplateSyntaxError as err:
        lines = str(tok.chat_template).splitlines()
        shown = f": {lines[err.lineno - 1].strip()[:120]!r}" if 0 < err.lineno <= len(lines) else ""
        raise DataError(
            f"{origin}: line {err.lineno} of the template{shown}: Jinja syntax error: "
            f"{(err.message or '').rstrip('.')}; {_generation_fix(err.message or '')}"
        ) from None
    except Exception:  # noqa: S110 (the template compiled: the rest is the data's, per line)
        pass


class TemplateFailed(Exception):
    """Whatever the template raised while rendering (`failure`), told apart from other
    errors on the way (tokenizing the text is not the template's doing)."""

    def __init__(self, failure: Exception) -> None:
        super().__init__(str(failure))
        self.failure = failure


@contextmanager
def rendering(origin: str, where: str | Callable[[], str]) -> Iterator[None]:
    """Turn what the template raises while rendering the conversation on input line `where`
    (any exception: a Python error such as a TypeError too) into a refusal naming the line,
    the template and its message."""
    import jinja2

    try:
        yield
    except (TemplateFailed, jinja2.TemplateError) as caught:
        err = caught.failure if isinstance(caught, TemplateFailed) else caught
        raised = type(err) is jinja2.TemplateError  # raise_exception(...) raises a bare one
        what = f"raised {str(err)!r}" if raised else f"failed ({type(err).__name__}: {err})"
        line = where() if callable(where) else where
        raise DataError(
            f"{line}: the chat template ({origin}) {what} rendering the conversation on this "
            "line; change or remove that conversation so that the template accepts it, or "
            "render with another template (--chat-template FILE)"
        ) from None


def _set_by_transformers(tok: Any, environment: Any) -> set[str]:
    """The names `apply_chat_template` gives a template itself: its own and
    `render_jinja_template`'s parameters (`messages`, `tools`, `add_generation_prompt`, ...),
    the tokenizer's special tokens (`bos_token`, ...) and the environment's globals
    (`raise_exception`, `strftime_now`, `namespace`, ...)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    names = {"messages", "tools", "documents", "add_generation_prompt"}  # what it renders with
    for function in (tok.apply_chat_template, render_jinja_template):
        names |= {
            p.name
            for p in inspect.signature(function).parameters.values()
            if p.kind is not inspect.Parameter.VAR_KEYWORD
        }
    names |= set(getattr(tok, "SPECIAL_TOKENS_ATTRIBUTES", [])) | set(tok.special_tokens_map)
    return names | set(environment.globals)


def template_options(tok: Any) -> tuple[set[str], set[str]]:
    """(the options the chat template reads, the names transformers sets): the variables
    the parsed template reads without setting them, less those transformers passes."""
    from jinja2 import meta
    from transformers.utils.chat_template_utils import _compile_jinja_template

    templates = (
        tok.chat_template if isinstance(tok.chat_template, dict) else {"": tok.chat_template}
    )
    read: set[str] = set()
    environment = None
    for text in templates.values():
        # transformers' own environment: it parses `{% generation %}` and holds the globals.
        environment = _compile_jinja_template(text).environment
        read |= meta.find_undeclared_variables(environment.parse(text))
    reserved = _set_by_transformers(tok, environment)
    return read - reserved, reserved


def check_options(tok: Any, options: dict[str, Any], origin: str) -> None:
    """Refuse a `--chat-template-kwargs` key that transformers sets itself, or that the chat
    template never reads (it would be recorded and change nothing)."""
    if not options:
        return
    read, reserved = template_options(tok)
    for key in options:
        if key in reserved:
            raise DataError(
                f"--chat-template-kwargs key {key!r} is set by transformers' apply_chat_template "
                "itself (the conversation, the generation prompt, the special tokens and the "
                "template's functions are), so it cannot be a template option: remove it"
            )
    unread = [key for key in options if key not in read]
    if unread:
        known = ", ".join(sorted(read)) or "none"
        raise DataError(
            f"--chat-template-kwargs key {unread[0]!r}: the chat template ({origin}) never "
            f"reads it, so it would change nothing; the options it reads: {known}. Remove it "
            "or correct its name"
        )
