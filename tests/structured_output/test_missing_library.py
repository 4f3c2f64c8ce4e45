"""Without xgrammar, a constrained request is a clear ValueError (runs where it is absent too)."""

from __future__ import annotations

import sys

import pytest

from pagoda.sampling_params import StructuredOutputsParams
from pagoda.structured_output import StructuredOutputManager


class _Tokenizer:
    """Never reached: the import fails first."""


def test_missing_xgrammar_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # makes `import xgrammar` fail
    mgr = StructuredOutputManager(_Tokenizer(), 1000, [2])
    with pytest.raises(ValueError, match=r"need the xgrammar package.*pagoda\[structured\]"):
        mgr.new_request(StructuredOutputsParams(regex="a"))
