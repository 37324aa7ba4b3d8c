"""What is on disk: which checkpoints are complete, and what is wrong with a damaged one.

A save writes `COMPLETE` last and only then renames `.tmp-step-<N>` to `step-<N>`, so a
`step-<N>` directory whose marker is missing, cut short or garbled, or that lacks a file the
marker lists, was damaged after its commit. Such a checkpoint is never loaded and never
passed over in silence: the refusal names the file, what is wrong with it, and the newest
intact checkpoint with the flag that resumes from it.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import torch

from moetrain.errors import CheckpointError

COMPLETE = "COMPLETE"
TRAINER_STATE = "trainer_state.pt"
METADATA = ".metadata"  # DCP's index of the .distcp files
_STEP_DIR = re.compile(r"^step-(\d+)$")


def read_marker(path: str) -> dict[str, Any]:
    """The commit marker of checkpoint `path`; CheckpointError saying what is wrong."""
    file = os.path.join(path, COMPLETE)
    if not os.path.isfile(file):
        raise CheckpointError(f"{file} is missing")
    try:
        with open(file) as f:
            marker = json.load(f)
    except ValueError as err:
        size = os.path.getsize(file)
        raise CheckpointError(
            f"{file} is truncated or garbled ({size} bytes, not valid JSON: {err})"
        ) from None
    if not isinstance(marker, dict) or "committed_at" not in marker:
        raise CheckpointError(f"{file} is garbled (not a commit marker this trainer wrote)")
    return marker


def _step_dirs(root: str) -> list[tuple[int, str]]:
    if not os.path.isdir(root):
        return []
    found = ((_STEP_DIR.match(n), os.path.join(root, n)) for n in os.listdir(root))
    return [(int(m.group(1)), path) for m, path in found if m and os.path.isdir(path)]


def complete_checkpoints(root: str) -> list[tuple[int, str]]:
    """(step, path) of every checkpoint under `root` with a readable marker, in commit order
    (oldest first).

    NOTE: commit order, not step order: after a rollback (resume from an older step), the
    checkpoints of the abandoned future are older commits than the new ones, so
    resume=auto and keep_last follow the run that is actually going on.
    """
    found = []
    for step, path in _step_dirs(root):
        try:
            found.append((read_marker(path)["committed_at"], step, path))
        except CheckpointError:
            continue  # damaged: see newest_damaged
    return [(step, path) for _, step, path in sorted(found)]


def newest_damaged(root: str, newer_than: str | None) -> tuple[str, str] | None:
    """(path, problem) of the most recently written step directory whose marker cannot be
    read, if it is newer (by modification time) than checkpoint `newer_than`."""
    limit = os.stat(newer_than).st_mtime if newer_than else float("-inf")
    damaged = []
    for _, path in _step_dirs(root):
        try:
            read_marker(path)
        except CheckpointError as err:
            if os.stat(path).st_mtime > limit:
                damaged.append((os.stat(path).st_mtime, path, str(err)))
    return max(damaged)[1:] if damaged else None


def resume_hint(root: str, damaged: str) -> str:
    """The way out of a damaged checkpoint: the newest intact one, and how to use it."""
    older = [
        p for _, p in complete_checkpoints(root) if os.path.abspath(p) != os.path.abspath(damaged)
    ]
    if older:
        return (
            f"the newest intact checkpoint is {older[-1]}: resume from it with "
            f"--checkpoint.resume={older[-1]} (or move {damaged} away)"
        )
    return (
        "there is no other complete checkpoint: start over with --checkpoint.resume=none or "
        "a new job.output_dir"
    )


def check_checkpoint(path: str, root: str | None = None) -> dict[str, Any]:
    """The marker of checkpoint `path`, once its marker and every file it lists (and the
    ones every checkpoint has) are there; CheckpointError naming the first problem and the
    checkpoint to use instead (looked for in `root`, default: beside `path`)."""
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path!r}: no such directory")
    root = root or os.path.dirname(os.path.abspath(path))
    problem = _problem(path)
    if problem is not None:
        raise CheckpointError(f"checkpoint {path} is damaged: {problem}; {resume_hint(root, path)}")
    return read_marker(path)


def read_trainer_state(path: str) -> dict[str, Any]:
    """The trainer state of checkpoint `path`, loaded without running any pickled code."""
    file = os.path.join(path, TRAINER_STATE)
    try:
        return torch.load(file, weights_only=True)
    except Exception as err:  # UnpicklingError for code, others for damage: both refused
        raise CheckpointError(
            f"{file} cannot be loaded as plain data ({type(err).__name__}: "
            f"{str(err).splitlines()[0][:200]}); it is damaged or not from this trainer "
            "(it would run code if unpickled: refused)"
        ) from None


def _is_checkpoint(path: str) -> bool:
    """Whether `path` looks like one checkpoint (complete or not), not a directory of them."""
    name = os.path.basename(os.path.normpath(path))
    if _STEP_DIR.match(name) or _STEP_DIR.match(name.removeprefix(".tmp-")):
        return True
    return any(os.path.exists(os.path.join(path, f)) for f in (COMPLETE, TRAINER_STATE, METADATA))


def _problem(path: str) -> str | None:
    """What keeps checkpoint `path` from being loaded (its marker, a file the marker lists
    or every checkpoint has), or None; `check_checkpoint` adds a resume's advice to it."""
    try:
        marker = read_marker(path)
    except CheckpointError as err:
        return str(err)
    for name in sorted({TRAINER_STATE, METADATA, *(marker.get("files") or {})}):
        if not os.path.isfile(os.path.join(path, name)):
            return f"{os.path.join(path, name)} is missing"
    return None


