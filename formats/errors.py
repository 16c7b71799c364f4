"""The one exception type pact raises for bad input: its message names the thing and the fix."""


class PactError(ValueError):
    """Bad input or a broken artifact. The message says which file/flag and how to fix it."""


class ArtifactError(PactError):
    """An artifact that is missing, truncated, corrupted or of an unknown format version."""
