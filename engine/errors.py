"""The one error type the engine raises for bad model files and bad inputs."""


class GGUFError(Exception):
    """A GGUF file (or a request against it) is unsupported, inconsistent or corrupt.

    The message always names the file and the tensor or metadata field at fault.
    """


class UsageError(Exception):
    """A bad command-line or request input that is not a model file problem (bad goldens file,
    malformed id list, ...). The CLI prints it as one line and exits 2."""
