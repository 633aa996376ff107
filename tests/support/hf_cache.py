"""A Hugging Face cache laid out by huggingface_hub itself, with no network.

`populate_cache(cache_dir, repo_id, folder)` downloads every file of a local folder with
`huggingface_hub.hf_hub_download(..., endpoint=URL)` from a Hub stand-in on 127.0.0.1 that answers
the two requests the library makes per file (HEAD, for the commit, ETag and size, then GET), so
the blobs/, snapshots/ and refs/ entries are the library's own. The stand-in stops before the
code under test runs, which then finds the files only in the cache (HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import hashlib
import http.server
import threading
from pathlib import Path

COMMIT = hashlib.sha1(b"bigclip test repository").hexdigest()  # a revision looks like a git commit


def _handler(repos: dict[str, Path]) -> type[http.server.BaseHTTPRequestHandler]:
    class Hub(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _file(self) -> Path | None:
            for repo, folder in repos.items():  # /ORG/REPO/resolve/REVISION/FILE
                prefix = f"/{repo}/resolve/"
                if self.path.startswith(prefix):
                    _, _, name = self.path[len(prefix) :].partition("/")
                    path = folder / name
                    return path if path.is_file() else None
            return None

        def _answer(self, body: bool) -> None:
            path = self._file()
            if path is None:
                self.send_response(404)
                self.send_header("X-Error-Code", "EntryNotFound")
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            data = path.read_bytes()
            self.send_response(200)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

        def do_HEAD(self) -> None:  # noqa: N802 (http.server's naming)
            self._answer(body=False)

        def do_GET(self) -> None:  # noqa: N802
            self._answer(body=True)

    return Hub


def populate_cache(cache_dir: Path, repo_id: str, folder: Path) -> list[Path]:
    """Download every file of `folder` as repository `repo_id` into the cache at `cache_dir`."""
    from huggingface_hub import hf_hub_download

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler({repo_id: folder}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        names = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
        return [Path(hf_hub_download(repo_id, n, cache_dir=str(cache_dir), endpoint=endpoint)) for n in names]
    finally:
        server.shutdown()
        server.server_close()
