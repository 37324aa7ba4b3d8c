"""Did you mean: the known key a misspelt one most likely names.

Candidates are ranked on the key's own name, inside its section (a misspelt section is
matched first): an abbreviation made of the other's word initials wins (`lerning_rate` ->
`lr`, `lr` -> `learning_rate`), then the other's first words (`warmup` -> `warmup_steps`),
then the smallest edit distance, counting a swap of two neighbouring letters as one edit
(`stpes` -> `steps`). Nothing is suggested beyond a third
of the name's length in edits: a wrong guess is worse than none.
"""

from __future__ import annotations


def edit_distance(a: str, b: str) -> int:
    """Insertions, deletions, substitutions and swaps of neighbours (optimal string
    alignment distance)."""
    rows = [list(range(len(b) + 1))]
    for i, ca in enumerate(a, start=1):
        row = [i] + [0] * len(b)
        for j, cb in enumerate(b, start=1):
            row[j] = min(rows[-1][j] + 1, row[j - 1] + 1, rows[-1][j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                row[j] = min(row[j], rows[-2][j - 2] + 1)
        rows.append(row)
    return rows[-1][-1]


def _initials(name: str) -> str:
    words = [w for w in name.split("_") if w]
    return "".join(w[0] for w in words) if len(words) > 1 else ""


def _nearest(name: str, names: list[str]) -> str | None:
    """The entry of `names` that `name` most likely meant (first wins ties), or None."""
    for other in names:
        if _initials(name) == other or _initials(other) == name:
            return other
    for other in names:  # the first words of it: warmup -> warmup_steps
        if other.startswith(name + "_") or name.startswith(other + "_"):
            return other
    scored = [(edit_distance(name, other), i) for i, other in enumerate(names)]
    if not scored:
        return None
    distance, i = min(scored)
    return names[i] if distance <= max(1, len(name) // 3) else None


def closest_key(word: str, known: list[str]) -> str | None:
    """The key of `known` (dotted `section.key`, or bare names) that `word` most likely meant."""
    section, _, name = word.rpartition(".")
    sections = list(dict.fromkeys(k.rpartition(".")[0] for k in known))
    if section and section not in sections:
        section = _nearest(section, sections) or section
    pool = [k for k in known if k.rpartition(".")[0] == section] or known
    match = _nearest(name, [k.rpartition(".")[2] for k in pool])
    if match is None:
        return None
    return next(k for k in pool if k.rpartition(".")[2] == match)