def beside(path: str) -> str:
    """The way out of damaged checkpoint `path` for a command that reads it (not a resume:
    `resume_hint`): the newest intact checkpoint in the same directory."""
    others = [p for _, p in complete_checkpoints(os.path.dirname(os.path.abspath(path)))]
    intact = [p for p in others if _problem(p) is None and not os.path.samefile(p, path)]
    if intact:
        return f"the newest intact checkpoint beside it is {intact[-1]}: use that one"
    return "there is no intact checkpoint beside it"


def find_checkpoint(path: str, key: str | None = None) -> tuple[str, str | None]:
    """The checkpoint that `path` means, and a one-line note when it had to choose one.

    `path` may be a checkpoint (`step-<N>`), a `checkpoints/` directory, or a job's output
    directory (the one holding `checkpoints/`): for the last two, the newest complete one
    (commit order, as resume=auto) is chosen, and the note names it. CheckpointError
    otherwise: a damaged checkpoint, or a newer damaged one than the one it would choose
    (with the intact one to give instead, as resume=auto refuses), a directory without a
    complete one, or one that is no checkpoint at all. `key` (e.g. "--checkpoint", "checkpoint.init_from") names the
    option that gave `path` in the messages. The advice names no option: each caller has
    its own.
    """
    given = f"{key}={path}" if key else path
    if not os.path.isdir(path):
        raise CheckpointError(
            f"{given}: no such directory; give a checkpoint's directory "
            "(OUTPUT_DIR/checkpoints/step-<N>) or the output directory of the job that saved it"
        )
    if _is_checkpoint(path):
        problem = _problem(path)
        if problem is None:
            return path, None
        raise CheckpointError(f"checkpoint {given} cannot be used: {problem}; {beside(path)}")
    root = os.path.join(path, "checkpoints")
    root = root if os.path.isdir(root) else path
    steps = _step_dirs(root)
    advice = "give a checkpoint's directory (OUTPUT_DIR/checkpoints/step-<N>)"
    if not steps and root == path:
        raise CheckpointError(
            f"{given} is not a checkpoint: it has no {COMPLETE} marker, no checkpoints/ "
            f"directory and no step-<N> directories; {advice} or the output directory of a "
            "job that saved one"
        )
    if not steps:
        raise CheckpointError(
            f"{given} holds no checkpoint: {root} has no step-<N> directory (the job saved "
            f"none yet); {advice} of a job that saved one"
        )
    intact = [(s, p) for s, p in complete_checkpoints(root) if _problem(p) is None]
    if not intact:
        newest = max(steps)[1]
        raise CheckpointError(
            f"{given} holds no complete checkpoint: none of the {len(steps)} step-<N> "
            f"directories in {root} can be used (the newest, {newest}: {_problem(newest)}); "
            f"{advice} of a job that saved a complete one"
        )
    step, chosen = intact[-1]
    after = os.stat(chosen).st_mtime
    passed = [p for _, p in steps if os.stat(p).st_mtime > after and _problem(p) is not None]
    if passed:  # a newer, damaged checkpoint is never passed over: refused, as resume=auto
        newest = max(passed, key=lambda p: os.stat(p).st_mtime)
        raise CheckpointError(
            f"{given}: its newest checkpoint, {newest}, cannot be used: {_problem(newest)}; "
            f"the newest intact one is {chosen} (step {step}): to use it, give it "
            f"({key + '=' if key else ''}{chosen}), or move {newest} away"
        )
    return chosen, f"{given}: using {chosen} (step {step}), the newest of its complete checkpoints"
