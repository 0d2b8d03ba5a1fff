"""A local stand-in for the Hugging Face Hub, and the offline cache layout, for tests without network.

:class:`MiniHubServer` answers just the endpoints that ``create_repo``, ``repo_info``,
``list_repo_files``, ``hf_hub_download`` and ``upload_folder`` (regular, non-LFS files) call,
for one repository ``org/name``. Every upload is a new commit on its branch, so earlier commits
stay readable by their id: enough to test that a revision pins what it names.
"""

from __future__ import annotations

import base64
import hashlib
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

REPO = "org/name"


def fake_cache(cache: Path, source: Path, repo: str = REPO) -> str:
    """The layout huggingface_hub writes: refs/main -> commit, snapshot links -> blobs."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    (root / "blobs").mkdir()
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in source.iterdir():
        data = f.read_bytes()
        blob = hashlib.sha256(data).hexdigest()
        (root / "blobs" / blob).write_bytes(data)
        (snap / f.name).symlink_to(Path("..", "..", "blobs", blob))
    return commit


class MiniHubServer(ThreadingHTTPServer):
    """The stand-in's state: commits (id -> files) and branches (name -> commit id)."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _MiniHub)
        self.commits: dict[str, dict[str, bytes]] = {}
        self.refs: dict[str, str] = {}

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_port}"

    @property
    def files(self) -> dict[str, bytes]:
        """The files of ``main`` (empty before the first upload)."""
        return self.commits.get(self.refs.get("main", ""), {})

    def resolve(self, revision: str) -> str | None:
        """The commit a branch or commit id names (None: no such revision)."""
        revision = unquote(revision)
        return self.refs.get(revision) or (revision if revision in self.commits else None)

    def commit(self, branch: str, added: dict[str, bytes]) -> str:
        """A new commit on ``branch`` with ``added`` over the branch's files; returns its id."""
        files = {**self.commits.get(self.refs.get(branch, ""), {}), **added}
        digest = hashlib.sha1(json.dumps([self.refs.get(branch), sorted(files)]).encode())
        for name in sorted(files):
            digest.update(files[name])
        commit = digest.hexdigest()
        self.commits[commit], self.refs[branch] = files, commit
        return commit


class _MiniHub(BaseHTTPRequestHandler):
    server: MiniHubServer

    def log_message(self, *args) -> None:  # keep pytest output quiet
        pass

    def _send(self, code: int, body: bytes = b"", headers: dict | None = None) -> None:
        self.send_response(code)
        for key, value in {"Content-Length": str(len(body)), **(headers or {})}.items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, obj: object) -> None:
        self._send(200, json.dumps(obj).encode(), {"Content-Type": "application/json"})

    def _no_revision(self) -> None:
        self._send(404, headers={"X-Error-Code": "RevisionNotFound"})

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        path, hub = urlsplit(self.path).path, self.server
        if path == "/api/repos/create":
            return self._json({"url": f"{hub.endpoint}/{REPO}"})
        if path == "/api/validate-yaml":
            return self._json({})
        if "/preupload/" in path:
            paths = [f["path"] for f in json.loads(body)["files"]]
            return self._json({"files": [{"path": p, "uploadMode": "regular", "shouldIgnore": False} for p in paths]})
        if path.startswith(f"/api/models/{REPO}/commit/"):
            added = {
                item["value"]["path"]: base64.b64decode(item["value"]["content"])
                for item in map(json.loads, body.splitlines())
                if item["key"] == "file"
            }
            commit = hub.commit(unquote(path.rsplit("/", 1)[1]), added)
            return self._json({"commitUrl": f"{hub.endpoint}/{REPO}/commit/{commit}", "commitOid": commit})
        self._send(404)

    def do_GET(self) -> None:
        path, hub = urlsplit(self.path).path, self.server
        api = f"/api/models/{REPO}/"
        if path.startswith((api + "tree/", api + "revision/")):
            commit = hub.resolve(path[len(api) :].split("/")[1])
            if commit is None:
                return self._no_revision()
            files = hub.commits[commit]
            if "/tree/" in path:
                return self._json(
                    [{"type": "file", "path": p, "size": len(b), "oid": "0" * 40} for p, b in files.items()]
                )
            return self._json({"id": REPO, "sha": commit, "siblings": [{"rfilename": p} for p in files]})
        if path.startswith(f"/{REPO}/resolve/"):
            revision, name = path[len(f"/{REPO}/resolve/") :].split("/", 1)
            commit = hub.resolve(revision)
            if commit is None:
                return self._no_revision()
            data = hub.commits[commit].get(unquote(name))
            if data is None:
                return self._send(404, headers={"X-Error-Code": "EntryNotFound"})
            etag = hashlib.sha1(data).hexdigest()
            return self._send(200, data, {"X-Repo-Commit": commit, "ETag": f'"{etag}"'})
        self._send(404)

    do_HEAD = do_GET
