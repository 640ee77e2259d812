"""The jinja2 environment tracegen's HTML is rendered in: the audit report here, the review pages with their
own templates (`environment`).

Templates are files in a `templates/` directory beside the module that renders them, found by path (the
package runs from `include/` on sys.path; nothing installs package data). Autoescaping is on for every
template: whatever comes from the data (model text, error messages, server names, categories, run metadata,
run ids) reaches the page as text, never as markup. None renders as nothing, and an undefined name fails
loudly instead of rendering empty.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2

from tracegen.audit import formats


def environment(templates: Path) -> jinja2.Environment:
    """An autoescaping environment over the templates in `templates`, with the number formats as filters."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(templates),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        finalize=lambda value: "" if value is None else value,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(pct=formats.pct, num=formats.num, duration_fine=formats.duration_fine,
                       gpu_hours=formats.gpu_hours)
    return env


ENV = environment(Path(__file__).with_name("templates"))


def render(template: str, **context: Any) -> str:
    return ENV.get_template(template).render(**context)
