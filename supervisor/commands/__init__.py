"""CLI commands that drive a lineage: `run` (the supervised flow) and `status` (a lineage record, read-only)."""
