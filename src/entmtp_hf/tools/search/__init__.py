"""The offline tree search: rank tuples, the acceptance frontier, timing, the bank it writes."""
