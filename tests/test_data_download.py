"""The hg38 downloader against a local HTTP server on 127.0.0.1 (md5, resume, mismatch, offline)."""

from __future__ import annotations

import hashlib
import http.server
import socket
import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import ClassVar

import pytest
from data_fixtures import HG38_FRAGMENTS, HG38_RECORDS

from genomelm.data import DataConfig, DataError, WindowDataset, prepare
from genomelm.data.download import fetch

NAME = "chrF.fa.gz"


class RangeHandler(http.server.SimpleHTTPRequestHandler):
    """Static files with single ``Range: bytes=N-`` support (the stdlib handler ignores Range)."""

    ranges: ClassVar[list[str]] = []

    def send_head(self):
        header = self.headers.get("Range")
        path = Path(self.translate_path(self.path))
        if not header or not path.is_file():
            return super().send_head()
        type(self).ranges.append(header)
        data = path.read_bytes()
        start = int(header.removeprefix("bytes=").rstrip("-"))
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        handle = open(path, "rb")  # noqa: SIM115 - the base class closes it after sending
        handle.seek(start)
        return handle

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """(base URL, served folder) with the hg38 fragments as chrF.fa.gz and a correct md5sum.txt."""
    served = tmp_path / "served"
    served.mkdir()
    data = HG38_FRAGMENTS.read_bytes()
    (served / NAME).write_bytes(data)
    (served / "md5sum.txt").write_text(f"{hashlib.md5(data).hexdigest()}  {NAME}\n")
    RangeHandler.ranges = []
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(RangeHandler, directory=str(served)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/", served
    httpd.shutdown()
    httpd.server_close()


def test_download_checks_md5_and_caches(server: tuple[str, Path], tmp_path: Path) -> None:
    url, served = server
    cache = tmp_path / "cache"
    (path,) = fetch(url, [NAME], cache, progress=False)
    assert path == cache / NAME and path.read_bytes() == (served / NAME).read_bytes()
    (served / NAME).unlink()  # a second call must use the cache, not the server
    assert fetch(url, [NAME], cache, progress=False) == [path]


def test_download_resumes_partial_file(server: tuple[str, Path], tmp_path: Path) -> None:
    url, served = server
    cache = tmp_path / "cache"
    cache.mkdir()
    data = (served / NAME).read_bytes()
    (cache / "md5sum.txt").write_text((served / "md5sum.txt").read_text())
    (cache / (NAME + ".part")).write_bytes(data[:7000])
    (path,) = fetch(url, [NAME], cache, progress=False)
    assert RangeHandler.ranges == ["bytes=7000-"]
    assert path.read_bytes() == data and not (cache / (NAME + ".part")).exists()


def test_download_md5_mismatch_is_an_error(server: tuple[str, Path], tmp_path: Path) -> None:
    url, served = server
    (served / "md5sum.txt").write_text(f"{'0' * 32}  {NAME}\n")
    cache = tmp_path / "cache"
    with pytest.raises(DataError, match="checksum mismatch") as err:
        fetch(url, [NAME], cache, progress=False)
    assert str(cache / NAME) in str(err.value) and "re-run to download it again" in str(err.value)
    assert not (cache / NAME).exists()


def test_offline_says_where_to_put_files_then_uses_them(server: tuple[str, Path], tmp_path: Path) -> None:
    _, served = server
    with socket.socket() as sock:  # a port with nothing listening
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}/"
    cfg = DataConfig(
        genome="hg38",
        source="hg38",
        base_url=dead,
        files=[NAME],
        cache=str(tmp_path / "cache"),
        seq=4096,
        heldout=[HG38_RECORDS[1]],
        out=str(tmp_path / "out"),
    )
    with pytest.raises(DataError) as err:
        prepare(cfg, command="test", progress=False, log=lambda _: None)
    cache = tmp_path / "cache" / "hg38"
    assert f"put them in {cache}/: md5sum.txt, {NAME}" in str(err.value)
    assert not (tmp_path / "out").exists()
    for name in ("md5sum.txt", NAME):  # placed by hand, as the message says
        (cache / name).write_bytes((served / name).read_bytes())
    out = prepare(cfg, command="test", progress=False, log=lambda _: None)
    assert len(WindowDataset(out, "heldout")) == 1
    assert (
        WindowDataset(out, "train").manifest["sources"][0]["md5"]
        == hashlib.md5((served / NAME).read_bytes()).hexdigest()
    )
