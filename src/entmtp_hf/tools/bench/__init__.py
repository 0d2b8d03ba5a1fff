"""The benchmark harness (``entmtp-hf bench``): methods, interleaved runs, result JSON, reports.

Modules, lowest first: :mod:`.settings` (basket and mode), :mod:`.context` (the loaded model,
heads, banks and what is built once), :mod:`.methods` (the method registry), :mod:`.memory`,
:mod:`.summary` (statistics of records), :mod:`.results` (the JSON file), :mod:`.checks`
(per-prompt checks), :mod:`.runner` (the interleaved run), :mod:`.plots`, :mod:`.report`
(Markdown) and :mod:`.cli`.
"""
