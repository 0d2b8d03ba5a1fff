"""Measuring this machine's step costs: the probe, its cache on disk, and what ``generate`` reads.

The layer above decoding (it times decoding's own session) and below the ``generate``
integration: measuring happens only when the user asks (:func:`~.tables.calibrate`).
"""

from .tables import batch_bucket, calibrate, tables_for

__all__ = ["batch_bucket", "calibrate", "tables_for"]
