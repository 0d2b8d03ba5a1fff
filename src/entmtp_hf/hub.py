"""What is missing when a Hub download of a bank or heads file fails: the revision, or the file;
and whether a name is a Hub repo id (what a model card's ``base_model`` must be).

``hf_hub_download`` reports a revision the repo does not have, or (offline) one the local cache
does not hold, the same way as a missing file in some cases. Banks and heads name a missing
revision as such, with the revisions that are there, so a typo in ``revision=`` is not read as
a missing task or file.
"""

from __future__ import annotations

import os
from pathlib import Path

from huggingface_hub import HfApi
from huggingface_hub import constants as hf_constants
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, RepositoryNotFoundError, RevisionNotFoundError
from huggingface_hub.utils import validate_repo_id


def hub_repo_id(name: str | None) -> str | None:
    """``name`` if it is a valid Hub repo id, else None (a local path, say)."""
    if not name or name.startswith((".", "~")):
        return None
    try:
        validate_repo_id(name)
    except HFValidationError:
        return None
    return name


def _cached_revisions(repo_id: str, cache_dir: str | os.PathLike | None) -> list[str] | None:
    """Branches, tags and commits of ``repo_id`` in the local cache (None: the repo is not cached)."""
    root = Path(cache_dir or hf_constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}"
    if not root.is_dir():
        return None
    refs = [p.relative_to(root / "refs").as_posix() for p in (root / "refs").rglob("*") if p.is_file()]
    snapshots = [p.name for p in (root / "snapshots").iterdir()] if (root / "snapshots").is_dir() else []
    return sorted(set(refs) | set(snapshots))


def missing_revision(
    repo_id: str,
    revision: str | None,
    *,
    cache_dir: str | os.PathLike | None = None,
    token: str | bool | None = None,
    offline: bool = False,
) -> str | None:
    """Why ``revision`` of ``repo_id`` cannot be read, or None when the revision is not the problem."""
    if revision is None:
        return None
    if offline or hf_constants.is_offline_mode():
        cached = _cached_revisions(repo_id, cache_dir)
        if cached is not None and revision not in cached:
            return (
                f"revision {revision!r} of Hub repo {repo_id!r} is not in the local cache and the Hub is offline "
                f"or unreachable; cached revisions: {cached}"
            )
        return None
    try:
        HfApi(token=token).repo_info(repo_id, revision=revision)
    except RevisionNotFoundError:
        return f"Hub repo {repo_id!r} has no revision {revision!r} (a branch, tag or commit)"
    except (RepositoryNotFoundError, HfHubHTTPError, OSError):
        return None  # the revision is not what failed, or the Hub cannot tell
    return None
