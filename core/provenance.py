"""Where a generated document came from: its input files' hashes, the package version, the date and, written by the
`plan` CLI, the command line that wrote it (making it again, on another host or after a change, is one copy away)."""

from __future__ import annotations

import datetime
import os
import platform
from collections.abc import Iterable
from contextvars import ContextVar

from specplan import __version__
from specplan.core.errors import UserError
from specplan.core.fileio import sha256_file

# The `plan` command line being run (specplan/cli.py sets it); None outside the CLI
cli_command: ContextVar[str | None] = ContextVar("cli_command", default=None)


def provenance(inputs: Iterable[str | os.PathLike] = ()) -> dict:
    command = cli_command.get()
    return {
        "specplan_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "inputs": {str(path): {"sha256": sha256_file(path)} for path in inputs},
        **({"command": command} if command is not None else {}),
    }


def check_unchanged(document: dict, path: str | os.PathLike, what: str) -> None:
    """Raise a UserError when `path` is not the file a document's provenance hashed (where it hashed it)."""
    recorded = (document.get("inputs") or {}).get(str(path), {}).get("sha256")
    if not os.path.isfile(path):
        raise UserError(f"{what} {path} is not there")
    if recorded is not None and recorded != sha256_file(path):
        raise UserError(f"{what} {path} changed after the plan was solved: solve the plan again")
