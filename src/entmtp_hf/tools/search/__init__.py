"""The offline tree search (``entmtp-hf search``): from a model, its heads and a task to a bank.

Modules, lowest first: :mod:`.config` (settings), :mod:`.trajectories` (rank tuples),
:mod:`.replay` (schedulers replayed on them), :mod:`.frontier` and :mod:`.rollout` (the
acceptance frontier and its scorers), :mod:`.choose` (EntMTP*, T±, value sets),
:mod:`.measure` (timed ``generate`` runs), :mod:`.result` (the figures), :mod:`.plots`,
:mod:`.report` and :mod:`.outputs` (what is written), :mod:`.runner` (the checkpointed
stages, :class:`~.runner.TreeSearch`) and :mod:`.cli`.
"""
