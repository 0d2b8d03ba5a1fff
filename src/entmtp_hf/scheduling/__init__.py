"""Per-step choices: confidence features, tree policies and the entropy-adaptive halting rule.

Importing this package registers every built-in tree policy: :mod:`.policies` holds the
registry and the switching policies, :mod:`.eas` registers ``entropy``.
"""

from . import eas, policies  # noqa: F401  (registration happens on import)
