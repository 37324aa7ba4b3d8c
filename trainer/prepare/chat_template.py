"""A chat template's faults, refused by file, line and fix instead of a jinja2 traceback.

- an empty `--chat-template` file: refused naming the file (not "the tokenizer has no chat
  template", which sends the user to the wrong place);
- Jinja syntax (an unclosed `{% generation %}` included): the template is compiled before
  any work, on a probe conversation, and a TemplateSyntaxError is refused with its line;
- what the template raises while rendering one conversation (`raise_exception(...)`, an
  undefined field): refused by the input's file:line, with the template's own message.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from trainer.errors import DataError

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


@contextmanager
def rendering(origin: str, where: str | Callable[[], str]) -> Iterator[None]:
    """Turn what the template raises while rendering the conversation on input line `where`
    into a refusal naming the line, the template and its message."""
    import jinja2

    try:
        yield
    except jinja2.TemplateError as err:  # raise_exception(...) raises a bare TemplateError
        raised = type(err) is jinja2.TemplateError
        what = f"raised {str(err)!r}" if raised else f"failed ({type(err).__name__}: {err})"
        raise DataError(
            f"{where() if callable(where) else where}: the chat template ({origin}) {what} rendering the conversation on this "
            "line; change or remove that conversation so that the template accepts it, or "
            "render with another template (--chat-template FILE)"
        ) from None
