"""Exceptions a user can act on. The CLI prints their message without a traceback."""


class DisaggError(Exception):
    """Base class of every error that names a user-fixable problem."""


class ConfigError(DisaggError, ValueError):
    """An experiment, model, hardware or parallelism setting that cannot work."""


class TraceError(DisaggError, ValueError):
    """A malformed workload trace (the message names the file, line and field)."""


class PoolExhausted(DisaggError):
    """A KV page pool cannot hold what was asked of it right now."""


class ProtocolError(DisaggError):
    """An event the KV messenger protocol does not allow in the current state."""


class TransportError(DisaggError):
    """A wire failed: a dead peer, a failed write, a bad descriptor."""
