"""Exceptions and small helpers for error messages that a user can act on."""

from __future__ import annotations

import torch


class BackendNotAvailableError(ValueError):
    """A pinned backend, or every backend, cannot run the requested problem.

    ``reasons`` maps each backend name to the list of reasons it declined.
    """

    def __init__(self, message: str, reasons: dict[str, list[str]] | None = None):
        super().__init__(message)
        self.reasons = reasons or {}


def describe(t: torch.Tensor | None) -> str:
    """One-line description of a tensor for error messages: shape, dtype, device."""
    if t is None:
        return "None"
    return f"Tensor(shape={tuple(t.shape)}, dtype={t.dtype}, device={t.device})"
