"""Secrets given to a process: from a file or an environment variable, never only from the command line.

A value on the command line is visible to every user of the host (``ps``), so each secret a command
takes (the router's admin key, the remote tier's page key) can come from a file or from the environment;
where a command also takes the value itself, the file and the variable are the forms to prefer.
"""

from __future__ import annotations

import os


def read_secret(what: str, file: str = "", env: str = "", value: str = "") -> str:
    """The secret from ``value``, else the file ``file``, else the variable ``env``; "" when none is set.

    Raises ValueError (one line a user can act on) for an unreadable or empty file, or a value with
    surrounding spaces (a pasted newline would make every comparison fail).
    """
    if value:
        secret, source = value, "the command line"
    elif file:
        try:
            with open(file, encoding="utf-8") as f:
                secret = f.read().strip("\r\n")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read the {what} from {file}: {getattr(exc, 'strerror', None) or exc}") from None
        source = file
        if not secret:
            raise ValueError(f"the {what} file {file} is empty")
    else:
        secret, source = os.environ.get(env, "") if env else "", f"${env}"
    if secret != secret.strip():
        raise ValueError(f"the {what} from {source} has surrounding spaces")
    return secret


def write_new_secret(path: str) -> str:
    """``path``, a new file (mode 0600, refused if it exists) holding a random 32-byte secret, URL-safe base64."""
    import secrets

    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(secrets.token_urlsafe(32))
    return path
