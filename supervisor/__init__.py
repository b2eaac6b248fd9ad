"""rollback-supervisor: supervise long training runs and roll back with full state."""

__version__ = "0.1.0"
