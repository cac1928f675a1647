"""Helpers for tests that run workers as real OS processes."""

from __future__ import annotations

import signal
import subprocess

__all__ = ["stop"]


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM ``process`` (its bus drains) and wait; SIGKILL it after 30 s."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
