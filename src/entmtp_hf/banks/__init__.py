"""Banks: per-task draft-tree files (format, card, the Hub, machine entries) and one call's plan.

The banks shipped with the package live in ``shipped/`` (package data)."""
