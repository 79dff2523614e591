"""The engine's malloc settings: applied on glibc, skipped when switched off."""

from __future__ import annotations

import platform

import pytest

from infer.runner.cpu.backend import MALLOC_ENV, keep_freed_memory


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_malloc_settings_apply_on_glibc():
    assert keep_freed_memory() is True


def test_malloc_settings_can_be_switched_off(monkeypatch):
    monkeypatch.setenv(MALLOC_ENV, "0")
    assert keep_freed_memory() is False
