"""A Hugging Face cache laid out by huggingface_hub itself, with no network.

`populate_cache(cache_dir, repo_id, folder)` (in a process of its own, since huggingface_hub reads
HF_HUB_OFFLINE once, at import) downloads every file of a local folder with
`huggingface_hub.hf_hub_download(..., endpoint=URL)` from a Hub stand-in on 127.0.0.1 that answers
the two requests the library makes per file (HEAD, for the commit, ETag and size, then GET), so
the blobs/, snapshots/ and refs/ entries are the library's own. The stand-in stops before the
code under test runs, which then finds the files only in the cache (HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import hashlib
import http.server
import os
import shutil
import subprocess
import sys
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
            stat = path.stat()
            etag = hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
            self.send_response(200)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", f'"{etag}"')  # names the blob in the cache
            self.send_header("Content-Length", str(stat.st_size))
            self.end_headers()
            if body:
                with open(path, "rb") as f:
                    shutil.copyfileobj(f, self.wfile, 16 << 20)

        def do_HEAD(self) -> None:  # noqa: N802 (http.server's naming)
            self._answer(body=False)

        def do_GET(self) -> None:  # noqa: N802
            self._answer(body=True)

    return Hub


def populate_cache(cache_dir: Path, repo_id: str, folder: Path) -> list[Path]:
    """Download every file of `folder`, as repository `repo_id`, into the cache at `cache_dir`."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env["NO_PROXY"] = "127.0.0.1"  # the stand-in is on this machine
    script = [sys.executable, __file__, str(cache_dir), repo_id, str(folder)]
    out = subprocess.run(script, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return [Path(line) for line in out.stdout.splitlines()]


def _download_all(cache_dir: Path, repo_id: str, folder: Path) -> list[Path]:
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


if __name__ == "__main__":
    for path in _download_all(Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])):
        print(path)
