"""The jinja2 environment the audit's HTML is rendered in.

Templates are files in `templates/` beside this module, found by path (the package runs from `include/` on
sys.path; nothing installs package data). Autoescaping is on for every template: whatever comes from the data
(model text, error messages, server names, categories, run metadata) reaches the page as text, never as
markup. None renders as nothing, and undefined names fail loudly instead of rendering empty.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2

from tracegen.audit import formats

TEMPLATES = Path(__file__).with_name("templates")

ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(TEMPLATES),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
    finalize=lambda value: "" if value is None else value,
    trim_blocks=True,
    lstrip_blocks=True,
)
ENV.filters.update(pct=formats.pct, num=formats.num, duration_fine=formats.duration_fine,
                   gpu_hours=formats.gpu_hours)


def render(template: str, **context: Any) -> str:
    return ENV.get_template(template).render(**context)
