"""The `sparserl_kv` backend's per-step decode state, in static buffers a CUDA graph can read.

A decode forward needs, per row of the (possibly padded) batch: the query ring row and the place in its window
where the row's query goes (the capture index), and the row's offset (logical minus physical length) added to
SGLang's positions for RoPE and for the sampler's noise keys. Under CUDA-graph replay SGLang runs the captured
kernels on the tensors they were captured with, so these live in buffers made once, for the largest batch, and
written in place before every decode forward (eagerly, or before a replay): one host-to-device copy of the
three rows from the host's bookkeeping, then one add into the logical-position buffer. Padding rows (a graph
padded to its captured size, or a capture's dummy batch) write their queries to the ring's spare row, place 0,
and are not shifted.

Pure torch, no sglang import: `kv_backend.py` drives it, the tests read it directly.
"""
from __future__ import annotations

import torch


class DecodeBuffers:
    """(3, capacity) long: ring rows, ring places, position offsets; and (capacity,) logical positions."""

    def __init__(self, capacity: int, device) -> None:
        self.device = torch.device(device)
        self.capacity = 0
        self.grow(capacity)

    def grow(self, capacity: int) -> None:
        """Room for `capacity` rows. Only before a graph captures them: it reallocates the buffers."""
        if capacity <= self.capacity:
            return
        self.capacity = capacity
        # Made outside inference mode: written under SGLang's inference mode and read wherever it reads them.
        with torch.inference_mode(False):
            self.index = torch.zeros((3, capacity), dtype=torch.long, device=self.device)
            self.logical = torch.zeros(capacity, dtype=torch.long, device=self.device)
        self.rows, self.places, self.offsets = self.index[0], self.index[1], self.index[2]

    def write(self, rows: list[int], places: list[int], offsets: list[int], padded: int, spare_row: int) -> None:
        """This forward's rows (host lists, one entry per real row), padded to `padded` rows with the spare row."""
        n = len(rows)
        if padded > self.capacity or n > padded:
            raise ValueError(f"sparserl_kv: a decode batch of {n} rows padded to {padded}, but the static decode "
                             f"buffers hold {self.capacity}")
        pad = padded - n
        pin = self.device.type == "cuda"
        staged = torch.tensor([rows + [spare_row] * pad, places + [0] * pad, offsets + [0] * pad], dtype=torch.long,
                              pin_memory=pin)
        self.index[:, :padded].copy_(staged, non_blocking=pin)

    def shift(self, positions: torch.Tensor) -> torch.Tensor:
        """The logical positions of a forward's first len(positions) rows, written into the static buffer (the
        returned tensor is a view of it, valid until the next decode forward)."""
        n = positions.shape[0]
        out = self.logical[:n]
        torch.add(positions.to(torch.long), self.offsets[:n], out=out)
        return out

    def capture_index(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Ring rows and places of a forward's first n query rows (views of the static buffer)."""
        return self.rows[:n], self.places[:n]
