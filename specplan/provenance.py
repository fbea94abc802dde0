"""Where a generated document came from: its input files' hashes, the package version and the date."""

from __future__ import annotations

import datetime
import os
import platform
from collections.abc import Iterable

from specplan import __version__
from specplan.fileio import sha256_file


def provenance(inputs: Iterable[str | os.PathLike] = ()) -> dict:
    return {
        "specplan_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "inputs": {str(path): {"sha256": sha256_file(path)} for path in inputs},
    }
