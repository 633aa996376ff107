"""User-facing errors: raised for bad input, printed by the CLI without a traceback."""


class BigclipError(Exception):
    """An error the user can fix; the message says what to change."""


class ConfigError(BigclipError):
    """An inconsistent or invalid option."""


class DataError(BigclipError):
    """Training data that cannot be found or read."""


class StorageError(BigclipError):
    """A checkpoint location or S3 endpoint that cannot be used."""


class NonFiniteLossError(BigclipError):
    """The loss would be NaN or infinite (non-finite features, logit scale or bias).

    Raised on every rank at once, before any update, so weights stay finite; the training
    loop adds the step number to the message.
    """
