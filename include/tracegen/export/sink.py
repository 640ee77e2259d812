"""One large object written as a stream, in bounded memory: a trainer layout's data file.

`Storage.put` takes the whole object's bytes, which for a full-scale token file would be gigabytes. The
bytes go to a local temporary file instead, hashed as they are written; `publish` then moves it into place
(local destination: rename within the destination's own directory, after fsync) or uploads it from disk
(S3: boto3's managed transfer, multipart for large files). Nothing is visible under the key until the whole
file is there; an abandoned sink leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import uuid
from pathlib import Path

from tracegen.store.storage import LocalStorage, S3Storage, Storage, fsync_dir

_BUFFER = 1 << 20


class FileSink:
    def __init__(self, dest: Storage, key: str) -> None:
        self.dest, self.key = dest, key
        if isinstance(dest, LocalStorage):
            dest.root.mkdir(parents=True, exist_ok=True)
            self.tmp = dest.root / f".tmp-data-{uuid.uuid4().hex}"  # same filesystem: the rename is atomic
        elif isinstance(dest, S3Storage):
            fd, name = tempfile.mkstemp(prefix="tracegen-export-", suffix=".jsonl")
            os.close(fd)
            self.tmp = Path(name)
        else:
            raise TypeError(f"no streaming writes to {type(dest).__name__} destinations ({dest.uri})")
        self.file = open(self.tmp, "wb", buffering=_BUFFER)  # noqa: SIM115 - closed by publish/abort
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> None:
        self.file.write(data)
        self.sha256.update(data)
        self.size += len(data)

    def publish(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        try:
            if isinstance(self.dest, LocalStorage):
                target = self.dest.root / self.key
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(self.tmp, target)
                fsync_dir(target.parent)
            else:
                s3 = self.dest
                assert isinstance(s3, S3Storage)
                s3._call("upload_file", self.key,
                         lambda client: client.upload_file(str(self.tmp), s3.bucket, s3.prefix + self.key))
        finally:
            self.tmp.unlink(missing_ok=True)

    def abort(self) -> None:
        if not self.file.closed:
            self.file.close()
        self.tmp.unlink(missing_ok=True)
