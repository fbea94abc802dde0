"""The one exception type that the CLI turns into a single stderr line and exit code 2."""


class UserError(Exception):
    """Bad input from the user: a malformed file, a wrong schema, an impossible request."""
