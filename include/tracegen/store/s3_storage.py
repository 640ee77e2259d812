"""An S3 prefix as an output root, through Airflow's S3Hook: every call retried with backoff on transient
errors, exclusive create by a conditional PUT."""

from __future__ import annotations

import logging
import random
import re
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from tracegen.store.storage_base import (
    Fenced,
    Storage,
    StorageError,
    StorageKeyError,
    _check_prefix,
    _check_range,
    check_key,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

# S3 error codes worth retrying: throttling and server-side trouble. Everything else (403, 404, bad
# request) is permanent and retrying would only delay a clear error.
_RETRYABLE_CODES = {
    "Throttling",
    "ThrottlingException",
    "SlowDown",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "InternalError",
    "ServiceUnavailable",
    "RequestLimitExceeded",
    "TooManyRequestsException",
}
_MISSING_CODES = {"NoSuchKey", "404", "NotFound"}
# botocore's retries inside each of tracegen's attempts of an unguarded call (the connection's own settings win):
# standard mode backs off with jitter and retries the transient errors tracegen's loop would, three tries in all.
UNGUARDED_RETRIES = {"mode": "standard", "max_attempts": 3}
# What S3 answers a conditional write whose condition failed (another writer's object is there).
CONFLICT_CODES = ("PreconditionFailed", "ConditionalRequestConflict")


def _is_transient(exc: BaseException) -> bool:
    from botocore.exceptions import (
        ClientError,
        ConnectionClosedError,
        ConnectTimeoutError,
        EndpointConnectionError,
        ReadTimeoutError,
    )

    if isinstance(exc, EndpointConnectionError | ConnectionClosedError | ConnectTimeoutError | ReadTimeoutError):
        return True
    if isinstance(exc, ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        return code in _RETRYABLE_CODES or status >= 500 or status == 429
    # urllib3/socket level errors that botocore did not wrap.
    return isinstance(exc, ConnectionError | TimeoutError)


def _error_code(exc: BaseException) -> str:
    from botocore.exceptions import ClientError

    if isinstance(exc, ClientError):
        return str(exc.response.get("Error", {}).get("Code", ""))
    return ""


class S3Storage(Storage):
    """An S3 prefix reached through Airflow's S3Hook (so endpoint and credentials come from the connection).

    Each call is retried with exponential backoff and jitter on transient errors for up to
    `retry_deadline_s`, so a commit rides out an S3 blip; then it fails naming the object.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        aws_conn_id: str = "aws_default",
        *,
        retry_deadline_s: float = 120.0,
        backoff_initial_s: float = 0.2,
        backoff_max_s: float = 10.0,
        client: Any = None,
    ) -> None:
        if not re.fullmatch(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]", bucket):
            raise ValueError(f"invalid S3 bucket name {bucket!r}")
        if retry_deadline_s < 0 or backoff_initial_s <= 0 or backoff_max_s < backoff_initial_s:
            raise ValueError(
                f"bad retry settings: deadline={retry_deadline_s} initial={backoff_initial_s} max={backoff_max_s}"
            )
        prefix = prefix.strip("/")
        if prefix:
            check_key(prefix)
        self.bucket = bucket
        self.prefix = prefix + "/" if prefix else ""
        self.aws_conn_id = aws_conn_id
        self.uri = f"s3://{bucket}/{self.prefix}"
        self.retry_deadline_s = retry_deadline_s
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self._client = client
        self._session: tuple[Any, str | None, Any, Any] | None = None

    @property
    def client(self) -> Any:
        """The client of every unguarded call: botocore's standard retry mode inside tracegen's own loop
        (`_call`), on the Airflow connection's endpoint, credentials and botocore settings."""
        if self._client is None:
            from botocore.config import Config

            self._client = self._new_client(lambda own: Config(retries=UNGUARDED_RETRIES).merge(own))
        return self._client

    def _new_client(self, config: Callable[[Any], Any]) -> Any:
        """An S3 client on the Airflow connection's endpoint and credentials, with the botocore `Config` that
        `config` makes of the connection's own. One boto3 session serves them all: a client from a warm session
        costs about 4 ms of CPU, a fresh session's about 140 ms (a guarded write builds one per attempt)."""
        if self._session is None:
            # Created lazily: building the hook reads the Airflow connection, which a constructor should not do.
            from airflow.providers.amazon.aws.hooks.s3 import S3Hook

            hook = S3Hook(aws_conn_id=self.aws_conn_id)
            self._session = (hook.get_session(region_name=hook.region_name),
                             hook.conn_config.get_service_endpoint_url(service_name="s3"), hook.verify, hook.config)
        session, endpoint, verify, own = self._session
        return session.client("s3", endpoint_url=endpoint, config=config(own), verify=verify)

    def _guarded_client(self, time_left_s: float) -> Any:
        """A client for one attempt of a write that must not land past its fence's deadline: no retry inside
        botocore (its default legacy mode re-sends a PUT up to four times, the last minutes after the first),
        and connect and read timeouts no longer than the time left, so the request is handed to the network
        before the deadline or not at all. The connection's own botocore settings apply, but for these three.
        Built per attempt, since its timeouts are the attempt's."""
        from botocore.config import Config

        timeout = max(time_left_s, 0.001)
        fenced = Config(retries={"mode": "standard", "total_max_attempts": 1},
                        connect_timeout=timeout, read_timeout=timeout)
        return self._new_client(lambda own: own.merge(fenced))

    def _call(self, what: str, key: str, fn: Callable[[Any], T], until: float | None = None) -> T:
        """`fn(client)` retried with backoff on transient errors for up to `retry_deadline_s`.

        `until` (time.monotonic()) makes it a guarded write: each attempt goes out on `_guarded_client`
        (one send, timeouts within the time left) and none starts past `until`. A guarded write whose last
        attempt went unanswered may have landed, but only as sent, before the deadline. A loop of its own, not
        tenacity's: each attempt's client is built for the time left before `until`, and running out of it
        is `Fenced`, not the retry deadline's StorageError."""
        deadline = time.monotonic() + self.retry_deadline_s
        if until is not None:
            deadline = min(deadline, until)
        delay = self.backoff_initial_s
        attempt = 0
        unanswered: BaseException | None = None
        while True:
            attempt += 1
            if until is not None:
                time_left = until - time.monotonic()
                if time_left <= 0:
                    landed = (f"; its last attempt got no answer ({unanswered}): if it landed, it was sent "
                              "before the deadline" if unanswered is not None else "")
                    raise Fenced(f"not writing {self.uri + key}: its fence's deadline passed{landed}")
                client = self._guarded_client(time_left)
            else:
                client = self.client
            try:
                return fn(client)
            except Exception as exc:
                if _error_code(exc) in _MISSING_CODES:
                    raise StorageKeyError(self.uri + key) from None
                if not _is_transient(exc):
                    raise StorageError(f"S3 {what} {self.uri + key} failed: {exc}") from exc
                unanswered = exc
                now = time.monotonic()
                if now >= deadline:
                    if until is not None and now >= until:
                        continue  # past the fence's deadline: said as such, above
                    raise StorageError(
                        f"S3 {what} {self.uri + key} failed after {attempt} attempts over "
                        f"{self.retry_deadline_s:.0f}s (bucket {self.bucket!r}): {exc}"
                    ) from exc
                sleep = min(delay * (0.5 + random.random()), deadline - now)
                log.warning("S3 %s %s: transient error (%s); retry %d in %.2fs", what, key, exc, attempt, sleep)
                time.sleep(max(sleep, 0.0))
                delay = min(delay * 2, self.backoff_max_s)

    def _key(self, key: str) -> str:
        return self.prefix + check_key(key)

    def put(self, key: str, data: bytes) -> None:
        # One PutObject is atomic on S3: readers see the previous object or this one.
        self._call("put", key, lambda c: c.put_object(Bucket=self.bucket, Key=self._key(key), Body=data))

    def create(self, key: str, data: bytes) -> bool:
        def put(client: Any) -> None:
            client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, IfNoneMatch="*")

        try:
            self._call("create", key, put)
        except StorageError as exc:
            code = _error_code(exc.__cause__) if exc.__cause__ is not None else ""
            if code not in CONFLICT_CODES:
                raise
            # Someone's object is there: ours, if an earlier attempt of this call went through unanswered.
            try:
                return self.get(key) == data
            except StorageKeyError:
                return False
        return True

    def version(self, key: str) -> str:
        return str(self._head(key)["ETag"])

    def swap(self, key: str, data: bytes, expected: str | None, *, deadline: float | None = None) -> str | None:
        condition = {"IfNoneMatch": "*"} if expected is None else {"IfMatch": expected}

        def put(client: Any) -> str:
            return str(client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, **condition)["ETag"])

        try:
            return self._call("swap", key, put, until=deadline)
        except StorageKeyError:
            return None  # If-Match on an object that is gone
        except StorageError as exc:
            code = _error_code(exc.__cause__) if exc.__cause__ is not None else ""
            if code not in CONFLICT_CODES:
                raise
        # Refused: another writer's object, or ours if an earlier attempt of this call went through unanswered
        # (the bytes are unique to each swap, so they tell).
        try:
            if self.get(key) == data:
                return self.version(key)
        except StorageKeyError:
            pass
        return None

    def remove_if(self, key: str, expected: str) -> bool:
        try:
            self._call("remove", key, lambda c: c.delete_object(
                Bucket=self.bucket, Key=self._key(key), IfMatch=expected))
        except StorageKeyError:
            return False
        except StorageError as exc:
            if (_error_code(exc.__cause__) if exc.__cause__ is not None else "") in CONFLICT_CODES:
                return False
            raise
        return True

    def put_guarded(self, key: str, data: bytes, guards: Mapping[str, str], deadline: float) -> None:
        for guard, version in guards.items():
            try:
                current = self.version(guard)
            except StorageKeyError:
                current = None
            if current != version:
                raise Fenced(f"not writing {self.uri_for(key)}: {self.uri_for(guard)} was replaced or removed")
        self._call("put", key, lambda c: c.put_object(Bucket=self.bucket, Key=self._key(key), Body=data),
                   until=deadline)

    def modified(self, key: str) -> float:
        return self._head(key)["LastModified"].timestamp()

    def get(self, key: str) -> bytes:
        def fetch(client: Any) -> bytes:
            return client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()

        return self._call("get", key, fetch)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        _check_range(start, length)
        if length == 0:
            self.size(key)  # still raise for a missing key
            return b""

        def fetch(client: Any) -> bytes:
            from botocore.exceptions import ClientError

            try:
                resp = client.get_object(
                    Bucket=self.bucket, Key=self._key(key), Range=f"bytes={start}-{start + length - 1}"
                )
            except ClientError as exc:
                if _error_code(exc) == "InvalidRange":  # start is past the end: same as a local read
                    return b""
                raise
            return resp["Body"].read()

        return self._call("get_range", key, fetch)

    def _head(self, key: str) -> dict[str, Any]:
        return self._call("head", key, lambda c: c.head_object(Bucket=self.bucket, Key=self._key(key)))

    def exists(self, key: str) -> bool:
        try:
            self._head(key)
        except StorageKeyError:
            return False
        return True

    def size(self, key: str) -> int:
        return int(self._head(key)["ContentLength"])

    def list(self, prefix: str = "") -> list[str]:
        _check_prefix(prefix)
        full = self.prefix + prefix

        def fetch(client: Any) -> list[str]:
            keys: list[str] = []
            paginator = client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=full):
                keys.extend(obj["Key"][len(self.prefix) :] for obj in page.get("Contents", []))
            return keys

        return sorted(self._call("list", prefix, fetch))

    def sizes(self, prefix: str = "") -> dict[str, int]:
        # The listing already carries each object's size: one LIST per 1000 keys instead of a HEAD per key.
        _check_prefix(prefix)
        full = self.prefix + prefix

        def fetch(client: Any) -> dict[str, int]:
            out: dict[str, int] = {}
            paginator = client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=full):
                out.update((obj["Key"][len(self.prefix) :], int(obj["Size"])) for obj in page.get("Contents", []))
            return out

        return dict(sorted(self._call("list", prefix, fetch).items()))

    def delete(self, key: str) -> None:
        self._call("delete", key, lambda c: c.delete_object(Bucket=self.bucket, Key=self._key(key)))

    def uri_for(self, key: str) -> str:
        return self.uri + check_key(key)


