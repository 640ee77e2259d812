"""Where a run may read and write is the operator's choice (TRACEGEN_WRITE_PREFIXES, TRACEGEN_READ_PREFIXES),
never the trigger's: a URI outside them is refused before anything is written, naming the param and the
setting; `..`, percent-encoded dots and links do not lead out of a prefix; S3 prefixes end on a `/`."""

from __future__ import annotations

from pathlib import Path

import pytest

from tracegen.common import locations
from tracegen.config import SAMPLE_DATASET, state_dir


@pytest.fixture
def allowed(tmp_path, monkeypatch) -> Path:
    """Only tmp_path/allowed (and the test bucket's `team/` prefix) may be written; nothing else is read."""
    base = tmp_path / "allowed"
    base.mkdir()
    monkeypatch.setenv(locations.WRITE_SETTING, f"{base},s3://tracegen-test/team")
    monkeypatch.setenv(locations.READ_SETTING, str(tmp_path / "datasets"))
    return base


def _refused(uri: str, access: str = locations.WRITE) -> str:
    with pytest.raises(locations.LocationRefused) as exc:
        locations.check(uri, access=access, name="output_uri")
    return str(exc.value)


def test_local_paths_are_compared_by_real_path(allowed, tmp_path):
    assert locations.check(str(allowed / "out"), access=locations.WRITE, name="output_uri")
    assert locations.check(f"file://{allowed}/out", access=locations.WRITE, name="output_uri")
    assert locations.check(str(allowed), access=locations.WRITE, name="output_uri")
    # `..` out of the prefix, spelled plainly, in a file:// URI, percent-encoded, or as a sibling sharing a stem.
    for uri in (f"{allowed}/../outside", f"file://{allowed}/../outside", f"file://{allowed}/%2e%2e/outside",
                f"{allowed}-b/out", "/etc", f"file://localhost{tmp_path}/x"):
        message = _refused(uri)
        assert "output_uri" in message and locations.WRITE_SETTING in message, message
        assert str(allowed) in message  # what is allowed, so the person who triggered knows where to write


def test_a_link_inside_a_prefix_does_not_lead_out(allowed, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (allowed / "link").symlink_to(outside)
    message = _refused(str(allowed / "link" / "out"))
    assert f"resolved to {outside / 'out'}" in message
    # A link to a place inside the prefix is that place.
    (allowed / "inner").mkdir()
    (allowed / "ok").symlink_to(allowed / "inner")
    assert locations.check(str(allowed / "ok" / "out"), access=locations.WRITE, name="output_uri")


def test_s3_prefixes_are_a_bucket_and_a_key_prefix_on_a_slash(allowed):
    for uri in ("s3://tracegen-test/team", "s3://tracegen-test/team/", "s3://tracegen-test/team/run-1/"):
        locations.check(uri, access=locations.WRITE, name="output_uri")
    for uri in ("s3://tracegen-test/team-b/x", "s3://tracegen-test/", "s3://other-bucket/team/x",
                "s3://tracegen-test/team/../other", "s3://tracegen-test/team/./x", "s3://tracegen-test/tea"):
        assert "output_uri" in _refused(uri)


def test_reading_is_allowed_under_the_read_and_the_write_prefixes(allowed, tmp_path):
    locations.check(str(tmp_path / "datasets" / "p.jsonl"), access=locations.READ, name="dataset_uri")
    locations.check(str(allowed / "p.jsonl"), access=locations.READ, name="dataset_uri")
    assert "dataset_uri" not in _refused(str(tmp_path / "datasets" / "p.jsonl"))  # not for writing
    message = _refused(str(tmp_path / "p.jsonl"), access=locations.READ)
    assert locations.READ_SETTING in message and locations.WRITE_SETTING in message


def test_unset_the_demo_state_dir_and_the_sample_data_are_allowed(monkeypatch, tmp_path):
    monkeypatch.delenv(locations.WRITE_SETTING, raising=False)
    monkeypatch.setenv(locations.READ_SETTING, "")  # empty is unset
    locations.check(str(state_dir() / "demo" / "output-1"), access=locations.WRITE, name="output_uri")
    locations.check(str(SAMPLE_DATASET), access=locations.READ, name="dataset_uri")
    _refused(str(SAMPLE_DATASET))  # read, not written
    _refused(str(tmp_path / "out"))


def test_a_bad_entry_in_the_setting_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv(locations.WRITE_SETTING, f"{tmp_path},relative/dir")
    message = _refused(str(tmp_path / "out"))
    assert "TRACEGEN_WRITE_PREFIXES" in message and "'relative/dir'" in message


@pytest.mark.parametrize(("uri", "shown", "host_only"), [
    ("https://u:p@h.example:8443/hooks/x?token=abc#frag", "https://h.example:8443/hooks/x", "https://h.example:8443"),
    ("http://user:pa/ss@host/p", "http://host/p", "http://host"),  # a '/' in the password
    ("http://user:p@ss@host/p", "http://host/p", "http://host"),  # an '@' in the password
    ("http://token@host", "http://host", "http://host"),
    ("https://b.s3.example/k?X-Amz-Signature=sig", "https://b.s3.example/k", "https://b.s3.example"),
    ("s3://bucket/runs/a`b", "s3://bucket/runs/a`b", "s3://bucket"),
    ("http://[::1]:8080/v1", "http://[::1]:8080/v1", "http://[::1]:8080"),
    ("http://h:8080/models/@latest", "http://h:8080/models/@latest", "http://h:8080"),
    ("/data/out?not-a-query", "/data/out?not-a-query", "/data/out?not-a-query"),  # a local path is as it is
    ("user:pw@host/x?q=1", "host/x", "host"),
    ("http://h/x\nFAKE LOG LINE", "http://h/x%0AFAKE LOG LINE", "http://h"),
    ("", "", ""),
], ids=["userinfo-query-fragment", "slash-in-password", "at-in-password", "token-user", "presigned", "s3",
        "ipv6", "at-in-path", "local-path", "no-scheme", "newline", "empty"])
def test_a_shown_location_holds_no_userinfo_query_or_fragment(uri: str, shown: str, host_only: str) -> None:
    assert locations.shown_location(uri) == shown
    assert locations.shown_location(uri, with_path=False) == host_only


@pytest.mark.parametrize("odd", [None, 42, b"http://u:p@h/", ["x"], "http://", "://@", "http://[::1", "\x00\x7f"])
def test_showing_an_odd_location_never_raises(odd) -> None:
    shown = locations.shown_location(odd)
    assert isinstance(shown, str) and "u:p" not in shown and shown.isprintable()
