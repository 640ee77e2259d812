"""The HTML templates of the audit report and the review pages: every one compiles, from the package's own
directory, and what they render is escaped."""

from __future__ import annotations

import pytest

from tracegen.audit.rendering import ENV as REPORT_ENV
from tracegen.review.page import ENV as PAGES_ENV


@pytest.mark.parametrize("env", [REPORT_ENV, PAGES_ENV], ids=["audit", "review"])
def test_every_template_compiles_and_escapes_what_it_renders(env) -> None:
    names = [n for n in env.list_templates() if n.endswith(".j2")]
    assert names
    for name in names:
        env.get_template(name)
    assert env.from_string("<p title='{{ x }}'>{{ x }}</p>").render(x="'<script>") == (
        "<p title='&#39;&lt;script&gt;'>&#39;&lt;script&gt;</p>")
    assert env.from_string("{{ x }}").render(x=None) == ""
