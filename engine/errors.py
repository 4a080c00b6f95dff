"""The one error type the engine raises for bad model files and bad inputs."""


class GGUFError(Exception):
    """A GGUF file (or a request against it) is unsupported, inconsistent or corrupt.

    The message always names the file and the tensor or metadata field at fault.
    """


class UsageError(Exception):
    """A bad command-line or request input that is not a model file problem (bad goldens file,
    malformed id list, ...). The CLI prints it as one line and exits 2."""


MAX_SHOWN = 120   # characters of a file-supplied name or value shown in an error line


def printable(value, limit: int = MAX_SHOWN) -> str:
    """A file-supplied string (or bytes, or any value) made safe for a one-line error message:
    non-printable characters (NUL, newlines, terminal escapes) as \\x.. / \\u.. escapes, cut at
    `limit` characters with a note of the full length."""
    if isinstance(value, (bytes, bytearray)):
        value = bytes(value).decode("utf-8", "backslashreplace")
    text = value if isinstance(value, str) else repr(value)
    # escape only the head that can be shown (a file may hold a string of megabytes)
    out = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                  for c in text[:limit + 1])
    if len(out) > limit:
        out = f"{out[:limit]}... ({len(text)} characters)"
    return out
