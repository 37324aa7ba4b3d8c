"""Where an export goes: a Hugging Face directory replaced whole, never mixed with an older one.

An export into a directory that already held one used to leave the old files beside the new:
transformers then loaded a stale `model.safetensors` after a sharded export (it prefers the
single file to the index), or a stale `adapter_config.json` over merged weights. So every
export is written into a sibling staging directory and swapped in only once complete:

    <parent>/.<name>.exporting   the new export, while it is written
    <parent>/.<name>.replaced    the old one, between the two renames of the swap

A failure while writing leaves the old export as it was (the staging directory is removed).
A process killed between the two renames leaves the old export in `.<name>.replaced`; the
next export into `<name>` puts it back before starting, so it is never lost unreplaced.

A directory holding anything an export does not write (a user's notes, a training run) is refused before any work: replacing it would delete those files.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager

from moetrain.fileio import fsync_path
from moetrain.models import HFFormatError

# Every file name an export of this trainer writes, or wrote when it was cut short (older
# versions wrote into the directory itself: `.partial` shards, `.tmp` JSON).
EXPORT_FILE = re.compile(
    r"^(config\.json|model\.safetensors|model-\d{5}-of-\d{5}\.safetensors"
    r"|model\.safetensors\.index\.json|adapter_model\.safetensors|adapter_config\.json"
    r"|tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json|chat_template\.jinja"
    r"|generation_config\.json"
    r"|model-\d+\.safetensors\.partial|[\w.-]+\.json\.tmp)$"
)


def _siblings(out_dir: str) -> tuple[str, str]:
    """(staging, replaced) directories beside `out_dir`: same filesystem, so renames work."""
    parent, name = os.path.split(out_dir)
    return os.path.join(parent, f".{name}.exporting"), os.path.join(parent, f".{name}.replaced")


def check_export_dir(out_dir: str) -> None:
    """Refuse an `--out` that is not new, empty or an earlier export (HFFormatError)."""
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise HFFormatError(
            f"export directory {out_dir} exists and is not a directory; choose another (--out)"
        )
    if not os.path.isdir(out_dir):
        return
    foreign = sorted(n for n in os.listdir(out_dir) if not EXPORT_FILE.match(n))
    if foreign:
        listed = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if foreign[3:] else "")
        raise HFFormatError(
            f"export directory {out_dir} holds files an export does not write ({listed}); an "
            "export replaces its directory whole, so it would delete them. Export to a new or "
            "empty directory (--out), or move those files out first"
        )


@contextmanager
def staged_export(out_dir: str) -> Iterator[str]:
    """Yield a fresh directory to write the export into; on success it replaces `out_dir`
    whole (two renames), on failure it is removed and `out_dir` is left as it was."""
    out_dir = os.path.realpath(out_dir)  # a symlinked --out: replace what it points to
    staging, replaced = _siblings(out_dir)
    if not os.path.lexists(out_dir) and os.path.isdir(replaced):
        os.replace(replaced, out_dir)  # a swap cut short between its renames: undo it
    check_export_dir(out_dir)
    for leftover in (staging, replaced):  # of an export killed before it finished
        shutil.rmtree(leftover, ignore_errors=True)
    os.makedirs(staging)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if os.path.isdir(out_dir):
        os.replace(out_dir, replaced)
    os.replace(staging, out_dir)
    fsync_path(os.path.dirname(out_dir))  # the renames, durable before the old copy goes
    shutil.rmtree(replaced, ignore_errors=True)
