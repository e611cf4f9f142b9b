import pytest

from megatron_apriel import _patches


def test_unsupported_megatron_version_fails_loudly(monkeypatch):
    monkeypatch.setattr(_patches, "mcore_version", lambda: "0.12.0")
    with pytest.raises(RuntimeError, match="megatron-core 0.12.0 is not supported"):
        _patches.check_mcore_version()


def test_installed_version_is_supported():
    assert _patches.check_mcore_version().startswith(_patches.SUPPORTED_MCORE_PREFIXES)
