"""A Griffe extension for the API pages: the code's docstrings name objects with Sphinx roles (``:class:`LlamaConfig```,
``:func:`lightning_mgpu.parameter_shape```), which Markdown would print as they are; this shows each as inline code."""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|obj|exc|const):`~?([^`]+)`")


class SphinxRolesAsCode(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(r"`\1`", obj.docstring.value)
