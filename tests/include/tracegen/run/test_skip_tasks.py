"""`run.skip_tasks` over the task SDK's private channel to its supervisor (Airflow 3.3.2, task SDK 1.3.2).

These fail when the private names it uses move or change shape, and when the public API it stands in for
becomes usable (then `skip_tasks` should use that instead)."""

from __future__ import annotations

import inspect
import logging
import socket
import threading

import msgspec
import pytest
from airflow.sdk.bases.skipmixin import SkipMixin
from airflow.sdk.exceptions import DownstreamTasksSkipped
from airflow.sdk.execution_time import task_runner
from airflow.sdk.execution_time.comms import CommsDecoder, SkipDownstreamTasks, _RequestFrame, _ResponseFrame
from airflow.sdk.execution_time.supervisor import ActivitySubprocess

from tracegen.common import dag_ids
from tracegen.run.skip_tasks import skip_tasks


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "the task side closed the channel"
        data += chunk
    return data


def test_the_skip_reaches_the_supervisor_as_its_skip_message(monkeypatch: pytest.MonkeyPatch) -> None:
    # The task's end of a real channel, as the task runner sets it; the other end decodes each frame as the
    # supervisor does (its frame decoder, then its message adapter) and answers it.
    task_end, supervisor_end = socket.socketpair()
    received: list[object] = []

    def supervisor() -> None:
        size = int.from_bytes(_recv_exactly(supervisor_end, 4), "big")
        frame = msgspec.msgpack.Decoder(_RequestFrame).decode(_recv_exactly(supervisor_end, size))
        received.append(ActivitySubprocess.decoder.validate_python(frame.body))
        supervisor_end.sendall(_ResponseFrame(id=frame.id).as_bytes())

    thread = threading.Thread(target=supervisor, daemon=True)
    thread.start()
    monkeypatch.setattr(task_runner, "SUPERVISOR_COMMS", CommsDecoder(socket=task_end), raising=False)
    try:
        skip_tasks(*dag_ids.QUESTION_CHAIN)
        thread.join(timeout=30)
    finally:
        task_end.close()
        supervisor_end.close()
    assert received == [SkipDownstreamTasks(tasks=[(t, -1) for t in dag_ids.QUESTION_CHAIN])]
    # The supervisor turns it into the Execution API's skip of those tasks.
    handler = inspect.getsource(ActivitySubprocess._handle_request)
    assert "isinstance(msg, SkipDownstreamTasks)" in handler and "skip_downstream_tasks(self.id, msg)" in handler


def test_the_channel_and_the_message_keep_their_shape() -> None:
    assert "SUPERVISOR_COMMS" in task_runner.__annotations__  # the module global the task runner sets
    assert list(inspect.signature(CommsDecoder.send).parameters) == ["self", "msg"]
    assert set(SkipDownstreamTasks.model_fields) == {"tasks", "type"}
    assert SkipDownstreamTasks(tasks=[("a", -1)]).model_dump() == {"tasks": [("a", -1)], "type": "SkipDownstreamTasks"}


def test_outside_a_task_nothing_is_sent(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delattr(task_runner, "SUPERVISOR_COMMS", raising=False)
    with caplog.at_level(logging.INFO, logger="tracegen.run.skip_tasks"):
        skip_tasks("resample_runaways")
    assert "not in an Airflow task: nothing to skip (resample_runaways)" in caplog.text


def test_the_public_skip_still_ends_the_task_and_ignores_a_mapped_caller() -> None:
    # Why the private channel: the SDK's public skip raises (the calling task ends there, its return value
    # never pushed), and from a mapped task instance it skips nothing.
    with pytest.raises(DownstreamTasksSkipped):
        SkipMixin._set_state_to_skipped(["ask_about_cap"], -1)
    assert SkipMixin._set_state_to_skipped(["ask_about_cap"], 0) is None
