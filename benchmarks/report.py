"""What every benchmark ends with: its JSON object, to a file or stdout."""

from __future__ import annotations

import json


def write_result(result: dict, path: str | None) -> None:
    """`result` as indented JSON to `path`, or to stdout when no path is given."""
    text = json.dumps(result, indent=1)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
